"""`sf-capture verify`'s speed: shards one at a time (the baseline) against THREADS at once.

    python -m benchmarks.featureset_verify [--shards 8] [--samples 16] [--tokens 1024] [--repeats 3]

Writes a random feature set at SmolLM2-135M's width (576; EAGLE-3's and DFlash's five stored
layers, the final state; bf16, Zarr v3 as sf-capture writes by default) of --shards shards of
--samples samples of --tokens tokens, then times verify_featureset over it with
capture.verify.THREADS at 1 and at its default, each --repeats times alternating (the first pass
of all reads the files into the page cache and is not timed). Also times the non-finite check of
one chunk (8,192 tokens of the stored state): torch.isfinite on the bf16 values, on their float32
copy (what verify did before), and store.all_finite's exponent-bit pass. CPU wall time; the machine's
cores bound what the threads can gain.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from unittest import mock

import torch

import specfoundry.capture.verify as verify
from benchmarks.common import print_table, wall, write_result
from specfoundry.common.files import atomic_write_json
from specfoundry.featureset.manifest import MANIFEST, new_manifest
from specfoundry.featureset.store import all_finite, shard_name, write_shard

HIDDEN, LAYERS, VOCAB = 576, 5, 49152


def write_set(root: Path, shards: int, samples: int, tokens: int) -> int:
    """A complete random feature set in root; its token count."""
    g = torch.Generator().manual_seed(0)
    entries = []
    for s in range(shards):
        rows = [{"input_ids": torch.randint(0, VOCAB, (tokens,), generator=g),
                 "loss_mask": torch.ones(tokens, dtype=torch.bool),
                 "aux_hidden": torch.randn(tokens, LAYERS * HIDDEN, generator=g).to(torch.bfloat16),
                 "final_hidden": torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)} for _ in range(samples)]
        rel = shard_name(s, "zarr")
        entries.append({"path": rel, "sha256": write_shard(root, rel, rows, "zarr", "bfloat16"), "num_samples": samples,
                        "num_tokens": samples * tokens, "sample_lengths": [tokens] * samples})
    total = shards * samples * tokens
    atomic_write_json(root / MANIFEST, new_manifest(
        target={"hidden_size": HIDDEN, "vocab_size": VOCAB}, aux_layer_ids=list(range(LAYERS)), hidden_size=HIDDEN,
        storage_dtype="bfloat16", codec="zarr", shards=entries, complete=True,
        counts={"samples": shards * samples, "tokens": total, "loss_tokens": total}))
    return total


def timed(fn, repeats: int = 5) -> float:
    """The median wall seconds of fn() over repeats, after one untimed call."""
    fn()
    return sorted(wall(fn) for _ in range(repeats))[repeats // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8, help="Shards in the set (default: %(default)s).")
    ap.add_argument("--samples", type=int, default=16, help="Samples per shard (default: %(default)s).")
    ap.add_argument("--tokens", type=int, default=1024, help="Tokens per sample (default: %(default)s).")
    ap.add_argument("--repeats", type=int, default=3, help="Timed passes of each way (default: %(default)s).")
    ap.add_argument("--out", default="featureset_verify",
                    help="The result's name under benchmarks/results/ (or a path; default: %(default)s).")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "fs"
        tokens = write_set(root, args.shards, args.samples, args.tokens)
        ways = {"one shard at a time": 1, f"{verify.THREADS} shards at once": verify.THREADS}
        seconds = {name: [] for name in ways}

        def verify_sound():
            problems = verify.verify_featureset(root)
            assert problems == [], problems

        verify_sound()  # the untimed pass: the page cache
        for _ in range(args.repeats):
            for name, threads in ways.items():
                with mock.patch.object(verify, "THREADS", threads):
                    seconds[name].append(wall(verify_sound))
        for name, times in seconds.items():
            best = min(times)
            rows.append({"what": f"verify, {name}", "seconds": best, "tokens_per_s": tokens / best})
    chunk = torch.randn(verify.CHUNK, LAYERS * HIDDEN).to(torch.bfloat16)  # [8192, L*H] as stored
    for name, fn in (("isfinite on bf16", lambda: bool(torch.isfinite(chunk).all())),
                     ("isfinite on a float32 copy", lambda: bool(torch.isfinite(chunk.float()).all())),
                     ("all_finite (exponent bits)", lambda: all_finite(chunk))):
        s = timed(fn)
        rows.append({"what": f"one chunk's check, {name}", "seconds": s, "tokens_per_s": verify.CHUNK / s})
    print_table(rows, ["what", "seconds", "tokens_per_s"])
    print(write_result(args.out, rows, {"settings": {**vars(args), "threads": verify.THREADS, "set_tokens": tokens,
                                                     "cpus": os.cpu_count()}}))


if __name__ == "__main__":
    main()
