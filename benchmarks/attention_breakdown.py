"""Where the TTT attention block's time goes (kernels.py's "ours" row), and candidate cuts side
by side in one process. At each T, all 7 TTT steps forward + backward, bf16, 8B draft shape:

- GPU time by kernel kind (torch.profiler): matmuls (cuBLAS), the FlexAttention kernels, the
  rest (RoPE, cats, adds), and the GPU's idle time inside the block's CUDA-event time: idle is
  the CPU not launching fast enough (launch-bound), not the kernels.
- variants timed in turn within each iteration (cuda_time_ms_interleaved), so the card's clock
  drift falls on all alike:
  * ours: the model's Eagle3Attention as sf-train runs it (q/k/v as one projection whose
    weight a TTTCache concatenates once per pass);
  * separate q/k/v: three projections, and in backward three dX GEMMs and two adds;
  * tuned flex: ours with the flex launch options max-autotune picked at T=4096
    (flex_tuning.py: fwd 64x64 w4 s3, bwd 32/64/64/32 w4 s3).

    python -m benchmarks.attention_breakdown [--seq 4096 ...] [--no-profile]

Output: results/attention_breakdown.json (figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.common import (
    cuda_time_ms_interleaved,
    peak_memory_gib,
    print_table,
    wall,
    write_result,
)
from benchmarks.flex_args import FlexArgsAttention
from benchmarks.flex_tuning import CHOICES
from benchmarks.kernels import STEPS, attention_block_run
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.eagle3.shapes import LLAMA8B_DRAFT

TUNED_FLEX = CHOICES["fwd 64x64, bwd 32/64"]


def kind(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "matmul"
    if "tem_fused" in low or "flex" in low:
        return "flex"
    return "other"


def gpu_breakdown(fn, block_ms: float) -> dict:
    """GPU kernel time of one fn() call by kind, and the idle rest of block_ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind = {"matmul": 0.0, "flex": 0.0, "other": 0.0}
    kernels = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind(e.key)] += us / 1e3
            kernels.append((us / 1e3, e.count, e.key))
    busy = sum(by_kind.values())
    for ms, count, name in sorted(kernels, reverse=True)[:12]:
        print(f"  {ms:7.2f} ms  x{count:<4} {kind(name):6} {name[:100]}", flush=True)
    return {**{f"{k}_ms": v for k, v in by_kind.items()}, "kernels_ms": busy, "idle_ms": block_ms - busy}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096], help="TTT lengths T (tokens per step).")
    ap.add_argument("--no-profile", action="store_true", help="Skip the profiler's breakdown.")
    ap.add_argument("--no-tuned-flex", action="store_true", help="Leave out the tuned-flex variant (a compile).")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Eagle3Draft(LLAMA8B_DRAFT)
    attn = model.midlayer.self_attn.cuda().to(torch.bfloat16)
    attn.compiled_elementwise = True  # RoPE compiled, as sf-train runs it
    separate = FlexArgsAttention(attn, separate_qkv=True)
    tuned = FlexArgsAttention(attn, kernel_options=TUNED_FLEX)
    rotary = model.rope.cuda()
    rows = []
    for t in args.seq:
        xs = [torch.randn(1, t, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(STEPS)]
        grads = [torch.randn(1, t, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(STEPS)]
        variants = {
            "ours": functools.partial(attention_block_run, attn, rotary, xs, grads, "flex"),
            "separate q/k/v": functools.partial(attention_block_run, separate, rotary, xs, grads, "flex"),
            "tuned flex": functools.partial(attention_block_run, tuned, rotary, xs, grads, "flex"),
        }
        if args.no_tuned_flex:
            del variants["tuned flex"]
        first = {name: wall(fn) for name, fn in variants.items()}  # compiles, reported apart
        ms = cuda_time_ms_interleaved(variants, 3, 15)
        for name in variants:
            row = {"T": t, "variant": name, "ms": ms[name], "vs_ours": ms[name] / ms["ours"],
                   "first_call_s": first[name], "peak_GiB": peak_memory_gib(variants[name])}
            if not args.no_profile and name == "ours":
                print(f"== T={t} ours: GPU kernels of one block call", flush=True)
                row.update(gpu_breakdown(variants[name], ms[name]))
            rows.append(row)
        for x in xs:
            x.grad = None
        del xs, grads
        torch.cuda.empty_cache()
    print_table(rows, ["T", "variant", "ms", "vs_ours", "peak_GiB", "first_call_s", "matmul_ms", "flex_ms", "other_ms",
                       "kernels_ms", "idle_ms"])
    print(write_result("attention_breakdown", rows))


if __name__ == "__main__":
    main()
