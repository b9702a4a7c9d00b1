"""Kernel benchmarks on one GPU: TTT attention block and the in-place soft-target loss.

    python -m benchmarks.kernels [--quick] [--only attention|loss] [--seq T ...]

Attention: the draft's attention block at the Llama-3.1-8B draft shape (input 2H = 8192,
32 query heads, 8 KV heads, head_dim 128, RoPE), batch 1, TTT length 7, all 7 steps forward +
backward. Ours (FlexAttention BlockMask) against (a) the original EAGLE-3 eager formulation and
(b) SDPA with the dense mask. All three project q/k/v as sf-train does, in one GEMM (TTTCache);
ours and (b) apply RoPE compiled, as sf-train does (compile_elementwise); (a) runs it eagerly, as
the original code does. The attention core alone is timed too and counted in useful
FLOPs: pairs(s) = T(T+1)/2 + s*T visible (query, key) pairs at step s; forward 4*pairs*nh*hd
(QK^T and PV), backward 10*pairs*nh*hd (dV, dP, dQ, dK and the recomputed QK^T).
core_TFLOPs_computed (ours): the same rate over the tiles the BlockMask does not skip, each
computed whole (about 1.22x the useful FLOPs at T=4096: the later steps' diagonal tiles).
Loss: [N, 32000] logits, fp32 and bf16, forward + backward, one call and the 7-step weighted
form, the three implementations timed in turn within each iteration. TB/s counts
N*V*(3*e_z + 2*e_p) bytes for every implementation (z and p read for the loss, read again for
the gradient, the gradient written) over the whole call, its Python and small ops included. Before timing a
shape, ours is checked against the fp32 reference (loss, gradient, gradient in place).
kernel_ms / kernel_TB/s: our kernel alone (no autograd or small ops), counting the least bytes an
in-place kernel must move to and from DRAM: z and p read once, the gradient written once. Its
second reads (p for fp32 rows held in registers, z and p for bf16 rows in chunks) are meant to
hit L2 and are not counted.
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.common import (
    COPY_TBPS,
    MATMUL_TFLOPS,
    cuda_time_ms,
    cuda_time_ms_interleaved,
    peak_memory_gib,
    print_table,
    wall,
    write_result,
)
from specfoundry.families.eagle3.model import Eagle3Attention, Eagle3Draft, TTTCache
from specfoundry.families.eagle3.shapes import LLAMA8B_DRAFT
from specfoundry.kernels.soft_ce import SoftTargetCrossEntropy, soft_ce_reference, soft_target_cross_entropy
from specfoundry.kernels.tree_attention import eager_tree_attention, tree_attention, ttt_block_mask

STEPS = 7
# warm-up calls, then timed calls (median): more than common's defaults, since the first timings
# after a compile that left the GPU idle read high; the extra runs cost about a second
ATTENTION_RUNS = (5, 15)


def attention_block_run(attn: Eagle3Attention, rotary, xs, grads, impl: str):
    t = xs[0].shape[1]
    cache = TTTCache()  # as sf-train runs it: q/k/v as one projection
    outs = []
    for s in range(STEPS):
        pos = (torch.arange(t, device="cuda") + s)[None]
        cos, sin = rotary(xs[s], pos)
        outs.append(attn.ttt_attention(xs[s], cos.to(xs[s].dtype), sin.to(xs[s].dtype), cache, [t], s, impl))
    loss = sum((o * g).sum() for o, g in zip(outs, grads, strict=True))
    loss.backward()


def core_inputs(t: int) -> tuple[list, list, list]:
    """Per TTT step, random bf16 q [1, 32, t, 128] and k, v [1, 8, t, 128] (the 8B draft's heads)
    that take a gradient: the attention core's inputs."""
    def per_step(heads):
        return [torch.randn(1, heads, t, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(STEPS)]
    return per_step(32), per_step(8), per_step(8)


def core_run(qs, ks, vs, impl, **flex):
    """All TTT steps of the attention core, forward + backward. flex: tree_attention's launch
    settings (kernel_options=, compiled=)."""
    t = qs[0].shape[2]
    outs = []
    for s in range(STEPS):
        k = torch.cat(ks[: s + 1], dim=2)
        v = torch.cat(vs[: s + 1], dim=2)
        if impl == "eager":
            outs.append(eager_tree_attention(qs[s], k, v, [t], s))
        else:
            outs.append(tree_attention(qs[s], k, v, [t], s, backend=impl, **flex))
    sum(o.float().sum() for o in outs).backward()


def core_flops(t: int, nh: int = 32, hd: int = 128) -> float:
    pairs = sum(t * (t + 1) / 2 + s * t for s in range(STEPS))
    return 14 * pairs * nh * hd


def flex_tile_flops(t: int, device, nh: int = 32, hd: int = 128) -> float:
    """The FLOPs FlexAttention actually spends: every (query block, key block) tile its
    BlockMask does not skip is computed whole, partial or full. A later step's diagonal tile
    holds one visible pair per query, 128 of its 128x128, so this exceeds core_flops.
    device: where the flex run built its masks (they come from the cache); the layout is the
    same on any device."""
    tiles = 0
    for s in range(STEPS):
        mask = ttt_block_mask([t], t, s, device)
        tiles += int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())
        q_block, kv_block = mask.BLOCK_SIZE
    return 14 * tiles * q_block * kv_block * nh * hd


def bench_attention(seqs: list[int]) -> list[dict]:
    torch.manual_seed(0)
    model = Eagle3Draft(LLAMA8B_DRAFT)
    attn = model.midlayer.self_attn.cuda().to(torch.bfloat16)
    rotary = model.rope.cuda()
    rows = []
    for t in seqs:
        xs = [torch.randn(1, t, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(STEPS)]
        grads = [torch.randn(1, t, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(STEPS)]
        qs, ks, vs = core_inputs(t)
        for impl, name in (("flex", "ours (flex BlockMask)"), ("eager", "(a) eager EAGLE-3"), ("sdpa", "(b) SDPA dense mask")):
            # RoPE compiled as sf-train runs it (compile_elementwise), for ours and (b); eager in (a), the original code
            attn.compiled_elementwise = impl != "eager"
            row = {"what": "attention block", "T": t, "impl": name}
            try:
                block = functools.partial(attention_block_run, attn, rotary, xs, grads, impl)
                core = functools.partial(core_run, qs, ks, vs, impl)
                row["first_call_s"] = wall(block)  # compile + mask build, reported apart
                row["ms"] = cuda_time_ms(block, *ATTENTION_RUNS)
                row["peak_GiB"] = peak_memory_gib(block)
                core_ms = cuda_time_ms(core, *ATTENTION_RUNS)
                row["core_ms"] = core_ms
                row["core_TFLOPs"] = core_flops(t) / core_ms / 1e9
                row["core_%_of_matmul"] = 100 * row["core_TFLOPs"] / MATMUL_TFLOPS
                if impl == "flex":
                    row["core_TFLOPs_computed"] = flex_tile_flops(t, qs[0].device) / core_ms / 1e9
            except torch.cuda.OutOfMemoryError:
                row["ms"] = "OOM"
            for x in xs + qs + ks + vs:
                x.grad = None
            torch.cuda.empty_cache()
            rows.append(row)
        ours = next(r for r in rows if r["T"] == t and r["impl"].startswith("ours"))
        eager = next(r for r in rows if r["T"] == t and r["impl"].startswith("(a)"))
        if isinstance(eager.get("ms"), float) and isinstance(ours.get("ms"), float):
            ours["speedup_vs_eager"] = eager["ms"] / ours["ms"]
            ours["mem_saving_vs_eager_%"] = 100 * (1 - ours["peak_GiB"] / eager["peak_GiB"])
    return rows


def loss_inputs(n: int, v: int, dtype: torch.dtype, device: str = "cuda"):
    """Random logits z [n, v], target distributions p [n, v], a row mask (about 10% out) and
    its count as the normaliser."""
    z = torch.randn(n, v, device=device, dtype=dtype)
    p = torch.softmax(torch.randn(n, v, device=device), -1).to(dtype)
    mask = torch.rand(n, device=device) > 0.1
    return z, p, mask, mask.sum().float()


def weighted_loss_case(n: int, v: int, dtype: torch.dtype, steps: int, device: str = "cuda"):
    """Random logits, target distributions and a row mask for `steps` losses of [n, v]; returns
    run(fn), one forward + backward of sum_s 0.8^s * fn(z_s, p_s, mask, normaliser, w_s), where
    w_s = 0.8^s is the gradient into loss s (ours is told it, as the trainer tells it).

    The gradients are taken with autograd.grad, as a training step hands dL/dlogits on to the
    lm_head matmul's backward. A .backward() into leaf logits would make autograd copy ours into
    .grad (the gradient it gets is the leaf's own buffer), a full [N, V] copy training never does."""
    inputs = [loss_inputs(n, v, dtype, device) for _ in range(steps)]
    zs = [z.requires_grad_(True) for z, _, _, _ in inputs]
    ps = [p for _, p, _, _ in inputs]
    _, _, mask, norm = inputs[0]  # one row mask for every step, as the steps of one batch share it

    def run(fn):
        total = sum(0.8 ** s * fn(z, p, mask, norm, 0.8 ** s) for s, (z, p) in enumerate(zip(zs, ps, strict=True)))
        torch.autograd.grad(total, zs)

    return run


# gradient tolerances against the fp32 reference, as in tests/test_soft_ce.py's GPU test:
# atol relative to the largest gradient entry; bf16 is one bf16 step (2^-7) of rtol
GRAD_TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-3, 2 ** -7)}


def assert_gradient_matches(logits: torch.Tensor, p, mask, norm, gradient: torch.Tensor, grad_scale: float) -> None:
    """Raise unless `gradient` [N, V] (what our kernel wrote over a copy of `logits`) is
    grad_scale * dL/dz of the plain torch reference at fp32: a launch setting that is fast but
    wrong must not reach a results table."""
    z = logits.float().requires_grad_(True)
    (grad_scale * soft_ce_reference(z, p.float(), mask, norm)).backward()
    atol, rtol = GRAD_TOLERANCES[logits.dtype]
    torch.testing.assert_close(gradient.float(), z.grad, atol=atol * z.grad.abs().max().item(), rtol=rtol)


def check_loss(n: int, v: int, dtype: torch.dtype, grad_scale: float = 0.8, device: str = "cuda") -> None:
    """Our loss and in-place gradient at this shape against the reference, through the public
    function and autograd (announced grad_scale, upstream gradient grad_scale), before timing."""
    z, p, mask, norm = loss_inputs(n, v, dtype, device)
    ours = z.clone().requires_grad_(True)
    loss = soft_target_cross_entropy(ours, p, mask, norm, impl="triton", grad_scale=grad_scale)
    (gradient,) = torch.autograd.grad(grad_scale * loss, ours)
    torch.testing.assert_close(loss, soft_ce_reference(z, p, mask, norm), atol=1e-3, rtol=1e-5)
    assert gradient.data_ptr() == ours.data_ptr(), "the gradient is not in the logits' own buffer"
    assert_gradient_matches(z, p, mask, norm, gradient, grad_scale)


def loss_kernel_ms(n: int, v: int, dtype: torch.dtype) -> float:
    """Our kernel alone: one forward that writes the gradient, inputs made beforehand (no
    autograd, no small ops), CUDA events around the launch."""
    z, p, mask, norm = loss_inputs(n, v, dtype)
    return cuda_time_ms(lambda: SoftTargetCrossEntropy.forward(NoCtx(), z, p, mask, norm), 3, 20)


class NoCtx:
    """Stands in for autograd's ctx, to call the Function's forward on its own."""

    def save_for_backward(self, *tensors):
        pass


def bench_loss(shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    compiled = torch.compile(soft_ce_reference)
    for n, v in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            e = torch.finfo(dtype).bits // 8
            check_loss(n, v, dtype)  # raises before any time is taken if ours is wrong here
            kernel_ms = loss_kernel_ms(n, v, dtype)
            for steps in (1, STEPS):
                run = weighted_loss_case(n, v, dtype, steps)
                variants = {
                    "ours (triton in place)": lambda z, p, m, nn, w: soft_target_cross_entropy(z, p, m, nn, impl="triton",
                                                                                            grad_scale=w),
                    "torch reference": lambda z, p, m, nn, w: soft_ce_reference(z, p, m, nn),
                    "torch.compile reference": lambda z, p, m, nn, w: compiled(z, p, m, nn),
                }
                logits_gib = n * v * e * steps / 2**30
                try:  # interleaved, so that a drift of the clock falls on all three alike
                    times = cuda_time_ms_interleaved({name: functools.partial(run, fn) for name, fn in variants.items()},
                                                     3, 15)
                except torch.cuda.OutOfMemoryError:
                    times = {}
                for name, fn in variants.items():
                    row = {"what": "soft CE", "N": n, "V": v, "dtype": str(dtype).split(".")[1], "steps": steps,
                           "impl": name}
                    if name in times:
                        row["ms"] = times[name]
                        row["extra_GiB"] = peak_memory_gib(functools.partial(run, fn))
                        row["extra_%_of_logits"] = 100 * row["extra_GiB"] / logits_gib
                        row["TB/s"] = n * v * (3 * e + 2 * e) * steps / (row["ms"] * 1e-3) / 1e12
                        row["%_of_copy_bw"] = 100 * row["TB/s"] / COPY_TBPS
                    else:
                        row["ms"] = "OOM"
                    torch.cuda.empty_cache()
                    rows.append(row)
                ours, comp = rows[-3], rows[-1]
                if isinstance(ours.get("ms"), float) and isinstance(comp.get("ms"), float):
                    ours["time_vs_compiled"] = ours["ms"] / comp["ms"]
                # the kernel alone moves z in, p in and the gradient out once (rows held whole)
                ours["kernel_ms"] = kernel_ms * steps
                ours["kernel_TB/s"] = n * v * (2 * e + e) / (kernel_ms * 1e-3) / 1e12
                del run
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Smaller sizes (a smoke run).")
    ap.add_argument("--only", choices=["attention", "loss"],
                    help="Run one of the two (results go to kernels_<name>.json instead of kernels.json).")
    ap.add_argument("--seq", type=int, nargs="+", help="Attention at these T only (default 2048 4096 8192).")
    args = ap.parse_args()
    seqs = args.seq or ([1024] if args.quick else [2048, 4096, 8192])
    shapes = [(1024, 32000)] if args.quick else [(4096, 32000), (16384, 32000)]
    att, loss = [], []
    if args.only != "loss":
        att = bench_attention(seqs)
        print_table(att, ["T", "impl", "ms", "peak_GiB", "first_call_s", "speedup_vs_eager", "mem_saving_vs_eager_%",
                          "core_ms", "core_TFLOPs", "core_%_of_matmul", "core_TFLOPs_computed"])
    if args.only != "attention":
        loss = bench_loss(shapes)
        print_table(loss, ["N", "dtype", "steps", "impl", "ms", "extra_GiB", "extra_%_of_logits", "TB/s",
                           "%_of_copy_bw", "time_vs_compiled", "kernel_ms", "kernel_TB/s"])
    name = ("kernels" + (f"_{args.only}" if args.only else "") + ("_quick" if args.quick else "")
            + ("_T" + "_".join(map(str, args.seq)) if args.seq else ""))
    print(write_result(name, att + loss))


if __name__ == "__main__":
    main()
