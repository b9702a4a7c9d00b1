"""Where the TTT attention block's time goes (kernels.py's "ours" row), and candidate cuts side
by side in one process. At each T, all 7 TTT steps forward + backward, bf16, 8B draft shape:

- GPU time by kernel kind (torch.profiler): matmuls (cuBLAS), the FlexAttention kernels, the
  rest (RoPE, cats, adds), and the GPU's idle time inside the block's CUDA-event time: idle is
  the CPU not launching fast enough (launch-bound), not the kernels.
- variants timed in turn within each iteration (cuda_time_ms_interleaved), so the card's clock
  drift falls on all alike:
  * ours: the model's Eagle3Attention as sf-train runs it (q/k/v as one projection whose
    weight a TTTCache concatenates once per pass);
  * separate q/k/v: three projections, and in backward three dX GEMMs and two adds (the model
    before TTTCache);
  * tuned flex: ours with the flex launch options max-autotune picked at T=4096
    (flex_tuning.py: fwd 64x64 w4 s3, bwd 32/64/64/32 w4 s3).

    python benchmarks/attention_breakdown.py [--seq 4096 ...] [--no-profile]

results/attention_breakdown.json is the run that led to TTTCache: there "ours" was the separate
projections and "fused qkv" a weight concatenated once beforehand (0.93-0.98x of ours).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

# the repo root replaces this script's folder on the path (see kernels.py)
sys.path[0] = str(Path(__file__).resolve().parents[1])
import specfoundry.kernels.tree_attention as ta  # noqa: E402
from benchmarks.common import cuda_time_ms_interleaved, peak_memory_gib, print_table, wall, write_result  # noqa: E402
from benchmarks.flex_tuning import CHOICES  # noqa: E402
from benchmarks.kernels import LLAMA8B_DRAFT, STEPS, attention_block_run  # noqa: E402
from specfoundry.train.model import Eagle3Draft, apply_rotary_pos_emb  # noqa: E402

TUNED_FLEX = CHOICES["fwd 64x64, bwd 32/64"]


class SeparateQKVAttention(torch.nn.Module):
    """Eagle3Attention's training path with q, k and v from three projections (the model before
    TTTCache), same weights."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, cos, sin, cache, lengths, step, impl):
        a = self.attn
        b, t, _ = x.shape
        q = a.q_proj(x).view(b, t, a.nh, a.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = a.k_proj(x).view(b, t, a.nkv, a.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = a.v_proj(x).view(b, t, a.nkv, a.hd).transpose(1, 2)
        q, k = a.call(apply_rotary_pos_emb, q, k, cos, sin)
        cache.kv.append((k, v))
        keys = torch.cat([c[0] for c in cache.kv], dim=2)  # [B, nkv, T*(step+1), hd]
        values = torch.cat([c[1] for c in cache.kv], dim=2)
        out = ta.tree_attention(q, keys, values, lengths, step, backend=impl)
        return a.o_proj(out.transpose(1, 2).reshape(b, t, a.nh * a.hd))


def with_flex_options(options, fn):
    def run():
        saved, ta.FLEX_KERNEL_OPTIONS = ta.FLEX_KERNEL_OPTIONS, options
        try:
            fn()
        finally:
            ta.FLEX_KERNEL_OPTIONS = saved
    return run


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
    attn.fused = True  # RoPE compiled, as sf-train runs it
    separate = SeparateQKVAttention(attn)
    rotary = model.rotary.cuda()
    rows = []
    for t in args.seq:
        xs = [torch.randn(1, t, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(STEPS)]
        grads = [torch.randn(1, t, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(STEPS)]
        variants = {
            "ours": functools.partial(attention_block_run, attn, rotary, xs, grads, "flex"),
            "separate q/k/v": functools.partial(attention_block_run, separate, rotary, xs, grads, "flex"),
            "tuned flex": with_flex_options(TUNED_FLEX, functools.partial(attention_block_run, attn, rotary, xs,
                                                                          grads, "flex")),
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
