"""Launch options of the TTT FlexAttention kernels (not a benchmark: no JSON): the attention core
alone (no projections), all 7 TTT steps forward + backward at the Llama-3.1-8B draft shape
(32 query heads, 8 KV heads, head_dim 128, batch 1), for inductor's defaults, a few fixed
kernel_options, and (--autotune) inductor's max-autotune search, each compiled afresh; time, TFLOP/s of
useful work (kernels.py's count) and compile time.

    python -m benchmarks.flex_tuning [--seq 4096]   (output: results/flex_tuning.log)
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import specfoundry.kernels.tree_attention as ta
from benchmarks.common import cuda_time_ms
from benchmarks.kernels import STEPS, core_flops, core_inputs, core_run

CHOICES = {
    "defaults": None,
    "fwd 64x64 w4 s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 64x64, bwd 32/64": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                             "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                             "bwd_num_warps": 4, "bwd_num_stages": 3},
    "fwd 128x128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x64 w8 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "bwd 64/128 w8 s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd 64/64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096, help="TTT length T (tokens per step).")
    ap.add_argument("--autotune", action="store_true",
                    help="Also inductor's max-autotune search (minutes: it benchmarks every candidate for the 7 step shapes).")
    args = ap.parse_args()
    t = args.seq
    if args.autotune:
        CHOICES["max-autotune"] = "autotune"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; T={t}, {STEPS} steps fwd+bwd", flush=True)
    inputs = core_inputs(t)
    for name, options in CHOICES.items():
        torch._dynamo.reset()  # each choice compiled afresh
        if options == "autotune":
            flex = {"compiled": ta.compiled_flex(mode="max-autotune-no-cudagraphs")}
        else:
            flex = {"kernel_options": options}
        run = functools.partial(core_run, *inputs, "flex", **flex)
        try:
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            ms = cuda_time_ms(run, 2, 7)
            print(f"{name:20s} {ms:7.2f} ms  {core_flops(t) / ms / 1e9:6.1f} TFLOP/s  first call {compile_s:5.1f} s",
                  flush=True)
        except Exception as e:  # noqa: BLE001  a config the kernel cannot take (shared memory): report, go on
            print(f"{name:20s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
