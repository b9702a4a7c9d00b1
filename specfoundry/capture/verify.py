"""`sf-capture verify`: check a feature set against its manifest, and optionally recompute."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specfoundry.common.files import checksum
from specfoundry.featureset.manifest import FeatureSetError, read_manifest
from specfoundry.featureset.store import FeatureSet, ShardReader


def verify_featureset(root: str | Path, recompute: int = 0, device: str | None = None) -> list[str]:
    """Return one line per problem found (empty when the set is sound)."""
    root = Path(root)
    manifest = read_manifest(root)
    problems = []
    if not manifest.get("complete"):
        problems.append(f"{root}: the capture is not complete (rerun the same sf-capture command to finish)")
    h = manifest["hidden_size"]
    totals = {"samples": 0, "tokens": 0, "loss_tokens": 0}
    for entry in manifest["shards"]:
        path = root / entry["path"]
        if not path.exists():
            problems.append(f"{entry['path']}: listed in the manifest but missing")
            continue
        if checksum(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: checksum mismatch (the shard was changed or damaged)")
            continue
        try:
            r = ShardReader(path, manifest["codec"], manifest["storage_dtype"])
            n = int(r.offsets[-1])
            shapes = {name: r.rows(name, 0, n).shape for name in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}
            mask = r.rows("loss_mask", 0, n)
        except Exception as e:  # noqa: BLE001 - any read failure is a damaged shard
            problems.append(f"{entry['path']}: unreadable ({type(e).__name__}: {e})")
            continue
        k = len(manifest["aux_layer_ids"])
        expect = {"input_ids": (n,), "loss_mask": (n,), "aux_hidden": (n, k * h), "final_hidden": (n, h)}
        for name, shape in expect.items():
            if tuple(shapes[name]) != shape:
                problems.append(f"{entry['path']}: {name} has shape {tuple(shapes[name])}, expected {shape}")
        if len(r) != entry["num_samples"] or n != entry["num_tokens"]:
            problems.append(f"{entry['path']}: holds {len(r)} samples / {n} tokens, manifest says "
                            f"{entry['num_samples']} / {entry['num_tokens']}")
        for name in ("aux_hidden", "final_hidden"):
            for start in range(0, n, 8192):
                x = r.rows(name, start, min(n, start + 8192))
                t = torch.from_numpy(np.ascontiguousarray(x))
                t = t.view(torch.bfloat16) if manifest["storage_dtype"] == "bfloat16" else t
                if not torch.isfinite(t.float()).all():
                    problems.append(f"{entry['path']}: {name} holds NaN or Inf near token {start}")
                    break
        totals["samples"] += len(r)
        totals["tokens"] += n
        totals["loss_tokens"] += int(mask.sum())
    for k, v in totals.items():
        if not problems and manifest["counts"][k] != v:
            problems.append(f"{root}: manifest counts {k}={manifest['counts'][k]}, shards hold {v}")
    if recompute and not problems:
        problems += recompute_samples(root, manifest, recompute, device)
    return problems


def recompute_samples(root: Path, manifest: dict, k: int, device: str | None) -> list[str]:
    """Run the target again on the first k samples and compare within storage rounding."""
    from specfoundry.capture.runner import HFCaptureRunner
    from specfoundry.common.target import load_target

    fs = FeatureSet(root)
    model, _, _ = load_target(manifest["target"]["name"] if manifest["target"]["name"] == "smollm2"
                              else manifest["target"]["path"], device=device)
    runner = HFCaptureRunner(model, manifest["aux_layer_ids"])
    problems = []
    for i in range(min(k, len(fs))):
        s = fs[i]
        aux, final = runner([s.input_ids.tolist()])[0]
        for name, got, want in (("aux_hidden", s.aux_hidden, aux), ("final_hidden", s.final_hidden, final)):
            err = (got.float() - want.float()).norm() / want.float().norm()
            if err > 1e-2:  # bf16 storage rounding is ~3e-3 relative
                problems.append(f"sample {i}: stored {name} differs from a fresh prefill (rel err {err:.2e})")
    return problems


__all__ = ["verify_featureset", "FeatureSetError"]
