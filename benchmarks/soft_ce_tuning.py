"""Tuning sweep for the soft-CE kernel's launch (not a benchmark: no JSON). For each shape, our
kernel alone (one forward that writes the gradient, inputs made beforehand) is timed for every
launch setting, all settings in turn within each iteration, and printed in microseconds and in
TB/s of the bytes a single pass moves (z and p read, the gradient written), with the registers
and spills of each compiled variant.

Whole rows (V <= WHOLE_ROW_MAX, one register tile): programs per SM x warps x p held or
re-read. Chunked rows (V = 151936, or block forced to CHUNK): programs per SM x L2 hints x warps.
Every setting's gradient is checked against the plain torch reference before timing.

    python -m benchmarks.soft_ce_tuning            (output: benchmarks/results/soft_ce_tuning.log)
    python -m benchmarks.soft_ce_tuning --profile  (where a whole forward + backward call goes)
"""

from __future__ import annotations

import sys

import torch
import triton

import specfoundry.kernels.soft_ce as sc
from benchmarks.common import cuda_time_ms_interleaved
from benchmarks.kernels import NoCtx, assert_gradient_matches, loss_inputs, loss_kernel_ms, weighted_loss_case

CASES = [(4096, 32000, torch.bfloat16), (4096, 32000, torch.float32), (16384, 32000, torch.bfloat16),
         (16384, 32000, torch.float32), (2048, 151936, torch.bfloat16), (2048, 151936, torch.float32)]
PROFILE_CASES = [(4096, torch.bfloat16, 1), (4096, torch.float32, 1), (4096, torch.bfloat16, 7)]
WHOLE = [sc.LaunchConfig(per_sm, warps, hold_p=hold) for per_sm in (1, 2) for warps in (8, 16, 32)
         for hold in (False, True) if per_sm * warps <= 32]
CHUNKED = [sc.LaunchConfig(per_sm, warps, evict=evict) for per_sm in (1, 2, 4) for warps in (8, 16)
           for evict in (False, True)]
STATIC = torch.compile(sc.soft_ce_reference, dynamic=False)  # the compiled reference without dynamic shapes


def label(kind: str, c: sc.LaunchConfig) -> str:
    extra = ("P" if c.hold_p else "-") if kind == "whole" else ("E" if c.evict else "-")
    return f"{kind[0]}{c.programs_per_sm}/w{c.num_warps}/{extra}"


def registers() -> list[str]:
    """Registers per thread and spilled bytes of every compiled variant (Triton's kernel cache;
    a diagnostic, so a change in Triton's internals only loses these lines)."""
    out = []
    try:
        for caches in sc._soft_ce_kernel.device_caches.values():
            for key, kernel in caches[0].items():
                kernel._init_handles()
                out.append(f"# regs {kernel.n_regs:3d} spills {kernel.n_spills:6d} warps {kernel.metadata.num_warps:2d}"
                           f"  {str(key)[:300]}")
    except Exception as e:  # noqa: BLE001
        out.append(f"# registers unavailable: {e!r}")
    return out


def sweep_case(n: int, v: int, dtype: torch.dtype) -> str:
    z, p, mask, norm = loss_inputs(n, v, dtype)
    logits = z.clone()  # z itself is overwritten by every timed call
    whole = triton.next_power_of_2(v) <= sc.WHOLE_ROW_MAX
    settings = ([("whole", c) for c in WHOLE] if whole else []) + [("chunked", c) for c in CHUNKED]
    fns = {}
    for kind, config in settings:
        def ours(kind=kind, config=config):
            whole = kind == "whole"  # whole rows are tried for bf16 too (the library keeps them to fp32)
            sc.SoftTargetCrossEntropy.forward(NoCtx(), z, p, mask, norm, None if whole else sc.CHUNK, 1.0, True,
                                              config, whole)
        fns[label(kind, config)] = ours
    for ours in fns.values():  # each setting's gradient checked before any is timed
        z.copy_(logits)
        ours()
        assert_gradient_matches(logits, p, mask, norm, z, grad_scale=1.0)
    ms = cuda_time_ms_interleaved(fns, 3, 15)
    moved = n * v * 3 * z.element_size()
    out = [f"N={n} V={v} {str(dtype).split('.')[1]}:"]
    out += [f"{name} {t * 1e3:.0f}us {moved / t / 1e9:.2f}TB/s" for name, t in sorted(ms.items(), key=lambda kv: kv[1])]
    return " | ".join(out)


def profile_case(n: int, dtype: torch.dtype, steps: int, compiled, v: int = 32000) -> None:
    """Where one forward + backward spends its time: the kernel alone (CUDA events around the
    launch, inputs made beforehand) against the whole call, and the profiler's GPU table."""
    kernel = loss_kernel_ms(n, v, dtype)
    run = weighted_loss_case(n, v, dtype, steps)
    calls = {"ours": lambda: run(lambda z, p, mask, norm, w: sc.soft_target_cross_entropy(z, p, mask, norm, impl="triton",
                                                                                        grad_scale=w)),
             "compiled": lambda: run(lambda z, p, mask, norm, w: compiled(z, p, mask, norm)),
             "compiled static": lambda: run(lambda z, p, mask, norm, w: STATIC(z, p, mask, norm))}
    ms = cuda_time_ms_interleaved(calls, 3, 15)
    e = torch.finfo(dtype).bits // 8
    print(f"N={n} {str(dtype).split('.')[1]} x{steps}: kernel alone {kernel:.3f} ms "
          f"({n * v * 3 * e / kernel / 1e9:.2f} TB/s of the least DRAM bytes: z, p read once, z written once); "
          f"whole call x{steps}: " + ", ".join(f"{k} {t:.3f} ms" for k, t in ms.items()), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for name in ("ours", "compiled"):
            calls[name]()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)


def main():
    compiled = torch.compile(sc.soft_ce_reference)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if "--profile" in sys.argv:
        for case in PROFILE_CASES:
            profile_case(*case, compiled)
            torch.cuda.empty_cache()
        return
    print("# whole rows: w<programs per SM>/w<warps>/<P: p held, -: re-read>; chunked: c<per SM>/w<warps>/<E: L2 hints>")
    for case in CASES:
        print(sweep_case(*case), flush=True)
        torch.cuda.empty_cache()
    print("\n".join(registers()))


if __name__ == "__main__":
    main()
