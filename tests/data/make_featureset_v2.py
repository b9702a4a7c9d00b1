"""Writes tests/data/featureset-v2/{safetensors,zarr}: small feature sets in format version 2 (the
layout before float8 storage and final_storage_dtype), written by the writer of that version,
so that tests/test_fp8.py reads files the older code really wrote. Run it against that code:

    git archive 12d4935 specfoundry | tar -x -C /tmp/sf-v2
    PYTHONPATH=/tmp/sf-v2 python tests/data/make_featureset_v2.py

The values are a fixed formula (no RNG), which the test computes again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LENGTHS = [5, 1, 9]  # mixed lengths, one of a single token
HIDDEN = 8
LAYERS = [1, 3, 5]
VOCAB = 32


def sample(i: int) -> dict:
    """Sample i's tensors: input_ids [T], loss_mask [T] bool, aux_hidden [T, 3H], final_hidden [T, H] (bf16)."""
    t = LENGTHS[i]
    grid = torch.arange(t * 4 * HIDDEN, dtype=torch.float32).view(t, 4 * HIDDEN) + 1000 * i
    hidden = (torch.sin(grid * 0.37) * torch.exp(torch.cos(grid * 0.11) * 3)).to(torch.bfloat16)
    return {"input_ids": (torch.arange(t) * 7 + i) % VOCAB, "loss_mask": torch.arange(t) % 3 != 0,
            "aux_hidden": hidden[:, : 3 * HIDDEN], "final_hidden": hidden[:, 3 * HIDDEN :]}


def main() -> None:
    from specfoundry.featureset.manifest import FORMAT_VERSION
    from specfoundry.featureset.store import shard_name, write_shard

    assert FORMAT_VERSION == 2, "run this against the version-2 code (see the docstring)"
    from safetensors.torch import save_file

    samples = [sample(i) for i in range(len(LENGTHS))]
    for codec in ("safetensors", "zarr"):
        root = Path(__file__).parent / "featureset-v2" / codec
        rel = shard_name(0, codec)
        digest = write_shard(root, rel, samples, codec, "bfloat16")
        counts = torch.zeros(VOCAB, dtype=torch.int64)
        for s in samples:
            counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=VOCAB)
        save_file({"counts": counts}, str(root / "token_counts.safetensors"))
        manifest = {
            "format": "specfoundry.featureset", "format_version": 2, "tool_version": "0.1.0",
            "target": {"name": "tiny", "path": "tiny", "config_sha256": "0" * 64, "hidden_size": HIDDEN,
                       "num_layers": 8, "vocab_size": VOCAB, "weight_fingerprint": "0" * 64},
            "tokenizer_sha256": "0" * 64, "chat_template_sha256": "0" * 64, "chat_template_source": "target",
            "aux_layer_ids": LAYERS, "hidden_size": HIDDEN, "storage_dtype": "bfloat16", "codec": codec,
            "max_length": 16,
            "counts": {"skipped_untrainable": 0, "bad_inputs": 0, "samples": len(samples), "tokens": sum(LENGTHS),
                       "loss_tokens": int(sum(s["loss_mask"].sum() for s in samples))},
            "bad_inputs": [], "capture_config": {},
            "shards": [{"index": 0, "path": rel, "sha256": digest, "num_samples": len(samples),
                        "num_tokens": sum(LENGTHS), "loss_tokens": int(sum(s["loss_mask"].sum() for s in samples)),
                        "sample_ids": [f"s{i}" for i in range(len(samples))], "sample_lengths": LENGTHS}],
            "complete": True,
        }
        (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
