"""The target's verify step by its width and dtype, on one GPU: why a float32 target's verify costs
more than a bfloat16 one, and which widths are cheap.

    python -m benchmarks.verify_width [--widths 1,2,4,8,9,16,17,32] [--iters 20] [--profile-widths 8,17]

The families run of 2026-12-06 timed sf-eval in its default dtype, float32 (greedy equality exact), and
found the target's verify of 8 tokens (EAGLE-3's chain of 7) at 7.1 ms a round and of 16 (a DFlash
block) at 7.5 ms, but of 17 (a DSpark block of 16) at 4.8 ms, against some 3.2 ms a token step. This
measures that step alone, SmolLM2-135M's shape with random weights (benchmarks/decode_step.py SHAPES;
a step's time depends on the shapes alone), after a prompt of --prompt tokens: the decoding core's
captured step (decoding/target.py TargetRunner, as sf-eval runs it without --compile-target) of T
tokens and the crop that undoes it, for each T of --widths, in each mode of --modes, one after the other:
    float32        sf-eval's default: float32 weights, full-precision matmuls
    float32_tf32   float32 weights, matmuls in TF32 (torch.backends.cuda.matmul.allow_tf32)
    float32_cublaslt  float32, matmuls through cuBLASLt (torch.backends.cuda.preferred_blas_library),
                   whose kernel choice for few rows may differ from cuBLAS's
    bfloat16       bfloat16 weights
The `mm_*` rows time the step's matmuls alone, per call with the host running ahead: the MLP's up
projection [T, 576] x [576, 1536], its down projection [T, 1536] x [1536, 576], and the output head
[T, 576] x [576, 49152] (a step runs 30 layers of 7 matmuls and one head). --profile-widths adds
torch.profiler tables of 10 float32 steps of each of those widths (device kernels). CUDA events
after warm-up, median ms; the widths interleaved within a mode. JSON: results/verify_width.json
(`summary.ms`: mode -> row -> {T: ms}).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    cuda_time_ms_back_to_back,
    cuda_time_ms_interleaved,
    print_profile_summary,
    print_table,
    profile_summary,
    write_result,
)
from benchmarks.decode_step import AUX, SHAPES
from specfoundry.common.target import Target
from specfoundry.decoding.target import TargetRunner

MODES = {"float32": (torch.float32, False, "cublas"), "float32_tf32": (torch.float32, True, "cublas"),
         "float32_cublaslt": (torch.float32, False, "cublaslt"), "bfloat16": (torch.bfloat16, False, "cublas")}
"""mode -> (weights' dtype, TF32 matmuls, the BLAS library torch calls for a matmul)."""
MATMULS = {"mm_up": (576, 1536), "mm_down": (1536, 576), "mm_head": (576, 49152)}  # (in, out) features


def build(dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES["smollm2"], attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def step_rows(mode: str, widths: list[int], prompt_len: int, iters: int, device: str) -> dict:
    """{T: ms} of the core's step of T tokens (and its crop) after the prompt, in `mode`."""
    dtype, _, _ = MODES[mode]
    model = build(dtype, device)
    runner = TargetRunner(Target.wrap(model), AUX["smollm2"], graphs=device == "cuda")
    runner.reset(prompt_len + max(widths) + 1)
    prompt = torch.randint(model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.forward(prompt)

    def step(t: int):
        ids = list(range(3, 3 + t))

        def run():
            runner.forward(ids)
            runner.crop(prompt_len)
        return run

    fns = {t: step(t) for t in widths}
    if device != "cuda":  # a check of the script: each step once
        for fn in fns.values():
            fn()
        return {t: None for t in widths}
    return cuda_time_ms_interleaved(fns, warmup=3, iters=iters)


def matmul_rows(mode: str, widths: list[int], device: str) -> dict:
    """{row: {T: ms}}: each of MATMULS alone at T rows, device time per call (back to back)."""
    dtype, _, _ = MODES[mode]
    out = {}
    for name, (k, n) in MATMULS.items():
        weight = torch.randn(n, k, device=device, dtype=dtype)
        out[name] = {}
        for t in widths:
            x = torch.randn(t, k, device=device, dtype=dtype)
            out[name][t] = (cuda_time_ms_back_to_back(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
                            if device == "cuda" else None)
    return out


def profiles(widths: list[int], prompt_len: int) -> dict:
    """Device-kernel tables of 10 float32 steps of each width."""
    model = build(torch.float32, "cuda")
    runner = TargetRunner(Target.wrap(model), AUX["smollm2"], graphs=True)
    runner.reset(prompt_len + max(widths) + 1)
    runner.forward(list(range(1, prompt_len + 1)))
    out = {}
    for t in widths:
        ids = list(range(3, 3 + t))
        for _ in range(3):
            runner.forward(ids)
            runner.crop(prompt_len)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.forward(ids)
                runner.crop(prompt_len)
            torch.cuda.synchronize()
        out[f"float32 T={t}"] = profile_summary(prof)
        print_profile_summary(f"float32 step of {t} tokens: device, 10 steps", out[f"float32 T={t}"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--widths", default="1,2,4,8,9,16,17,32", help="Comma-separated token counts of the steps.")
    p.add_argument("--prompt", type=int, default=256, help="Tokens of the prompt every step follows.")
    p.add_argument("--iters", type=int, default=20, help="Timed iterations of each step (after 3 of warm-up).")
    p.add_argument("--profile-widths", default="8,17",
                   help="Widths whose float32 step gets a torch.profiler table (comma-separated; empty: none).")
    p.add_argument("--modes", default=",".join(MODES), help=f"Comma-separated, of: {', '.join(MODES)}.")
    p.add_argument("--out", default="verify_width", help="The result's name under benchmarks/results/ (or a path).")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (no timings, no file).")
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    summary: dict[str, dict] = {"ms": {}}
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.preferred_blas_library()
    try:
        for mode in modes:
            # (both read at each matmul's launch, so at each graph's capture)
            _, torch.backends.cuda.matmul.allow_tf32, blas = MODES[mode]
            if args.device == "cuda":  # (a CPU build refuses cuBLASLt; its check runs the mode as plain float32)
                torch.backends.cuda.preferred_blas_library(blas)
            summary["ms"][mode] = {"step": step_rows(mode, widths, args.prompt, args.iters, args.device),
                                   **matmul_rows(mode, widths, args.device)}
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous[0]
        if args.device == "cuda":
            torch.backends.cuda.preferred_blas_library(previous[1])
    rows = [{"mode": mode, "row": row, **{f"T={t}": ms for t, ms in by_width.items()}}
            for mode, by_row in summary["ms"].items() for row, by_width in by_row.items()]
    print_table(rows, ["mode", "row", *(f"T={t}" for t in widths)])
    if args.device != "cuda":
        return
    profile_widths = [int(w) for w in args.profile_widths.split(",") if w]
    extra = {"summary": summary, "prompt_tokens": args.prompt,
             "profile": profiles(profile_widths, args.prompt) if profile_widths else {}}
    print(f"wrote {write_result(args.out, rows, extra)}")


if __name__ == "__main__":
    main()
