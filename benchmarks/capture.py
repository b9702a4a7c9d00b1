"""sf-capture throughput on one GPU: an 8B-shaped Llama (random weights: throughput does not
depend on them) at sequence length 4096, three ways over the same batches in one process:

    bare     base-model prefill, nothing captured or written
    ours     the capture runner (hooks on 3 layers + final hidden, device-to-host copy on a side
             stream overlapping the next batch) + background shard writer, to disk and to RAM,
             for each --storage (bf16; float8 quantised on the GPU before the copy; float8 aux
             states + bf16 final), side by side; "synced" also waits for the written bytes to
             reach the disk (os.sync inside the timed span), the disk-bound case measured honestly
    naive    model(..., output_hidden_states=True): every layer's states and full logits

    python -m benchmarks.capture [--batches 40] [--batch-size 2] [--storage bfloat16,float8_e4m3fn]

Each variant's time includes draining the writer after the last batch, a once-per-run cost;
40 batches (330k tokens) keep it near the small share it has in a real capture.

MFU = 2 * params * tokens / time over the 790 TFLOP/s bf16 matmul rate (attention FLOPs are
not counted, so this understates the work at 4096 tokens).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import MATMUL_TFLOPS, print_table, write_result
from specfoundry.capture.runner import HFCaptureRunner
from specfoundry.capture.stage import CaptureConfig, write_one
from specfoundry.capture.writer import BackgroundWriter
from specfoundry.common.shards import ShardedOutput
from specfoundry.common.target import Target
from specfoundry.families.eagle3.options import default_aux_layers


def llama8b(layers: int = 32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    model.model.rotary_emb.__init__(cfg, device="cuda")  # buffers lost on meta
    return model.eval().requires_grad_(False)


def disk_write_speed() -> float:
    """The working disk's sequential write speed in MB/s (1 GiB, fsync'd)."""
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe.bin"
        block = torch.empty(1 << 30, dtype=torch.uint8).numpy()
        t = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return (1 << 30) / 1e6 / (time.perf_counter() - t)


def measure_written(measure, runner, batches, d: Path, storage, writers: int, synced: bool, name: str) -> dict:
    """sf-capture's own writer: one shard per batch, written by background threads (and, when
    synced, flushed to the disk before the clock stops)."""
    cfg = CaptureConfig(source="-", output=str(d), codec="safetensors", storage_dtype=storage[0],
                        final_storage_dtype=storage[1], writers=writers)
    shard_ids = itertools.count()  # the warm-up batch's shard stays: every shard is counted below

    def write_all(bs):
        writer = BackgroundWriter(lambda k, part, outputs: write_one(ShardedOutput(d), k, part, outputs, cfg),
                                  cfg.writers)
        for b, feats in zip(bs, runner.capture_all(bs), strict=True):
            part = [{"id": str(j), "input_ids": ids, "loss_mask": [1] * len(ids)} for j, ids in enumerate(b)]
            writer.put(next(shard_ids), part, feats)
        writer.close()
        if synced:
            os.sync()

    return measure(name, write_all)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=40, help="Timed batches per variant (after one warm-up).")
    ap.add_argument("--batch-size", type=int, default=2, help="Sequences per batch.")
    ap.add_argument("--seq", type=int, default=4096, help="Tokens per sequence.")
    ap.add_argument("--storage", default="bfloat16,float8_e4m3fn,float8_e4m3fn+bfloat16",
                    help="Comma-separated storage to compare: a dtype, or AUX+FINAL dtypes.")
    args = ap.parse_args()
    storages = [tuple(x.split("+")) if "+" in x else (x, x) for x in args.storage.split(",")]
    model = llama8b()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, 128256, (args.seq,), generator=g).tolist() for _ in range(args.batch_size)]
               for _ in range(args.batches + 1)]
    tokens = args.batches * args.batch_size * args.seq
    rows = []

    def measure(name, run_all, extra=None):
        """run_all(list of batches) runs them all; one warm-up batch first, untimed."""
        run_all(batches[:1])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        run_all(batches[1:])
        torch.cuda.synchronize()
        if extra:
            extra()
        dt = time.perf_counter() - t  # includes draining the writer
        row = {"variant": name, "tokens_per_s": tokens / dt, "MFU_%": 100 * 2 * params * tokens / dt / 1e12 / MATMUL_TFLOPS,
               "peak_GiB_above_weights": (torch.cuda.max_memory_allocated() - base) / 2**30}
        rows.append(row)
        return row

    def each(fn):
        def run_all(bs):
            for b in bs:
                fn(b)  # the output is dropped at once (40 naive outputs would fill the GPU)
        return run_all

    def ids_of(batch):
        return torch.tensor(batch, device="cuda")

    with torch.inference_mode():
        measure("bare prefill", each(lambda b: model.model(input_ids=ids_of(b), use_cache=False)))
        measure("naive output_hidden_states + logits",
                each(lambda b: model(input_ids=ids_of(b), output_hidden_states=True, use_cache=False)))
    disk_mb_s = disk_write_speed()
    need = 2 * tokens * 4 * model.config.hidden_size * 2  # bf16 features of every batch, with margin
    targets = [("disk", None)]
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        targets.append(("RAM (/dev/shm)", "/dev/shm"))
    else:
        print("/dev/shm is missing or too small: the RAM variant is left out")
    for storage in storages:
        label = storage[0] if storage[0] == storage[1] else "+".join(storage)
        runner = HFCaptureRunner(Target.wrap(model), default_aux_layers(32), storage=storage)
        # where the time goes: hooks, encoding and copies alone, nothing written; then written to the
        # disk and to RAM (/dev/shm), which tells our pipeline's limit apart from the disk's
        row = measure(f"capture runner only (hooks + async copy to host), not written, {label}",
                      lambda bs, runner=runner: [None for _ in runner.capture_all(bs)])  # each dropped, as once written
        row["storage"] = label
        for where, folder in targets:
            for writers, synced in ((1, False), (4, False), (4, True)):
                if synced and folder is not None:
                    continue  # RAM needs no sync
                with tempfile.TemporaryDirectory(dir=folder) as d:
                    row = measure_written(measure, runner, batches, Path(d), storage, writers, synced,
                                          f"ours: capture, written to {where} by {writers} writer thread(s)"
                                          f"{', synced' if synced else ''}, {label}")
                    row["storage"] = label
                    written = sum(f.stat().st_size for f in Path(d).glob("shards/*.safetensors"))
                    row["disk_MB_per_s"] = written * args.batches / (args.batches + 1) / 1e6 / (tokens / row["tokens_per_s"])
        runner.tap.remove()
    bare = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_bare_%"] = 100 * r["tokens_per_s"] / bare
    print_table(rows, ["variant", "tokens_per_s", "vs_bare_%", "MFU_%", "peak_GiB_above_weights", "disk_MB_per_s"])
    for r in rows:  # float8 against bf16 in the same run, variant for variant
        twin = next((b for b in rows if b.get("storage") == "bfloat16"
                     and b["variant"].rsplit(", ", 1)[0] == r["variant"].rsplit(", ", 1)[0]), None)
        if r.get("storage") not in (None, "bfloat16") and twin:
            r["vs_bf16_%"] = 100 * r["tokens_per_s"] / twin["tokens_per_s"]
            print(f"{r['variant']}: {r['vs_bf16_%']:.1f}% of bf16's tokens/s")
    print(f"disk sequential write: {disk_mb_s:,.0f} MB/s")
    print(write_result("capture", rows, {"params": params, "seq": args.seq, "batch_size": args.batch_size,
                                         "timed_batches": args.batches, "storage": args.storage,
                                         "disk_write_MB_per_s": disk_mb_s}))


if __name__ == "__main__":
    main()
