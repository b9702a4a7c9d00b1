"""The fused experts' two kernels (kernels/fused_moe.py) over a grid of tiles, kernel by kernel, at
one MoE layer's shape on one GPU: which tiles to make the default (fused_moe.default_launch).

    python -m benchmarks.moe_tiles [--shapes qwen3_30b_a3b,deepseek_v3] [--tokens 32768] [--grid small|full]
    TRITON_INTERPRET=1 python -m benchmarks.moe_tiles --device cpu --shapes tiny --grid tiny   # checks the script on a CPU
    python -m benchmarks.moe_tiles --resources [--grid small]   # no GPU: each tile's shared memory, registers, spills

Shapes (bf16, random weights; routing from random router logits, top-k of a softmax):
    qwen3_30b_a3b   H 2048, I 768, 128 experts, top 8
    deepseek_v3     H 7168, I 2048, 256 experts, top 8
For each kernel's candidate tiles (GRIDS: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; BLOCK_M is shared
by both kernels of a launch: align_slots pads each expert's rows to it), the kernel alone: CUDA events over ITERS
launches after 2 of warm-up (the first compiles it), median ms and TFLOP/s (gate_up 4 S H I FLOPs,
down 2 S I H, S = tokens x top_k slots). A tile that does not fit the SM's shared memory is
recorded as such. Every result is checked against the default launch's (the same slots' rows): the
tiles change the order of an fp32 accumulation only, so they agree within a few bf16 ulps of the
values' magnitude (see `agrees`); a wrong tile would be off by O(1).
JSON: results/moe_tiles.json, `summary`: shape -> kernel -> {best, default}, each {tiles, ms, tflops},
and shape -> `launch` -> {arg, ms, default_ms}: the fastest pair under one row block, as
`python -m benchmarks.capture_moe --launch ARG` takes it.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.common import MATMUL_TFLOPS, cuda_time_ms_interleaved, print_table, write_result
from specfoundry.kernels import fused_moe
from specfoundry.kernels.fused_moe import Routes, Tiles, align_slots, launch_down, launch_gate_up

SHAPES = {  # (H, I, experts, top_k)
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "deepseek_v3": (7168, 2048, 256, 8),
    "tiny": (32, 48, 4, 2),
}
FULL = list(itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4, 5)))
GRIDS = {  # kernel -> its candidates (block_m, block_n, block_k, warps, stages)
    # "small": of FULL, tiles that fit the shared memory without register spills at Qwen3-30B-A3B's
    # layer (`--resources --grid full`, no GPU needed), around the default (128, 128, 64, 8, 3)
    "small": {"gate_up": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 128, 32, 8, 5),
                          (128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 64, 128, 8, 3),
                          (64, 128, 64, 8, 3), (64, 128, 64, 8, 4), (64, 256, 32, 8, 4), (64, 128, 64, 4, 3)],
              "down": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 128, 8, 3),
                       (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4), (128, 128, 64, 4, 3),
                       (64, 128, 64, 8, 4), (64, 256, 64, 8, 3), (64, 128, 128, 8, 3)]},
    "full": {"gate_up": FULL, "down": FULL},
    "tiny": {"gate_up": [(16, 16, 16, 1, 1), (16, 32, 16, 1, 1)], "down": [(16, 16, 16, 1, 1), (16, 32, 16, 1, 1)]},
}
SMEM_BYTES = 227 * 1024  # an H100's / H200's shared memory a block may take
ITERS = 10


def smem(kernel: str, block_m: int, tiles: Tiles, itemsize: int = 2) -> int:
    """Shared memory of the software pipeline: num_stages copies of the A tile and the B tile(s)
    (gate_up loads a gate and an up tile)."""
    b_tiles = 2 if kernel == "gate_up" else 1
    return tiles.num_stages * (block_m * tiles.block_k + b_tiles * tiles.block_k * tiles.block_n) * itemsize


def problem(shape: str, tokens: int, device: str):
    """x [N, H], gate_up [E, 2I, H], down [E, H, I] (scaled so activations stay O(1)) and the routing."""
    hidden, inter, experts, top_k = SHAPES[shape]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, device=device, dtype=dtype) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=g, device=device, dtype=dtype) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)  # [N, K] each
    return x, gate_up, down, index, weights.to(dtype)


def timed_ms(fn, device: str) -> float:
    """fn's median CUDA-event ms over ITERS calls after 2 of warm-up (the first compiles it); on a CPU
    (the script's check) one untimed call, and NaN."""
    if device != "cuda":
        fn()
        return float("nan")
    return cuda_time_ms_interleaved({"fn": fn}, warmup=2, iters=ITERS)["fn"]


def agrees(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest value (inf where got holds a NaN: an unwritten
    element): bf16 results rounded once from fp32 sums in another order differ by about 2^-8 of
    their magnitude at most; 2^-6 leaves room, while a wrong tile, mask or row is off by O(1)."""
    if torch.isnan(got).any():
        return float("inf")
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def sweep(shape: str, tokens: int, grid: str, device: str) -> list[dict]:
    x, gate_up, down, index, weights = problem(shape, tokens, device)
    hidden, inter, experts, top_k = SHAPES[shape]
    slots = tokens * top_k
    default = fused_moe.default_launch(x, slots, experts)
    flops = {"gate_up": 4 * slots * hidden * inter, "down": 2 * slots * inter * hidden}
    candidates = GRIDS[grid]
    block_ms = {c[0] for kernel in candidates for c in candidates[kernel]} | {default.block_m}
    rows = []
    reference = {}
    for block_m in sorted(block_ms, key=lambda m: m != default.block_m):  # the default's first: the reference
        slot_of_row, expert_of_block = align_slots(index, experts, block_m)
        routes = Routes(slot_of_row, expert_of_block, weights.reshape(-1).contiguous(), top_k, block_m)
        real = slot_of_row < slots  # [R] the rows that hold a slot
        by_slot = torch.argsort(slot_of_row[real].long())  # those rows in slot order
        h = torch.empty(slot_of_row.numel(), inter, dtype=x.dtype, device=device)
        out = torch.empty(slots, hidden, dtype=x.dtype, device=device)
        if block_m == default.block_m:  # the default launch's results (slot order), the check of every other
            launch_gate_up(x, gate_up, h, routes, default.gate_up)
            launch_down(h, down, out, routes, default.down)
            reference = {"gate_up": h[real][by_slot].clone(), "down": out.clone()}
        for kernel, values in [(k, c[1:]) for k in ("gate_up", "down") for c in candidates[k] if c[0] == block_m]:
            tiles, call = Tiles(*values), launch_gate_up if kernel == "gate_up" else launch_down
            row = {"shape": shape, "tokens": tokens, "kernel": kernel, "block_m": block_m, "block_n": tiles.block_n,
                   "block_k": tiles.block_k, "warps": tiles.num_warps, "stages": tiles.num_stages,
                   "default": block_m == default.block_m and tiles == getattr(default, kernel)}
            if device == "cuda" and smem(kernel, block_m, tiles) > SMEM_BYTES:
                rows.append({**row, "error": "shared memory"})
                continue
            # NaN where the candidate writes, so that a row or column it leaves unwritten fails the check
            # below instead of showing an earlier launch's values
            if kernel == "gate_up":
                h.fill_(float("nan"))
            else:  # its input: h of the default gate_up tiles at this row block
                launch_gate_up(x, gate_up, h, routes, default.gate_up)
                out.fill_(float("nan"))
            args = (x, gate_up, h, routes, tiles) if kernel == "gate_up" else (h, down, out, routes, tiles)
            try:
                ms = timed_ms(lambda args=args, call=call: call(*args), device)
            except Exception as e:  # noqa: BLE001 - recorded in the row (a tile Triton cannot place)
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            diff = agrees(h[real][by_slot] if kernel == "gate_up" else out, reference[kernel])
            rate = flops[kernel] / ms / 1e9 if ms == ms else None  # TFLOP/s (none on a CPU)
            rows.append({**row, "ms": ms, "tflops": rate, "of_peak": rate / MATMUL_TFLOPS if rate else None,
                         "max_diff": diff})
            if diff > 2 ** -6:
                raise SystemExit(f"{shape} {kernel} {row}: differs from the default launch by {diff:.3g} of the "
                                 "values' magnitude: a wrong tile")
    return rows


def resources(shape: str, grid: str, arch: int = 90) -> list[dict]:
    """Each candidate of `grid` compiled for sm_`arch` without a GPU (triton.compile to a GPUTarget,
    with the 16-byte alignment hints the JIT gives aligned pointers and strides): its shared memory,
    registers and spill stack (cuobjdump's resource usage), so a grid can drop what cannot fit or
    spills before a GPU times it. Compiling for sm_90 needs Triton's bundled ptxas only."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    hidden, inter, _, top_k = SHAPES[shape]
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = []
    for kernel in ("gate_up", "down"):
        ptrs = ["x_ptr", "w_ptr", "h_ptr"] if kernel == "gate_up" else ["h_ptr", "w_ptr", "out_ptr"]
        ints = (["num_slots", "stride_xn", "stride_we", "stride_wr", "stride_hr"] if kernel == "gate_up"
                else ["weight_ptr", "num_slots", "stride_hr", "stride_we", "stride_wr", "stride_os"])
        for bm, bn, bk, warps, stages in GRIDS[grid][kernel]:
            sig = {**{n: "*bf16" for n in ptrs}, "slot_ptr": "*i32", "block_expert_ptr": "*i32",
                   **{n: "*bf16" if n.endswith("_ptr") else "i32" for n in ints}}
            k_dim, n_dim = (hidden, inter) if kernel == "gate_up" else (inter, hidden)
            const = {**({"TOP_K": top_k} if kernel == "gate_up" else {}), "H": hidden, "INTER": inter, "BLOCK_M": bm,
                     "BLOCK_N": bn, "BLOCK_K": bk, "EVEN_K": k_dim % bk == 0, "EVEN_N": n_dim % bn == 0,
                     "IEEE": False, "UPCAST": False}
            sig.update({name: "constexpr" for name in const})
            names = list(sig)
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                     if sig[n].startswith("*") or n.startswith("stride")}
            fn = fused_moe._gate_up_kernel if kernel == "gate_up" else fused_moe._down_kernel
            source = ASTSource(fn=fn, signature=sig, attrs=attrs,
                               constexprs={(names.index(n),): v for n, v in const.items()})
            row = {"shape": shape, "kernel": kernel, "block_m": bm, "block_n": bn, "block_k": bk, "warps": warps,
                   "stages": stages}
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps, "num_stages": stages})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                       text=True).stdout
            found = {key: re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK")}
            out.append({**row, "shared_kb": compiled.metadata.shared / 1024,
                        "registers": int(found["REG"].group(1)) if found["REG"] else None,
                        "spill_stack": int(found["STACK"].group(1)) if found["STACK"] else None})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="qwen3_30b_a3b", help=f"Comma-separated, of: {', '.join(SHAPES)}.")
    p.add_argument("--tokens", type=int, default=32768, help="Tokens of the layer's batch.")
    p.add_argument("--grid", default="small", choices=list(GRIDS), help="The tiles tried (GRIDS).")
    p.add_argument("--out", default="moe_tiles", help="The result's name under benchmarks/results/ (or a path).")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (TRITON_INTERPRET=1).")
    p.add_argument("--resources", action="store_true", help="No GPU needed: compile the grid's tiles for sm_90 and "
                   "print each one's shared memory, registers and spill stack, nothing timed (`resources`).")
    args = p.parse_args()
    if args.resources:
        for shape in args.shapes.split(","):
            print_table(resources(shape, args.grid), ["shape", "kernel", *TILE_KEYS, "shared_kb", "registers",
                                                      "spill_stack"])
        return
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 (it is read "
                         "when Triton is imported)")
    rows, summary = [], {}
    for shape in args.shapes.split(","):
        got = sweep(shape, args.tokens, args.grid, args.device)
        rows += got
        for kernel in ("gate_up", "down"):
            timed = [r for r in got if r["kernel"] == kernel and r.get("ms") is not None]
            if not timed:
                continue
            best = min(timed, key=lambda r: r["ms"])
            default = next((r for r in timed if r["default"]), None)
            summary.setdefault(shape, {})[kernel] = {
                name: None if r is None else {"tiles": {k: r[k] for k in TILE_KEYS}, "ms": r["ms"], "tflops": r["tflops"]}
                for name, r in (("best", best), ("default", default))}
        if shape in summary:
            summary[shape]["launch"] = best_launch(got)
    print_table(rows_to_show(rows), COLUMNS)
    print("best and default per kernel:", summary)
    if args.device != "cuda":
        return  # a check of the script: no result file
    path = write_result(args.out, rows, {"summary": summary, "tokens": args.tokens, "grid": args.grid})
    print(f"wrote {path}")


TILE_KEYS = ("block_m", "block_n", "block_k", "warps", "stages")
COLUMNS = ["shape", "kernel", *TILE_KEYS, "default", "ms", "tflops", "of_peak", "max_diff", "error"]


def best_launch(rows: list[dict]) -> dict:
    """The fastest pair of tiles under one row block (both kernels share it): `arg`, the pair as
    capture_moe's 9-number --launch; `ms`, its gate_up + down ms; `default_ms`, the default launch's."""
    pairs = {}
    for block_m in sorted({r["block_m"] for r in rows}):
        fastest = {kernel: min((r for r in rows if r["kernel"] == kernel and r["block_m"] == block_m
                                and r.get("ms") is not None), key=lambda r: r["ms"], default=None)
                   for kernel in ("gate_up", "down")}
        if None not in fastest.values():
            pairs[block_m] = fastest
    if not pairs:
        return {}
    block_m, pair = min(pairs.items(), key=lambda kv: kv[1]["gate_up"]["ms"] + kv[1]["down"]["ms"])
    default = {r["kernel"]: r["ms"] for r in rows if r["default"] and r.get("ms") is not None}
    arg = ",".join(str(v) for v in [block_m] + [pair[k][t] for k in ("gate_up", "down") for t in TILE_KEYS[1:]])
    return {"arg": arg, "ms": pair["gate_up"]["ms"] + pair["down"]["ms"],
            "default_ms": sum(default.values()) if len(default) == 2 else None}


def rows_to_show(rows: list[dict]) -> list[dict]:
    """Per shape and kernel: the 8 fastest, and the default wherever it ranks."""
    shown = []
    for _, group in itertools.groupby(sorted(rows, key=lambda r: (r["shape"], r["kernel"], r.get("ms") or float("inf"))),
                                      key=lambda r: (r["shape"], r["kernel"])):
        group = list(group)
        shown += group[:8] + [r for r in group[8:] if r["default"]]
    return shown


if __name__ == "__main__":
    main()
