"""Writer and reader of feature-set shards (Zarr v3 or safetensors), ragged over tokens.

A shard holds many samples concatenated along one token axis:
    offsets      int64  [S + 1]        sample i is tokens offsets[i]:offsets[i+1]
    input_ids    int32  [N]
    loss_mask    uint8  [N]
    aux_hidden   dtype  [N, K*H]       outputs of the K stored layers (ascending), concatenated
    final_hidden dtype  [N, H]         the target's final normed hidden state (lm_head input)
A shard is written under a hidden partial name and renamed into place when complete, then
listed in the manifest with its checksum: a crash never leaves a shard a reader trusts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specfoundry.common.files import checksum
from specfoundry.featureset.manifest import FeatureSetError, read_manifest

FIELDS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")
CODECS = ("zarr", "safetensors")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux_hidden: torch.Tensor  # [T, K*H] storage dtype
    final_hidden: torch.Tensor | None  # [T, H] storage dtype; None where it was not read


def shard_name(index: int, codec: str) -> str:
    """Where shard `index` lives in a set (any rank may write any shard)."""
    suffix = "zarr" if codec == "zarr" else "safetensors"
    return f"shards/shard-{index:06d}.{suffix}"


def to_storage(x: torch.Tensor, dtype: str) -> np.ndarray:
    """Torch tensor -> numpy in the storage dtype (bf16 as its uint16 bit pattern)."""
    x = x.to(TORCH_DTYPES[dtype]).contiguous().cpu()
    return x.view(torch.uint16).numpy() if dtype == "bfloat16" else x.numpy()


def from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def write_shard(root: Path, rel: str, samples: list[dict], codec: str, dtype: str) -> str:
    """Write samples as shard `rel` of the set at `root`, atomically (under a partial name, then
    renamed); returns the shard's checksum."""
    final = root / rel
    tmp = final.parent / f".partial-{final.name}"
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    digest = write_shard_file(tmp, samples, codec, dtype)
    os.replace(tmp, final)
    return digest


def write_shard_file(path: Path, samples: list[dict], codec: str, dtype: str) -> str:
    """Write samples ({input_ids, loss_mask, aux_hidden, final_hidden} tensors) as one shard at
    `path` (a Zarr group folder or a safetensors file); returns its checksum."""
    lengths = [len(s["input_ids"]) for s in samples]
    # each array as the per-sample blocks that, stacked along dim 0, make the shard's array
    blocks = {
        "offsets": [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)],
        "input_ids": [s["input_ids"].to(torch.int32).numpy() for s in samples],
        "loss_mask": [s["loss_mask"].to(torch.uint8).numpy() for s in samples],
        "aux_hidden": [to_storage(s["aux_hidden"], dtype) for s in samples],
        "final_hidden": [to_storage(s["final_hidden"], dtype) for s in samples],
    }
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


class ShardReader:
    """Random access to one shard's samples without reading the rest of the shard."""

    def __init__(self, path: Path, codec: str, dtype: str):
        self.path, self.codec, self.dtype = path, codec, dtype
        if codec == "zarr":
            import zarr

            self.group = zarr.open_group(str(path), mode="r")
            self.offsets = np.asarray(self.group["offsets"][:])
        else:
            from safetensors import safe_open

            self.file = safe_open(str(path), framework="numpy")
            self.offsets = self.file.get_tensor("offsets")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self.codec == "zarr":
            return self.group[name][start:stop]
        return self.file.get_slice(name)[start:stop]

    def sample(self, i: int, fields=FIELDS) -> Sample | dict:
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        out = {}
        for name in fields:
            a = self.rows(name, start, stop)
            if name == "input_ids":
                out[name] = torch.from_numpy(a.astype(np.int64))
            elif name == "loss_mask":
                out[name] = torch.from_numpy(a.astype(np.bool_))
            else:
                out[name] = from_storage(a, self.dtype)
        return Sample(**out) if tuple(fields) == FIELDS else out


class FeatureSet:
    """A feature set on disk: its manifest and an index over every sample of every shard."""

    def __init__(self, root: str | Path, verify: bool = False):
        """verify: check each shard's checksum against the manifest when this process first
        opens it (one read of the shard), so a damaged or truncated shard is named, not trained on."""
        self.root = Path(root)
        self.verify = verify
        self.manifest = read_manifest(self.root)
        self.codec = self.manifest["codec"]
        self.dtype = self.manifest["storage_dtype"]
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

    def reader(self, shard: int) -> ShardReader:
        if shard not in self._readers:
            entry = self.shards[shard]
            path = self.root / entry["path"]
            if not path.exists():
                raise FeatureSetError(f"{self.root}: shard {entry['path']} listed in the manifest is missing")
            if self.verify and checksum(path) != entry["sha256"]:
                raise FeatureSetError(f"{self.root}: shard {entry['path']} is damaged or truncated (checksum "
                                      "mismatch); recapture it (rerun the sf-capture command after deleting it)")
            try:
                self._readers[shard] = ShardReader(path, self.codec, self.dtype)
            except Exception as e:  # noqa: BLE001 - zarr and safetensors raise many types for a damaged file
                raise FeatureSetError(f"{self.root}: shard {entry['path']} is unreadable ({type(e).__name__})") from e
        return self._readers[shard]

    def where(self, i: int) -> str:
        """Where sample i lives, for messages: its shard, index in the shard and id."""
        shard, j = self.index[i]
        ids = self.shards[shard].get("sample_ids")
        return f"{self.root}: shard {self.shards[shard]['path']} sample {j}" + (f" (id {ids[j]})" if ids else "")

    def __getitem__(self, i: int) -> Sample:
        shard, j = self.index[i]
        return self.reader(shard).sample(j)

    def read(self, i: int, final: bool = True) -> Sample:
        """Sample i; without its final state (final_hidden None, not read from disk) unless `final`."""
        if final:
            return self[i]
        shard, j = self.index[i]
        return Sample(**self.reader(shard).sample(j, FIELDS[:3]), final_hidden=None)

    def token_counts(self) -> torch.Tensor:
        from safetensors.torch import load_file

        return load_file(str(self.root / "token_counts.safetensors"))["counts"]

    def __getstate__(self):  # loader workers reopen shards themselves
        state = dict(self.__dict__)
        state["_readers"] = {}
        return state
