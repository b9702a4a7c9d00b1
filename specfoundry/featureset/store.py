"""Writer and reader of feature-set shards (Zarr v3 or safetensors), ragged over tokens.

A shard holds many samples concatenated along one token axis:
    offsets      int64  [S + 1]        sample i is tokens offsets[i]:offsets[i+1]
    input_ids    int32  [N]
    loss_mask    uint8  [N]
    aux_hidden   dtype  [N, K*H]       outputs of the K stored layers (ascending), concatenated
                                       (fp6_e2m3 / fp4_e2m1: uint8 [N, K*R], R bytes a row, blockfp.py)
    final_hidden dtype  [N, H]         the target's final normed hidden state (lm_head input)
    aux_scale    float32 [N, K]        only where aux_hidden is scaled (float8, or packed codes): one
                                       scale per token and layer (featureset/fp8.py, blockfp.py)
    final_scale  float32 [N, 1]        only where final_hidden is scaled
    teacher_ids  int32  [N, k]         a top-k teacher in the final state's place (featureset/teacher.py):
    teacher_probs float16 [N, k]       no final_hidden then
The aux and the final states each have their storage dtype (the manifest's storage_dtype and
final_storage_dtype). encode_state / decode_state turn float states into what is stored and back.
A shard is written under a hidden partial name and renamed into place when complete, then
listed in the manifest with its checksum: a crash never leaves a shard a reader trusts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specfoundry.common.files import checksum
from specfoundry.featureset import blockfp, fp8
from specfoundry.featureset.manifest import (
    MANIFEST,
    TOKEN_COUNTS,
    FeatureSetError,
    read_manifest,
    record_disagreements,
    stored_topk,
)

CODECS = ("zarr", "safetensors")
PACKED = {"fp6_e2m3": blockfp.FORMATS["fp6"], "fp4_e2m1": blockfp.FORMATS["fp4"]}
"""Storage dtypes of packed codes with block scales: a row of H values is blockfp's row_bytes(H) bytes."""
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3fn": fp8.E4M3, **{name: torch.uint8 for name in PACKED}}
SCALED = ("float8_e4m3fn", *PACKED)  # storage dtypes stored with one scale per row beside the values


def stored_row(dtype: str, width: int) -> int:
    """Stored elements (bytes for packed codes) of a row of `width` values."""
    return PACKED[dtype].row_bytes(width) if dtype in PACKED else width


def bytes_per_value(dtype: str) -> float:
    """Stored bytes a value, the row scale left out."""
    return PACKED[dtype].row_bytes(4096) / 4096 if dtype in PACKED else TORCH_DTYPES[dtype].itemsize


def relative_error(dtype: str) -> float:
    """The most a stored value may be off, relative to the row's largest element (0 for float
    dtypes, whose rounding is below 1e-2 of the row's norm): float8's 2^-4 of the element;
    packed codes' D / (2G) (1 + 2^-3) of their block's absmax (blockfp.py's bound)."""
    if dtype in PACKED:
        fmt = PACKED[dtype]
        return fmt.largest_gap / (2 * fmt.largest) * (1 + 2.0**-3)
    return fp8.RELATIVE_ERROR if dtype in SCALED else 0.0


def median_row_error(got: torch.Tensor, want: torch.Tensor, layers: int) -> torch.Tensor:
    """The median over tokens of each layer's relative L2 error, ||got_t - want_t|| / ||want_t||:
    [layers], from got, want [T, layers * H]. Per token and per layer because a few tokens' massive
    activations (the first token's states are tens of times any other's) dominate a norm or a maximum
    over the whole sample, which then misses features wrong at every other token or in one layer."""
    t = want.shape[0]
    got, want = got.float().reshape(t, layers, -1), want.float().reshape(t, layers, -1)  # [T, L, H]
    errors = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)  # [T, L]
    return errors.median(dim=0).values


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux_hidden: torch.Tensor  # [T, K*H] decoded (scaled dtypes: bfloat16), or as stored beside aux_scale
    final_hidden: torch.Tensor | None  # [T, H] likewise; None where it was not read
    aux_scale: torch.Tensor | None = None  # [T, K] float32: aux_hidden is scaled, not yet decoded
    final_scale: torch.Tensor | None = None  # [T, 1] float32: final_hidden is scaled, not yet decoded
    teacher_ids: torch.Tensor | None = None  # [T, k] int32: a top-k teacher (no final state then)
    teacher_probs: torch.Tensor | None = None  # [T, k] float16


def shard_name(index: int, codec: str) -> str:
    """Where shard `index` lives in a set (any rank may write any shard)."""
    suffix = "zarr" if codec == "zarr" else "safetensors"
    return f"shards/shard-{index:06d}.{suffix}"


# numpy has neither bfloat16 nor float8: those are stored as their bit patterns
BIT_PATTERNS = {"bfloat16": torch.uint16, "float8_e4m3fn": torch.uint8}


def to_storage(x: torch.Tensor, dtype: str) -> np.ndarray:
    """Torch tensor (already in the storage dtype, or a float one cast to it) -> numpy."""
    x = x.to(TORCH_DTYPES[dtype]).contiguous().cpu()
    return x.view(BIT_PATTERNS[dtype]).numpy() if dtype in BIT_PATTERNS else x.numpy()


def from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(TORCH_DTYPES[dtype]) if dtype in BIT_PATTERNS else t


def encode_state(x: torch.Tensor, dtype: str, layers: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float hidden states x [..., L*H] -> what a shard stores, on x's device: (values [..., L*H] in
    `dtype` (packed codes: uint8 [..., L*R]), scale [..., L] float32 for a scaled dtype (one per
    layer's row), else None)."""
    if dtype not in SCALED:
        return x.to(TORCH_DTYPES[dtype]), None
    rows = x.unflatten(-1, (layers, x.shape[-1] // layers))  # [..., L, H]
    values, scale = blockfp.quantize(rows, PACKED[dtype]) if dtype in PACKED else fp8.quantize(rows)
    return values.flatten(-2), scale  # [..., L*H] (or [..., L*R]), [..., L]


def decode_state(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype | None = None,
                 storage: str | None = None) -> torch.Tensor:
    """encode_state's inverse, on the values' device: values [..., L*H] (float8, or packed codes of
    the storage dtype `storage`, beside scale [..., L]; or a float dtype beside None) -> [..., L*H]
    in `dtype` (None: bfloat16 for a scaled dtype, else as stored)."""
    if scale is None:
        return values if dtype is None else values.to(dtype)
    layers = scale.shape[-1]
    rows = values.unflatten(-1, (layers, values.shape[-1] // layers))  # [..., L, H] (or [..., L, R])
    if values.dtype == torch.uint8:
        if storage not in PACKED:
            raise ValueError(f"packed states decode only with their storage dtype ({', '.join(PACKED)}), "
                             f"not {storage!r}")
        return blockfp.dequantize(rows, scale, PACKED[storage], dtype or torch.bfloat16).flatten(-2)
    return fp8.dequantize(rows, scale, dtype or torch.bfloat16).flatten(-2)


EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                 torch.float32: (torch.int32, 0x7F800000)}
"""Per IEEE float dtype: the integer view of its bits, and the mask of its exponent field."""


def all_finite(x: torch.Tensor) -> bool:
    """torch.isfinite(x).all() in one integer pass: an IEEE value is NaN or Inf exactly when its
    exponent bits are all ones (on a CPU torch.isfinite over bf16 runs unvectorised, ~4x slower)."""
    if x.dtype not in EXPONENT_BITS:
        return bool(torch.isfinite(x).all())
    as_int, mask = EXPONENT_BITS[x.dtype]
    return not bool(((x.view(as_int) & mask) == mask).any())


def is_finite(values: torch.Tensor, scale: torch.Tensor | None, storage: str | None = None) -> bool:
    """Whether stored states decode to finite values only (scaled dtypes: without decoding them);
    packed codes need their storage dtype."""
    if scale is None:
        return all_finite(values)
    if values.dtype != torch.uint8:
        return fp8.is_finite(values, scale)
    return blockfp.is_finite(values.unflatten(-1, (scale.shape[-1], -1)), scale, PACKED[storage])


def impossible_scales(values: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
    """[..., L] bool: rows whose scales no capture writes (fp8.impossible_scales, blockfp.impossible_scales)."""
    if storage in PACKED:
        return blockfp.impossible_scales(values, scale, PACKED[storage])
    return fp8.impossible_scales(values, scale)


def write_shard(root: Path, rel: str, samples: list[dict], codec: str, dtype: str,
                final_dtype: str | None = None, layers: int | None = None) -> str:
    """Write samples as shard `rel` of the set at `root`, atomically (under a partial name, then
    renamed); returns the shard's checksum."""
    final = root / rel
    tmp = final.parent / f".partial-{final.name}"
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    digest = write_shard_file(tmp, samples, codec, dtype, final_dtype, layers)
    os.replace(tmp, final)
    return digest


def stored_state(sample: dict, state: str, dtype: str, layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sample's aux or final state as a shard stores it: (values, scale or None). Either the
    capture runner encoded it already (scaled values with `<state>_scale` beside them), or it
    holds float states, encoded here (`layers`: the aux state's; by default its width over the
    final state's)."""
    x, scale = sample[f"{state}_hidden"], sample.get(f"{state}_scale")
    if scale is not None:
        assert dtype in SCALED and x.dtype == TORCH_DTYPES[dtype], (state, dtype, x.dtype)
        return x, scale
    if dtype not in SCALED:  # a cast, row by row alike
        return encode_state(x, dtype, 1)
    if state == "final":
        layers = 1
    elif layers is None:
        layers = x.shape[-1] // sample["final_hidden"].shape[-1]
    return encode_state(x, dtype, layers)


def stored_states(entries: tuple, teacher: bool) -> tuple:
    """entries: one entry per state, the aux layers' then the final state's; those a shard stores:
    both, or the aux layers' alone where a top-k teacher takes the final state's place."""
    return entries[:1] if teacher else entries


def write_shard_file(path: Path, samples: list[dict], codec: str, dtype: str, final_dtype: str | None = None,
                     layers: int | None = None) -> str:
    """Write samples ({input_ids, loss_mask, aux_hidden, final_hidden} tensors, with
    aux_scale / final_scale where the runner encoded them; teacher_ids and teacher_probs in the
    final state's place for a top-k teacher) as one shard at `path` (a Zarr group folder or a
    safetensors file), the aux states in `dtype` and the final ones in `final_dtype` (None:
    `dtype`); `layers`: the aux states' (needed only for float states of a scaled dtype without a
    final state beside them); returns its checksum."""
    lengths = [len(s["input_ids"]) for s in samples]
    # each array as the per-sample blocks that, stacked along dim 0, make the shard's array
    blocks = {
        "offsets": [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)],
        "input_ids": [s["input_ids"].to(torch.int32).numpy() for s in samples],
        "loss_mask": [s["loss_mask"].to(torch.uint8).numpy() for s in samples],
    }
    scales = {}  # after the hidden states, so a set without float8 has the layout it always had
    teacher = bool(samples) and "teacher_ids" in samples[0]
    for state, state_dtype in stored_states((("aux", dtype), ("final", final_dtype or dtype)), teacher):
        encoded = [stored_state(s, state, state_dtype, layers) for s in samples]
        blocks[f"{state}_hidden"] = [to_storage(values, state_dtype) for values, _ in encoded]
        if state_dtype in SCALED:
            scales[f"{state}_scale"] = [scale.float().contiguous().cpu().numpy() for _, scale in encoded]
    blocks.update(scales)
    if teacher:
        blocks["teacher_ids"] = [s["teacher_ids"].to(torch.int32).contiguous().cpu().numpy() for s in samples]
        blocks["teacher_probs"] = [s["teacher_probs"].to(torch.float16).contiguous().cpu().numpy() for s in samples]
    if codec == "zarr":
        _write_zarr(path, {name: np.concatenate(b) for name, b in blocks.items()})
        return checksum(path)
    if codec == "safetensors":
        return write_safetensors(path, blocks)
    raise FeatureSetError(f"unknown codec {codec!r}: choose zarr or safetensors")


SAFETENSORS_DTYPES = {"int64": "I64", "int32": "I32", "uint8": "U8", "uint16": "U16", "float16": "F16",
                      "float32": "F32"}


def write_safetensors(path: Path, blocks: dict[str, list[np.ndarray]]) -> str:
    """Write a safetensors file whose tensor `name` is np.concatenate(blocks[name]), streaming
    every block straight to the file and into a sha256: no concatenated copy is made and the
    file is not read back. Returns the file's sha256 (= checksum(path)).

    The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}} padded with spaces to a multiple of 8, then the tensors' bytes back to back
    in header order. hashlib and file writes release the GIL on large buffers, so several
    writer threads run in parallel."""
    header, start = {}, 0
    for name, parts in blocks.items():
        first = parts[0]
        if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts):
            raise FeatureSetError(f"{path}: blocks of {name!r} differ in dtype or trailing shape")
        nbytes = sum(p.nbytes for p in parts)
        header[name] = {"dtype": SAFETENSORS_DTYPES[first.dtype.name],
                        "shape": [sum(p.shape[0] for p in parts), *first.shape[1:]],
                        "data_offsets": [start, start + nbytes]}
        start += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        for piece in (struct.pack("<Q", len(text)), text):
            h.update(piece)
            fh.write(piece)
        for parts in blocks.values():
            for p in parts:
                if not p.nbytes:
                    continue  # an empty block adds nothing (and memoryview cannot cast it)
                view = memoryview(np.ascontiguousarray(p)).cast("B")
                h.update(view)
                fh.write(view)
    return h.hexdigest()


def _write_zarr(path: Path, arrays: dict[str, np.ndarray]) -> None:
    import zarr
    from zarr.codecs import BloscCodec

    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    for name, a in arrays.items():
        # rows of 256 tokens per chunk: a sample read touches only the chunks it spans; one
        # storage shard per array keeps the file count small. Byte shuffle groups the high
        # (exponent) bytes of bf16 together, which is what compresses.
        rows = min(256, max(1, a.shape[0]))
        chunks = (rows,) + a.shape[1:]
        shards = ((a.shape[0] + rows - 1) // rows * rows,) + a.shape[1:] if a.shape[0] else None
        codec = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle" if a.itemsize > 1 else "noshuffle",
                           typesize=a.itemsize)
        group.create_array(name, shape=a.shape, dtype=a.dtype, chunks=chunks, shards=shards,
                           compressors=[codec], overwrite=True)
        if a.size:
            group[name][...] = a


def expected_arrays(manifest: dict, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Array name -> (shape, torch dtype as read from disk) of a shard of n tokens."""
    h, k = manifest["hidden_size"], len(manifest["aux_layer_ids"])
    out = {"input_ids": ((n,), torch.int32), "loss_mask": ((n,), torch.uint8)}
    teacher_k = stored_topk(manifest)
    states = (("aux", k, manifest["storage_dtype"]), ("final", 1, manifest["final_storage_dtype"]))
    for state, layers, dtype in stored_states(states, bool(teacher_k)):
        out[f"{state}_hidden"] = ((n, layers * stored_row(dtype, h)), BIT_PATTERNS.get(dtype, TORCH_DTYPES[dtype]))
        if dtype in SCALED:
            out[f"{state}_scale"] = ((n, layers), torch.float32)
    if teacher_k:
        out["teacher_ids"], out["teacher_probs"] = ((n, teacher_k), torch.int32), ((n, teacher_k), torch.float16)
    return out


def arrays_off_record(r: ShardReader, manifest: dict) -> dict[str, tuple[tuple, tuple]]:
    """The shard's arrays whose (shape, dtype) on disk are not what the manifest describes for its
    tokens (expected_arrays): name -> (found, expected), each (shape, torch dtype)."""
    expected = expected_arrays(manifest, int(r.offsets[-1]))
    found = {name: (r.shape(name), torch.from_numpy(r.rows(name, 0, 0)).dtype) for name in expected}
    return {name: (found[name], want) for name, want in expected.items() if found[name] != want}


def shard_records_problem(root: Path, manifest: dict) -> str | None:
    """What makes the manifest's shard records disagree with one another, in one line naming the
    first, or None: a count that is not a whole number, a shard whose sample lengths are not
    num_samples whole numbers summing to its num_tokens, or totals not the set's counts. A
    hand-edited manifest (shards dropped, counts changed) is refused here, before a shard is read;
    sf-capture verify and check_shard compare each record with its shard."""
    where = Path(root) / MANIFEST
    totals = {"samples": 0, "tokens": 0}
    for entry in manifest.get("shards", []):
        name, n, lengths = entry.get("path"), entry.get("num_samples"), entry.get("sample_lengths")
        if not whole(n) or not isinstance(lengths, list) or not all(whole(x) and x > 0 for x in lengths):
            return f"{where}: shard {name}: num_samples and sample_lengths are not whole numbers (an edited manifest)"
        if len(lengths) != n or ("num_tokens" in entry and sum(lengths) != entry["num_tokens"]):
            return (f"{where}: shard {name} records {n} samples, {len(lengths)} sample lengths summing to "
                    f"{sum(lengths)} and {entry.get('num_tokens')} tokens (an edited manifest: restore it, or recapture)")
        totals["samples"] += n
        totals["tokens"] += sum(lengths)
    counts = manifest.get("counts", {})
    for key, held in totals.items():
        if manifest.get("complete") and key in counts and counts[key] != held:
            return (f"{where}: counts {key}={counts[key]}, its shard records hold {held} (an edited manifest: "
                    "restore it, or recapture)")
    return None


def whole(x) -> bool:
    """A JSON whole number at least 0 (not a bool, not a string of digits)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class ShardReader:
    """Random access to one shard's samples without reading the rest of the shard."""

    def __init__(self, path: Path, codec: str, dtype: str, final_dtype: str | None = None,
                 teacher_k: int | None = None):
        """dtype, final_dtype: the storage dtypes of the aux and of the final states (None: dtype);
        teacher_k: the shard holds a top-k teacher instead of the final state."""
        self.path, self.codec, self.teacher_k = path, codec, teacher_k
        self.dtypes = {"aux": dtype} if teacher_k else {"aux": dtype, "final": final_dtype or dtype}
        if codec == "zarr":
            import zarr

            self.group = zarr.open_group(str(path), mode="r")
            self.offsets = np.asarray(self.group["offsets"][:])
        else:
            from safetensors import safe_open

            self.file = safe_open(str(path), framework="numpy")
            self.offsets = self.file.get_tensor("offsets")
        names = set(self.group.array_keys()) if codec == "zarr" else set(self.file.keys())
        missing = [f"{state}_scale" for state, d in self.dtypes.items() if d in SCALED and f"{state}_scale" not in names]
        if missing:  # a scaled state cannot be read without its scales
            raise FeatureSetError(f"{path}: no {' or '.join(missing)} array, which scaled states need: the "
                                  "manifest's storage dtypes are not the ones this shard was written in")
        wanted = {"teacher_ids", "teacher_probs"} if teacher_k else {"final_hidden"}
        if not wanted <= names:
            raise FeatureSetError(f"{path}: no {' or '.join(sorted(wanted - names))} array: the manifest's teacher "
                                  "is not the one this shard was written with")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample_lengths(self) -> list[int]:
        """Each sample's tokens, in order: what the manifest records as the shard's sample_lengths."""
        return np.diff(self.offsets).tolist()

    def shape(self, name: str) -> tuple[int, ...]:
        """An array's shape, from the shard's metadata alone."""
        if self.codec == "zarr":
            return tuple(self.group[name].shape)
        return tuple(self.file.get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self.codec == "zarr":
            return self.group[name][start:stop]
        return self.file.get_slice(name)[start:stop]

    def state(self, state: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens start:stop of the aux or final state as stored: (values, float32 scale or None)."""
        dtype = self.dtypes[state]
        values = from_storage(self.rows(f"{state}_hidden", start, stop), dtype)
        scale = torch.from_numpy(self.rows(f"{state}_scale", start, stop)) if dtype in SCALED else None
        return values, scale

    def sample(self, i: int, final: bool = True, decode: bool = True) -> Sample:
        """Sample i; without its final state (None, not read) unless `final`. decode: scaled states
        decoded to bfloat16 here; else as stored, with their scales (the loader decodes them on
        the training device)."""
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        states = {"final_hidden": None}
        for state in ("aux", "final") if final and not self.teacher_k else ("aux",):
            values, scale = self.state(state, start, stop)
            if decode:
                values, scale = decode_state(values, scale, storage=self.dtypes[state]), None
            states[f"{state}_hidden"], states[f"{state}_scale"] = values, scale
        if final and self.teacher_k:
            states["teacher_ids"] = torch.from_numpy(np.ascontiguousarray(self.rows("teacher_ids", start, stop)))
            states["teacher_probs"] = torch.from_numpy(np.ascontiguousarray(self.rows("teacher_probs", start, stop)))
        return Sample(input_ids=torch.from_numpy(self.rows("input_ids", start, stop).astype(np.int64)),
                      loss_mask=torch.from_numpy(self.rows("loss_mask", start, stop).astype(np.bool_)), **states)


class FeatureSet:
    """A feature set on disk: its manifest and an index over every sample of every shard."""

    def __init__(self, root: str | Path):
        """Opens the manifest and indexes the samples; shards are opened as read, their checksums
        checked only when asked (check_shards: sf-train does it once a run, before its first step)."""
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        edited = record_disagreements(self.root, self.manifest)
        if edited:
            raise FeatureSetError(edited[0])
        if problem := shard_records_problem(self.root, self.manifest):
            raise FeatureSetError(problem)
        self.codec = self.manifest["codec"]
        self.dtype = self.manifest["storage_dtype"]
        self.final_dtype = self.manifest["final_storage_dtype"]
        self.teacher_k = stored_topk(self.manifest)  # a top-k teacher in the final state's place, or None
        self.shards = self.manifest["shards"]
        self._readers: dict[int, ShardReader] = {}
        # global sample index -> (shard, index in shard); lengths for length-grouped batching
        self.index: list[tuple[int, int]] = []
        self.lengths: list[int] = []
        for s, entry in enumerate(self.shards):
            self.index += [(s, i) for i in range(entry["num_samples"])]
            self.lengths += entry["sample_lengths"]

    def __len__(self) -> int:
        return len(self.index)

    def shard_path(self, shard: int) -> Path:
        """Where shard `shard` lies; FeatureSetError naming it where it is missing."""
        entry = self.shards[shard]
        path = self.root / entry["path"]
        if not path.exists():
            raise FeatureSetError(f"{self.root}: shard {entry['path']} listed in the manifest is missing")
        return path

    def check_shard(self, shard: int) -> None:
        """Shard `shard` is on disk, its checksum is the manifest's (one read of it), and its samples'
        lengths and arrays' shapes are what the manifest records (a manifest edited to agree with
        itself); FeatureSetError naming it otherwise."""
        entry = self.shards[shard]
        if checksum(self.shard_path(shard)) != entry["sha256"]:
            raise FeatureSetError(f"{self.root}: shard {entry['path']} is damaged or truncated (checksum "
                                  "mismatch); recapture it (rerun the sf-capture command after deleting it)")
        try:
            r = ShardReader(self.shard_path(shard), self.codec, self.dtype, self.final_dtype, self.teacher_k)
            wrong = list(arrays_off_record(r, self.manifest))
        except FeatureSetError:
            raise
        except Exception as e:  # noqa: BLE001 - a manifest value the reader cannot use: one line, on every rank
            raise FeatureSetError(f"{self.root}: shard {entry['path']} cannot be read as {MANIFEST} describes it "
                                  f"({type(e).__name__}: {e}): restore the manifest, or recapture") from None
        if r.sample_lengths() != entry["sample_lengths"] or wrong:
            what = f"its {', '.join(wrong)} shape or dtype" if wrong else "its samples' lengths"
            raise FeatureSetError(f"{self.root}: shard {entry['path']}: {what} is not what {MANIFEST} records "
                                  "(an edited manifest: restore it, or recapture)")

    def check_shards(self, shards: list[int], threads: int = 8) -> Iterator[int]:
        """check_shard over `shards`, `threads` at a time (hashlib and file reads release the GIL),
        yielding each shard once checked, in the order given; the first damaged one raises."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=max(1, min(threads, len(shards))))
        try:
            for shard, _ in zip(shards, pool.map(self.check_shard, shards), strict=True):
                yield shard
        finally:  # after a damaged shard (or a caller that stops early) the queued ones are not read
            pool.shutdown(wait=True, cancel_futures=True)

    def reader(self, shard: int) -> ShardReader:
        if shard not in self._readers:
            entry = self.shards[shard]
            path = self.shard_path(shard)
            try:
                self._readers[shard] = ShardReader(path, self.codec, self.dtype, self.final_dtype, self.teacher_k)
            except FeatureSetError:
                raise
            except Exception as e:  # noqa: BLE001 - zarr and safetensors raise many types for a damaged file
                raise FeatureSetError(f"{self.root}: shard {entry['path']} is unreadable ({type(e).__name__})") from e
        return self._readers[shard]

    def where(self, i: int) -> str:
        """Where sample i lives, for messages: its shard, index in the shard and id."""
        shard, j = self.index[i]
        ids = self.shards[shard].get("sample_ids")
        return f"{self.root}: shard {self.shards[shard]['path']} sample {j}" + (f" (id {ids[j]})" if ids else "")

    def __getitem__(self, i: int) -> Sample:
        """Sample i with its hidden states decoded (float8 ones to bfloat16)."""
        return self.read(i)

    def read(self, i: int, final: bool = True, decode: bool = True) -> Sample:
        """Sample i; without its final state (final_hidden None, not read from disk) unless `final`;
        float8 states as stored, beside their scales, unless `decode`."""
        shard, j = self.index[i]
        return self.reader(shard).sample(j, final, decode)

    def token_counts(self) -> torch.Tensor:
        """The loss-masked token counts [V] (TOKEN_COUNTS), checked against the checksum and the
        vocabulary size the manifest records: FeatureSetError (one line, naming the file) for a file
        that is missing, damaged, replaced or of another vocabulary."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.root / TOKEN_COUNTS
        problem = token_counts_problem(self.root, self.manifest)
        if problem:
            raise FeatureSetError(problem)
        try:
            return load_file(str(path))["counts"]
        except (SafetensorError, KeyError) as e:  # (a set captured before its checksum was recorded)
            raise FeatureSetError(f"{path}: not a token-count file ({e}): recapture the set") from None

    def __getstate__(self):  # loader workers reopen shards themselves
        state = dict(self.__dict__)
        state["_readers"] = {}
        return state


def token_counts_problem(root: Path, manifest: dict) -> str | None:
    """What is wrong with a complete set's TOKEN_COUNTS file, in one line naming it, or None: missing,
    its checksum not the one the manifest records (where it records one), or its vocabulary not the
    target's."""
    from safetensors import safe_open

    path = Path(root) / TOKEN_COUNTS
    if not path.is_file():
        return f"{path}: missing (the set's loss-masked token counts): recapture the set"
    recorded = manifest.get("token_counts_sha256")
    if recorded is not None and checksum(path) != recorded:
        return f"{path}: checksum mismatch (the file was changed or damaged): recapture the set"
    try:
        with safe_open(str(path), "pt") as f:
            shape = f.get_slice("counts").get_shape()
    except Exception as e:  # noqa: BLE001 - any unreadable file is the one line below
        return f"{path}: not a readable token-count file ({str(e).splitlines()[0]}): recapture the set"
    vocab = manifest.get("target", {}).get("vocab_size")
    if vocab is not None and list(shape) != [vocab]:
        return f"{path}: counts of shape {list(shape)}, the target's vocabulary is {vocab}: recapture the set"
    return None
