"""Bytes per token on disk of a SmolLM2 feature set, for each codec.

Captures the same conversations once per codec (bf16 storage) and divides each set's size on
disk by its token count: all files, and the shards alone (the compression ratio uses these). The baseline is raw bf16: per token
3H + H hidden values of 2 bytes, plus an int64 id and a bool mask byte.

    python -m benchmarks.featureset_size runs/smollm2/regen
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table, write_result
from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.featureset.manifest import read_manifest


def size_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="Conversations or an sf-regen folder to capture.")
    ap.add_argument("--target", default="smollm2")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for codec in ("zarr", "safetensors"):
            out = Path(tmp) / codec
            start = time.perf_counter()
            run_capture(CaptureConfig(source=args.source, output=str(out), target=args.target, codec=codec,
                                      shard_size=64), silent=True)
            seconds = time.perf_counter() - start
            m = read_manifest(out)
            tokens, h = m["counts"]["tokens"], m["hidden_size"]
            raw = 4 * h * 2 + 8 + 1  # bf16 aux [3H] + final [H], int64 id, bool mask
            size, shards = size_on_disk(out), size_on_disk(out / "shards")
            rows.append({"codec": codec, "samples": m["counts"]["samples"], "tokens": tokens, "bytes": size,
                         "bytes_per_token": round(size / tokens, 1),
                         # the fixed files (token counts over the vocab, manifest) weigh on a small set
                         "shard_bytes_per_token": round(shards / tokens, 1), "raw_bf16_bytes_per_token": raw,
                         "compression_vs_raw_bf16": round(raw * tokens / shards, 3), "capture_s": round(seconds, 1)})
    print_table(rows, list(rows[0]))
    print(f"wrote {write_result('featureset_size', rows)}")


if __name__ == "__main__":
    main()
