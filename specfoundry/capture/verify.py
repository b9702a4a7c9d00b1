"""`sf-capture verify`: check a feature set against its manifest, and optionally recompute."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specfoundry.common.files import checksum
from specfoundry.common.progress import Progress
from specfoundry.featureset.manifest import FeatureSetError, read_manifest, record_disagreements, stored_topk
from specfoundry.featureset.store import (
    FeatureSet,
    ShardReader,
    arrays_off_record,
    decode_state,
    impossible_scales,
    is_finite,
    median_row_error,
    relative_error,
    shard_records_problem,
    stored_states,
    token_counts_problem,
)

CHUNK = 8192  # tokens decoded at once by the NaN/Inf check


def teacher_problem(r: ShardReader, n: int, vocab_size: int) -> str | None:
    """What is wrong with a shard's top-k teacher, at its first wrong token, or None: an id outside
    the vocabulary, a probability not finite or outside [0, 1], a row not most probable first, or
    a row whose kept mass passes 1 by more than float16's rounding of its k terms."""
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        ids = torch.from_numpy(r.rows("teacher_ids", start, stop)).long()  # [c, k]
        probs = torch.from_numpy(r.rows("teacher_probs", start, stop)).float()  # [c, k]
        k = ids.shape[1]
        checks = (("an id outside the vocabulary", ((ids < 0) | (ids >= vocab_size)).any(-1)),
                  ("a probability that is not finite or not in [0, 1]", (~torch.isfinite(probs) | (probs < 0)
                                                                         | (probs > 1)).any(-1)),
                  ("probabilities not in descending order", (probs[:, 1:] > probs[:, :-1]).any(-1)),
                  ("a kept mass above 1", probs.sum(-1) > 1 + k * 2.0**-11))
        for what, bad in checks:
            if bad.any():
                token = start + int(bad.nonzero()[0, 0])
                return f"{what} at {located(r, token, 'the teacher')}"
    return None


def located(r: ShardReader, token: int, layer: str) -> str:
    """'sample j, token t, layer ...' of a token of the shard's flat token axis."""
    j = int((torch.from_numpy(r.offsets[1:]) <= token).sum())
    return f"sample {j}, token {token - int(r.offsets[j])}, {layer}"


def nonfinite_in(values: torch.Tensor, scale: torch.Tensor | None, layers: list[str],
                 storage: str) -> tuple[int, str] | None:
    """The first (row, layer name) of a chunk of stored states [rows, L*H] holding a NaN or Inf once
    decoded, or None. is_finite answers for the stored values first (one pass, no float32 copy: a
    bf16 value is finite exactly when its float32 value is; a float8 value times its scale is
    finite when no value is NaN and scale x 448 is finite; packed codes likewise by their block
    scales); only a chunk it doubts is decoded."""
    if is_finite(values, scale, storage):
        return None
    x = decode_state(values, scale, torch.float32, storage)  # [rows, L*H]
    bad = (~torch.isfinite(x.unflatten(-1, (len(layers), -1)))).any(-1).nonzero()  # [?, 2]: (row, layer)
    return (int(bad[0, 0]), layers[int(bad[0, 1])]) if len(bad) else None


def check_state(r: ShardReader, state: str, n: int, layers: list[str]) -> tuple[str | None, str | None]:
    """One read of a stored state, chunk by chunk, for (nonfinite, scale), at most one of them set:
    nonfinite, where its first NaN or Inf lies after decoding ('sample j, token t, layer ...');
    else scale, a scaled state's first scale no capture writes (store.impossible_scales): its row
    scale and where. (None, None) for a sound state."""
    first_scale = None
    storage = r.dtypes[state]
    for start in range(0, n, CHUNK):
        values, scale = r.state(state, start, min(n, start + CHUNK))
        bad = nonfinite_in(values, scale, layers, storage)
        if bad:
            return located(r, start + bad[0], bad[1]), None
        if scale is not None and first_scale is None:
            wrong = impossible_scales(values, scale, storage).nonzero()  # [?, 2]: (row, layer)
            if len(wrong):
                row, layer = int(wrong[0, 0]), int(wrong[0, 1])
                first_scale = f"{float(scale[row, layer])} at {located(r, start + row, layers[layer])}"
    return None, first_scale


def check_shard(root: Path, manifest: dict, entry: dict) -> tuple[list[str], dict]:
    """(problems, {samples, tokens, loss_tokens} it holds) of one shard listed in the manifest."""
    path = root / entry["path"]
    if not path.exists():
        return [f"{entry['path']}: listed in the manifest but missing"], {}
    if checksum(path) != entry["sha256"]:
        return [f"{entry['path']}: checksum mismatch (the shard was changed or damaged)"], {}
    try:
        r = ShardReader(path, manifest["codec"], manifest["storage_dtype"], manifest["final_storage_dtype"],
                        stored_topk(manifest))
        n = int(r.offsets[-1])
        off_record = arrays_off_record(r, manifest)
        mask = r.rows("loss_mask", 0, n)
    except FeatureSetError as e:  # the shard is sound, but not what the manifest says
        return [str(e)], {}
    except Exception as e:  # noqa: BLE001 - any read failure is a damaged shard
        return [f"{entry['path']}: unreadable ({type(e).__name__}: {e})"], {}
    problems = [f"{entry['path']}: {name} is {got[1]} {got[0]}, expected {dtype} {shape}"
                for name, (got, (shape, dtype)) in off_record.items()]
    if len(r) != entry["num_samples"] or n != entry["num_tokens"]:
        problems.append(f"{entry['path']}: holds {len(r)} samples / {n} tokens, manifest says "
                        f"{entry['num_samples']} / {entry['num_tokens']}")
    elif r.sample_lengths() != list(entry["sample_lengths"]):
        problems.append(f"{entry['path']}: the manifest's sample lengths are not the shard's (an edited manifest: "
                        "restore it, or recapture)")
    if not problems and stored_topk(manifest):
        wrong = teacher_problem(r, n, manifest["target"]["vocab_size"])
        if wrong:
            problems.append(f"{entry['path']}: teacher_ids / teacher_probs hold {wrong}")
    if not problems:
        for state, layers in (("aux", [f"layer {i}" for i in manifest["aux_layer_ids"]]), ("final", ["final state"])):
            if state not in r.dtypes:  # a top-k teacher in the final state's place
                continue
            where, scale = check_state(r, state, n, layers)
            if where:
                problems.append(f"{entry['path']}: {state}_hidden holds NaN or Inf at {where}")
            if scale:
                rule = ("a scale is absmax/448: never negative, and 0 only for a row of zeros" if r.dtypes[state]
                        == "float8_e4m3fn" else "a row's scale and its blocks' scales are never negative, and the "
                        "row's is 0 only for a row of zeros")
                problems.append(f"{entry['path']}: {state}_scale holds an impossible scale, {scale} ({rule})")
    return problems, {"samples": len(r), "tokens": n, "loss_tokens": int(mask.sum())}


THREADS = 8
"""Shards checked at once: hashing, zarr's decompression and torch's passes release the GIL, so a
machine with the cores reads several shards at the speed of one (as sf-train's check_shards)."""


def verify_featureset(root: str | Path, recompute: int = 0, device: str | None = None,
                      silent: bool = True) -> list[str]:
    """Return one line per problem found (empty when the set is sound), the shards' in the
    manifest's order; a bar over the shards unless silent (each is read whole, THREADS at once,
    so a large set takes a while)."""
    root = Path(root)
    manifest = read_manifest(root)
    problems = record_disagreements(root, manifest)
    if records := shard_records_problem(root, manifest):  # each shard's record would be misread: restore first
        return [*problems, records]
    if not manifest.get("complete"):
        problems.append(f"{root}: the capture is not complete (rerun the same sf-capture command to finish)")
    elif problem := token_counts_problem(root, manifest):
        problems.append(problem)
    totals = {"samples": 0, "tokens": 0, "loss_tokens": 0}
    entries = manifest["shards"]
    pool = ThreadPoolExecutor(max_workers=max(1, min(THREADS, len(entries))))
    try:
        with Progress(len(entries), "shard", "sf-capture verify", silent) as progress:
            # the results in the manifest's order, THREADS shards read ahead
            for found, held in pool.map(lambda entry: check_shard(root, manifest, entry), entries):
                problems += found
                for k, v in held.items():
                    totals[k] += v
                progress.update(1, held.get("tokens", 0))
    finally:  # after an error or Ctrl-C the queued shards are not read
        pool.shutdown(wait=True, cancel_futures=True)
    for k, v in totals.items():
        if not problems and manifest["counts"][k] != v:
            problems.append(f"{root}: manifest counts {k}={manifest['counts'][k]}, shards hold {v}")
    if recompute and not problems:
        problems += recompute_samples(root, manifest, recompute, device)
    return problems


def recompute_samples(root: Path, manifest: dict, k: int, device: str | None) -> list[str]:
    """Run the target again on the first k samples and compare within storage rounding."""
    from specfoundry.capture.runner import HFCaptureRunner
    from specfoundry.common.embedded import EMBEDDED
    from specfoundry.common.target import Target

    fs = FeatureSet(root)
    name = manifest["target"]["name"]  # an embedded target by its name (its converted copy may live elsewhere)
    target = Target.load(name if name in EMBEDDED else manifest["target"]["path"], device=device,
                         command="sf-capture verify")
    teacher_k = stored_topk(manifest)
    runner = HFCaptureRunner(target, manifest["aux_layer_ids"], teacher_k=teacher_k)
    problems = []
    for i in range(min(k, len(fs))):
        s = fs[i]
        fresh = runner([s.input_ids.tolist()])[0]
        if teacher_k:  # rank by rank: the probabilities, and the ids where no near-tie could swap them
            got, want = s.teacher_probs.float(), fresh["teacher_probs"].float()  # [T, K] most probable first
            gap = (want[:, :-1] - want[:, 1:]).abs()  # [T, K-1] between neighbours
            apart = torch.ones_like(want, dtype=torch.bool)
            apart[:, :-1] &= gap > 1e-2
            apart[:, 1:] &= gap > 1e-2
            # float16 rounds a probability to 2^-11 of itself; a fresh prefill's own rounding adds a little
            if (got - want).abs().max() > 1e-2 or (s.teacher_ids.long() != fresh["teacher_ids"].long())[apart].any():
                problems.append(f"sample {i}: the stored top-{teacher_k} teacher differs from a fresh prefill's")
        for name, dtype in stored_states((("aux_hidden", manifest["storage_dtype"]),
                                          ("final_hidden", manifest["final_storage_dtype"])), bool(teacher_k)):
            layers = len(manifest["aux_layer_ids"]) if name == "aux_hidden" else 1
            errors = median_row_error(getattr(s, name), fresh[name], layers)  # [layers]
            # bf16 storage rounding is ~3e-3 relative; float8's at most 2^-4 per value, packed codes'
            # a share of their block's absmax (store.relative_error)
            if errors.max() > 1e-2 + relative_error(dtype):
                where = manifest["aux_layer_ids"][int(errors.argmax())] if name == "aux_hidden" else "final"
                problems.append(f"sample {i}: stored {name} differs from a fresh prefill (layer {where}: median "
                                f"relative error a token {errors.max():.2e})")
    return problems


__all__ = ["verify_featureset", "FeatureSetError"]
