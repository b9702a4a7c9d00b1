"""sf-train step throughput on one GPU at the Llama-3.1-8B draft shape, features from disk.

    python -m benchmarks.train_step [--seq 4096] [--steps 8] [--profile] [--storage bfloat16,float8_e4m3fn]
                                    [--impls ours,eager,plain] [--token-losses ce,lk-lambda]

Shape: H 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336, target vocab 128256,
draft vocab 32000, T = 4096, TTT 7, batch 1. Random features are written to a safetensors
feature-set shard first and read back through the training loader (background workers).
Ours (FlexAttention BlockMask + in-place Triton loss + compiled elementwise chains), ours with
the elementwise chains eager, and the plain torch path (eager EAGLE-3 attention + reference
loss) run the same loop: teacher, 7-step TTT forward, backward, AdamW. --profile also prints
where ours spends its GPU time (torch.profiler, CUDA kernels by total time).

With more than one --storage (float8: the loader hands float8 values + scales, copied to the GPU
and dequantised there by Batch.to), ours also runs once per storage *interleaved*: one model,
optimizer and loader per storage, all warmed up first, then rounds of `--block` steps of each in
turn, every block timed by CUDA events. Timed one after the other, the storages differed by what
came before them (the first run's compile gives its loader seconds to fill its prefetch queue, a
later run starts with an empty one) and by the card's clock drift; interleaved, both fall on every
storage alike. Beside it, for each storage: the data path alone (Batch.to: the host-to-device copy,
and float8's dequantisation, on batches already in pinned memory) and the loader alone (batches/s
of the same 2-worker pinned loader, no GPU work; the shards are in the page cache).

FLOPs per token (written out so the MFU can be checked), with A = 2*H*H*... per layer:
    fc        2 * 3H * H                              (step 0 only)
    per step  2 * 2H * (nh + 2*nkv) * hd  (q, k, v)   + 2 * nh*hd * H  (o)
              + 2 * 3 * H * I (SwiGLU) + 2 * H * Vd (lm_head) + 4 * (T/2 + s) * nh * hd (attention)
    training  3 x forward (backward = 2 x forward), plus the teacher 2 * H * V (forward only)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import MATMUL_TFLOPS, call_ms, print_table, write_result
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.shapes import LLAMA8B_DRAFT, llama8b_ttt_module, random_ttt_module
from specfoundry.featureset.store import FeatureSet
from specfoundry.kernels.lk_loss import TokenLoss
from specfoundry.testing import write_random_featureset
from specfoundry.train.loader import FeatureLoader


def flops_per_token(cfg, t: int, steps: int) -> float:
    h, i, nh, nkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fwd = 2 * 3 * h * h
    for s in range(steps):
        fwd += 2 * 2 * h * (nh + 2 * nkv) * hd + 2 * nh * hd * h + 2 * 3 * h * i + 2 * h * cfg.draft_vocab_size
        fwd += 4 * (t / 2 + s) * nh * hd
    return 3 * fwd + 2 * h * cfg.vocab_size


def time_steps(step, steps: int, warmup: int = 2) -> float:
    """ms per step(), by CUDA events over `steps` calls after `warmup` untimed ones (compile,
    mask build, allocator, communicators); the peak-memory counter is reset after the warm-up."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


IMPLS = {  # name: (attention, loss, compiled elementwise chains)
    "ours (flex + triton + compiled elementwise)": ("flex", "triton", True),
    "ours, eager elementwise": ("flex", "triton", False),
    "plain (eager + reference)": ("eager", "reference", False),
}


PROFILED_STEPS = 2


def profile_table(step, steps: int = PROFILED_STEPS) -> str:
    """CUDA kernels by total GPU time over `steps` steps (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)


TINY_DRAFT = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=1024, draft_vocab_size=256, target_hidden_size=64,
                          aux_layer_ids=(1, 3, 4))
"""--tiny: a draft small enough to check the script on a CPU (plain torch paths there)."""


def storage_label(fs: FeatureSet) -> str:
    return fs.dtype if fs.dtype == fs.final_dtype else f"{fs.dtype}+{fs.final_dtype}"


def make_step(impl: str, fs: FeatureSet, t: int, ttt: int, cfg=LLAMA8B_DRAFT, device: str = "cuda",
              token_loss: str = "ce"):
    """One training step of `impl` over its own loader of fs: next batch, to the device (float8
    dequantised there), teacher + TTT forward, backward, AdamW. On a CPU every impl runs the plain
    torch paths (no Triton, no FlexAttention)."""
    attention, loss_kernel, compiled = IMPLS[impl] if device == "cuda" else ("sdpa", "reference", False)
    if cfg is LLAMA8B_DRAFT:
        model = llama8b_ttt_module(compiled)
    else:
        model = random_ttt_module(cfg, vocab_stride=4, head_scale=0.02, compile_elementwise=compiled)
    model = model.to(device)
    opt = torch.optim.AdamW(model.draft.trainable_parameters(), lr=1e-4, fused=device == "cuda")
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t, seed=0, num_workers=2,
                                pin_memory=device == "cuda"))

    def step():
        batch = next(loader).to(device, torch.bfloat16)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss, _ = model(batch, ttt_length=ttt, attention=attention, loss_kernel=loss_kernel,
                            token_loss=TokenLoss(token_loss))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class Clock:
    """Elapsed ms of a span of work: CUDA events on a GPU (no sync inside the span), the host clock
    after a sync elsewhere."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def time(self, fn) -> float:
        return call_ms(fn, self.cuda)


def run_interleaved(fss: list[FeatureSet], t: int, steps: int, ttt: int, block: int, cfg=LLAMA8B_DRAFT,
                    device: str = "cuda") -> list[dict]:
    """Ours once per feature set, interleaved (see the module docstring): 2 warm-up steps each,
    then rounds of `block` steps of each set in turn until every set has run `steps` timed steps;
    ms_per_step is the median over the rounds' blocks, with their min and max beside it."""
    impl = next(iter(IMPLS))
    step_of = [make_step(impl, fs, t, ttt, cfg, device) for fs in fss]
    for step in step_of:
        for _ in range(2):
            step()
    if device == "cuda":
        torch.cuda.synchronize()
    clock = Clock(device)
    blocks: list[list[float]] = [[] for _ in fss]
    for _ in range(max(1, steps // block)):
        for k, step in enumerate(step_of):
            blocks[k].append(clock.time(lambda step=step: [step() for _ in range(block)]) / block)
    rows = []
    for fs, ms in zip(fss, blocks, strict=True):
        med = statistics.median(ms)
        rows.append({"impl": f"{impl}, interleaved", "features": storage_label(fs), "T": t, "ttt": ttt,
                     "ms_per_step": med, "ms_min": min(ms), "ms_max": max(ms), "rounds": len(ms), "block": block,
                     "tokens_per_s": t / (med * 1e-3),
                     "TFLOPs": flops_per_token(cfg, t, ttt) * t / (med * 1e-3) / 1e12})
        rows[-1]["MFU_%"] = 100 * rows[-1]["TFLOPs"] / MATMUL_TFLOPS
    for row in rows[1:]:
        row["vs_first_storage_%"] = 100 * row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def data_path(fs: FeatureSet, t: int, device: str = "cuda", batches: int = 6) -> dict:
    """The loader alone (ms per batch of a fresh 2-worker loader after its first batch, no device
    work) and Batch.to alone (median ms over batches already in host memory, pinned on a GPU)."""
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t, seed=0, num_workers=2,
                                pin_memory=device == "cuda"))
    held = [next(loader)]
    start = time.perf_counter()
    held += [next(loader) for _ in range(batches)]
    loader_ms = 1e3 * (time.perf_counter() - start) / batches
    clock = Clock(device)
    to_ms = statistics.median(clock.time(lambda b=b: b.to(device, torch.bfloat16)) for b in held)
    b = held[0]
    host_bytes = sum(x.numel() * x.element_size() for x in (b.input_ids, b.loss_mask, b.aux_hidden, b.final_hidden,
                                                            b.aux_scale, b.final_scale) if x is not None)
    return {"features": storage_label(fs), "loader_ms_per_batch": loader_ms, "to_device_ms": to_ms,
            "host_to_device_MB": host_bytes / 1e6}


def run(impl: str, fs: FeatureSet, t: int, steps: int, ttt: int, profile: bool = False, token_loss: str = "ce") -> dict:
    cfg = LLAMA8B_DRAFT
    step = make_step(impl, fs, t, ttt, token_loss=token_loss)
    row = {"impl": impl, "features": storage_label(fs), "T": t, "ttt": ttt, "token_loss": token_loss}
    try:
        ms = time_steps(step, steps)
        if profile:
            print(f"== where {impl} spends its GPU time ({PROFILED_STEPS} steps) ==\n{profile_table(step)}", flush=True)
        row.update(ms_per_step=ms, tokens_per_s=t / (ms * 1e-3), peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
        row["TFLOPs"] = flops_per_token(cfg, t, ttt) * t / (ms * 1e-3) / 1e12
        row["MFU_%"] = 100 * row["TFLOPs"] / MATMUL_TFLOPS
    except torch.cuda.OutOfMemoryError:
        row["ms_per_step"] = "OOM"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096, help="Tokens per sample.")
    ap.add_argument("--steps", type=int, default=8, help="Timed steps after 2 warm-up steps.")
    ap.add_argument("--ttt", type=int, default=7, help="TTT length.")
    ap.add_argument("--profile", action="store_true", help="Also print the top CUDA kernels of ours.")
    ap.add_argument("--storage", default="bfloat16,float8_e4m3fn",
                    help="Feature storage to compare, comma-separated (a dtype, or AUX+FINAL): every impl reads "
                         "the first; with more than one, ours reads each, interleaved.")
    ap.add_argument("--impls", default="ours,eager,plain",
                    help="Which of ours, eager, plain run one after the other on the first storage ('' for none).")
    ap.add_argument("--block", type=int, default=2, help="Interleaved storages: steps per timed block.")
    ap.add_argument("--tiny", action="store_true", help="A tiny draft on the CPU, to check the script (no JSON).")
    ap.add_argument("--token-losses", default="ce",
                    help="Token losses to run ours with (sf-train --token-loss), each its own row; with more than "
                         "one, summary.token_loss_vs_ce holds each one's step time and peak memory over ce's.")
    args = ap.parse_args()
    storages = [tuple(x.split("+")) if "+" in x else (x, x) for x in args.storage.split(",")]
    impls = [name for short, name in zip(("ours", "eager", "plain"), IMPLS, strict=True)
             if short in args.impls.split(",")]
    cfg, device = (TINY_DRAFT, "cpu") if args.tiny else (LLAMA8B_DRAFT, "cuda")
    with tempfile.TemporaryDirectory() as d:
        # every run reads steps + warm-up (+ profiled) samples
        sets = [write_random_featureset(Path(d) / str(k), args.steps + 6, args.seq, cfg, "safetensors",
                                        aux, final) for k, (aux, final) in enumerate(storages)]
        rows = [run(impl, sets[0], args.seq, args.steps, args.ttt, profile=args.profile and k == 0)
                for k, impl in enumerate(impls) if not args.tiny]
        losses = [x for x in args.token_losses.split(",") if x != "ce"]
        by_loss = [run(impls[0], sets[0], args.seq, args.steps, args.ttt, token_loss=x)
                   for x in losses if not args.tiny]
        if args.tiny:  # the CPU check: one step of each token loss through the plain paths
            for x in losses:
                make_step(impls[0], sets[0], args.seq, args.ttt, cfg, device, token_loss=x)()
        rows += by_loss
        paths = []
        if len(sets) > 1:
            rows += run_interleaved(sets, args.seq, args.steps, args.ttt, args.block, cfg, device)
            paths = [data_path(fs, args.seq, device) for fs in sets]
    plain = next((r.get("ms_per_step") for r in rows if r["impl"] == list(IMPLS)[-1]), None)
    for row in rows:
        if row["impl"] in list(IMPLS)[:-1] and isinstance(plain, float) and isinstance(row.get("ms_per_step"), float):
            row["speedup_vs_plain"] = plain / row["ms_per_step"]
    print_table(rows, ["impl", "features", "token_loss", "T", "ttt", "ms_per_step", "ms_min", "ms_max", "tokens_per_s", "TFLOPs",
                       "MFU_%", "peak_GiB", "speedup_vs_plain", "vs_first_storage_%"])
    if paths:
        print_table(paths, ["features", "loader_ms_per_batch", "to_device_ms", "host_to_device_MB"])
    extra = {"flops_per_token": flops_per_token(cfg, args.seq, args.ttt), "data_path": paths}
    interleaved = [r for r in rows if r["impl"].endswith("interleaved")]
    if interleaved:
        extra["summary"] = {"storage_tokens_per_s": {r["features"]: r["tokens_per_s"] for r in interleaved},
                            "storage_vs_first_%": {r["features"]: r.get("vs_first_storage_%", 100.0)
                                                   for r in interleaved}}
    ce = next((r for r in rows if r["impl"] == impls[0] and r.get("token_loss") == "ce"), None)
    if by_loss and ce and isinstance(ce.get("ms_per_step"), float):
        extra.setdefault("summary", {})["token_loss_vs_ce"] = {
            r["token_loss"]: {"step_time_%": 100 * r["ms_per_step"] / ce["ms_per_step"],
                              "peak_memory_%": 100 * r["peak_GiB"] / ce["peak_GiB"]}
            for r in by_loss if isinstance(r.get("ms_per_step"), float)}
        print(extra["summary"]["token_loss_vs_ce"])
    if not args.tiny:
        print(write_result("train_step", rows, extra))


if __name__ == "__main__":
    main()
