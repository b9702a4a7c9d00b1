"""sf-train step throughput on one GPU at the Llama-3.1-8B draft shape, features from disk.

    python -m benchmarks.train_step [--seq 4096] [--steps 8] [--profile] [--storage bfloat16,float8_e4m3fn]

Shape: H 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336, target vocab 128256,
draft vocab 32000, T = 4096, TTT 7, batch 1. Random features are written to a safetensors
feature-set shard first and read back through the training loader (background workers).
Ours (FlexAttention BlockMask + in-place Triton loss + compiled elementwise chains), ours with
the elementwise chains eager, and the plain torch path (eager EAGLE-3 attention + reference
loss) run the same loop: teacher, 7-step TTT forward, backward, AdamW. Each further --storage
(float8: the loader hands float8 values + scales, copied to the GPU and dequantised there by
Batch.to) runs ours again from a set of that storage, beside the bf16 one. --profile also prints
where ours spends its GPU time (torch.profiler, CUDA kernels by total time).

FLOPs per token (written out so the MFU can be checked), with A = 2*H*H*... per layer:
    fc        2 * 3H * H                              (step 0 only)
    per step  2 * 2H * (nh + 2*nkv) * hd  (q, k, v)   + 2 * nh*hd * H  (o)
              + 2 * 3 * H * I (SwiGLU) + 2 * H * Vd (lm_head) + 4 * (T/2 + s) * nh * hd (attention)
    training  3 x forward (backward = 2 x forward), plus the teacher 2 * H * V (forward only)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import MATMUL_TFLOPS, print_table, write_result
from specfoundry.featureset.store import FeatureSet
from specfoundry.testing import LLAMA8B_DRAFT, llama8b_ttt_module, write_random_featureset
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


def run(impl: str, fs: FeatureSet, t: int, steps: int, ttt: int, profile: bool = False) -> dict:
    cfg = LLAMA8B_DRAFT
    attention, loss_kernel, compiled = IMPLS[impl]
    model = llama8b_ttt_module(compiled).cuda()
    opt = torch.optim.AdamW(model.draft.trainable_parameters(), lr=1e-4, fused=True)
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t, seed=0, num_workers=2, pin_memory=True))

    def step():
        batch = next(loader).to("cuda", torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(batch, ttt_length=ttt, attention=attention, loss_kernel=loss_kernel)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row = {"impl": impl, "features": fs.dtype if fs.dtype == fs.final_dtype else f"{fs.dtype}+{fs.final_dtype}",
           "T": t, "ttt": ttt}
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
                         "the first; ours reads each other one too.")
    args = ap.parse_args()
    storages = [tuple(x.split("+")) if "+" in x else (x, x) for x in args.storage.split(",")]
    ours = next(iter(IMPLS))
    with tempfile.TemporaryDirectory() as d:
        # every run reads steps + warm-up (+ profiled) samples
        sets = [write_random_featureset(Path(d) / str(k), args.steps + 6, args.seq, LLAMA8B_DRAFT, "safetensors",
                                        aux, final) for k, (aux, final) in enumerate(storages)]
        rows = [run(impl, sets[0], args.seq, args.steps, args.ttt, profile=args.profile and k == 0)
                for k, impl in enumerate(IMPLS)]
        rows += [run(ours, fs, args.seq, args.steps, args.ttt) for fs in sets[1:]]
    plain = rows[len(IMPLS) - 1].get("ms_per_step")
    for row in rows:
        if row["impl"] != list(IMPLS)[-1] and isinstance(plain, float) and isinstance(row.get("ms_per_step"), float):
            row["speedup_vs_plain"] = plain / row["ms_per_step"]
        if row["impl"] == ours and row is not rows[0] and isinstance(row.get("tokens_per_s"), float) \
                and isinstance(rows[0].get("tokens_per_s"), float):
            row["vs_first_storage_%"] = 100 * row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print_table(rows, ["impl", "features", "T", "ttt", "ms_per_step", "tokens_per_s", "TFLOPs", "MFU_%", "peak_GiB",
                       "speedup_vs_plain", "vs_first_storage_%"])
    print(write_result("train_step", rows, {"flops_per_token": flops_per_token(LLAMA8B_DRAFT, args.seq, args.ttt)}))


if __name__ == "__main__":
    main()
