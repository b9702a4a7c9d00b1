"""Tuning sweep for the soft-CE kernel's launch (not a benchmark: no JSON): persistent programs
per SM x L2 eviction hints x warps, each timed relative to the compiled torch reference, on one
GPU, forward + backward of the trainer's weighted form (loss weights 0.8^s over `steps` calls).

    python benchmarks/soft_ce_tuning.py   (H200 output: benchmarks/results/soft_ce_tuning.log)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# the repo root replaces this script's folder on the path (see kernels.py)
sys.path[0] = str(Path(__file__).resolve().parents[1])
import specfoundry.kernels.soft_ce as sc  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402
from benchmarks.kernels import weighted_loss_case  # noqa: E402

CASES = [(4096, torch.bfloat16, 1), (4096, torch.float32, 1), (4096, torch.bfloat16, 7),
         (16384, torch.float32, 7), (16384, torch.bfloat16, 7)]


def sweep_case(n: int, dtype: torch.dtype, steps: int, compiled, v: int = 32000) -> str:
    run = weighted_loss_case(n, v, dtype, steps)

    def ours(z, p, mask, norm, w):
        return sc.soft_target_cross_entropy(z, p, mask, norm, impl="triton", grad_scale=w)

    base = cuda_time_ms(lambda: run(lambda z, p, mask, norm, w: compiled(z, p, mask, norm)), 5, 20)
    out = [f"N={n} {str(dtype).split('.')[1]} x{steps} compiled {base:.3f}"]
    for per_sm in (1, 2, 4):
        for evict in (False, True):
            for warps in (8, 16):
                sc.PROGRAMS_PER_SM, sc.EVICTION_HINTS, sc.NUM_WARPS = per_sm, evict, warps
                ms = cuda_time_ms(lambda: run(ours), 5, 20)
                out.append(f"{per_sm}/{'E' if evict else '-'}/w{warps}:{ms / base:.3f}")
    return " ".join(out)


def main():
    compiled = torch.compile(sc.soft_ce_reference)
    for case in CASES:
        print(sweep_case(*case, compiled), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
