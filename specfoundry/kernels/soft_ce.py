"""Masked soft-target cross entropy whose gradient is written into the logits buffer itself.

For logits z [N, V], a target distribution p [N, V] (rows need not sum to 1) and a row mask
m [N], the loss is

    L = (1 / normaliser) * sum_r m_r * l_r,     l_r = -sum_v p_rv * log softmax(z_r)_v

where the caller chooses `normaliser` (the trainer passes the number of valid positions, so L
is the mean over valid positions; default: the number of masked-in rows, at least 1).

Math per row (dropping r). With lse = log sum_v exp(z_v) and s = sum_v p_v:
    l = -sum_v p_v (z_v - lse) = s * lse - sum_v p_v z_v
    dl/dz_v = s * softmax(z)_v - p_v
so with the upstream gradient g: dL/dz_v = g * m / normaliser * (s * exp(z_v - lse) - p_v).

One kernel does the forward and, when the logits need a gradient, the gradient too, for the
upstream gradient g0 = `grad_scale` that the caller announces (the trainer's loss weight 0.8^s
over the accumulation steps). Persistent programs each take rows pid, pid + G, ..., in one of
two ways (benchmarks/soft_ce_tuning.py sweeps the launch settings behind each choice):

  whole rows (fp32 and V <= 32768, as the draft vocab of 32000): the row is one register tile. z and
         p are read once; max, lse = m + log sum exp(z - m), s and sum p*z are reductions over
         the tile; l (a [N] fp32 vector) is stored, then g0 * m / normaliser * (s * exp(z - lse)
         - p) overwrites z, from the registers. p is read a second time rather than held (8 warps
         of 255 registers hold z; holding p too spills), and that read hits L2. DRAM sees z and
         p once and one write of z, the least an in-place kernel can move. G = 2 per SM: one
         program fills an SM's registers, so the second waits and takes over without a launch.
  chunked rows (bf16/fp16, or V > 32768): pass 1 reads z and p in chunks of 8192: an online
         max / sum-exp gives lse without storing exp(z) (m' = max(m, max chunk);
         d = d * exp(m - m') + sum exp(chunk - m')), while s and sum p*z accumulate alongside,
         and l is stored; pass 2 reads the chunks again and overwrites z with the gradient. Pass
         1 loads with an L2 "evict last" hint and pass 2 and its stores with "evict first", so
         pass 2 finds its row in L2 (a bf16 row of z and p at V = 32000 is 128 KB, so the rows
         of two resident programs per SM are a fraction of a data-centre GPU's L2): DRAM again sees about one read of z and p and
         one write. G = 4 per SM (two resident, two queued). bf16 rows take this path rather than
         the whole-row one because a whole row needs all registers of an SM for one program,
         where chunks let two overlap; fp32 rows are twice as large and miss L2 in pass 2.
Backward: the buffer holds dL/dz for g0; for the actual g it is scaled in place by g / g0, a
pass that is skipped inside the kernel (no host sync) when g / g0 is 1 to within 1e-6. No
second [N, V] buffer is ever allocated (the SpecForge paper's Algorithm 3).

THE LOGITS BUFFER IS CONSUMED, BY THE FORWARD: once the loss is computed, the tensor passed as
`logits` holds the gradient, not the logits. Read anything you need from it (argmax, accuracy)
before calling. Accumulation is fp32 for fp32 and bf16 logits alike. With bf16 logits and
g != g0 the gradient is rounded twice (written, then scaled): at most one more bf16 step.
fp16 logits under a loss scaler: announce the scale in grad_scale, or small gradients written
for g0 = 1 underflow in fp16 before the backward scales them up.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without the kernels extra: the reference is used
    triton = None


def soft_ce_reference(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                      normaliser: torch.Tensor | float | None = None) -> torch.Tensor:
    """Plain torch: the same loss through log_softmax in fp32 (allocates [N, V] temporaries)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    row = -(target.float() * logp).sum(-1) * mask.float()  # [N]
    return row.sum() / _normaliser(mask, normaliser)


def _normaliser(mask: torch.Tensor, normaliser) -> torch.Tensor:
    if normaliser is None:
        return mask.float().sum().clamp(min=1.0)  # a tensor: no device sync
    return torch.as_tensor(normaliser, dtype=torch.float32, device=mask.device)


if triton is not None:

    @triton.jit
    def _soft_ce_kernel(z_ptr, p_ptr, mask_ptr, norm_ptr, loss_ptr, grad_scale, n_rows, z_stride, p_stride,
                        V: tl.constexpr, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr, WHOLE_ROW: tl.constexpr,
                        HOLD_P: tl.constexpr, EVICT: tl.constexpr):
        """Rows pid, pid + G, ...: the row loss, then (WRITE_GRAD) dL/dz over z in place."""
        coef0 = grad_scale / tl.load(norm_ptr)  # g0 / normaliser
        row = tl.program_id(0)
        while row < n_rows:
            keep = tl.load(mask_ptr + row).to(tl.float32)  # bool or float mask: 0 drops the row
            z_row = z_ptr + row.to(tl.int64) * z_stride
            p_row = p_ptr + row.to(tl.int64) * p_stride
            if WHOLE_ROW:
                _soft_ce_whole_row(z_row, p_row, loss_ptr + row, keep, coef0, V, BLOCK, WRITE_GRAD, HOLD_P)
            else:
                _soft_ce_chunked_row(z_row, p_row, loss_ptr + row, keep, coef0, V, BLOCK, WRITE_GRAD, EVICT)
            row += tl.num_programs(0)

    @triton.jit
    def _soft_ce_whole_row(z_row, p_row, loss_at, keep, coef0, V: tl.constexpr, BLOCK: tl.constexpr,
                           WRITE_GRAD: tl.constexpr, HOLD_P: tl.constexpr):
        """One row held in registers as a single [BLOCK >= V] tile: z is read from DRAM once and
        the gradient computed from the registers, so DRAM sees z once, p once (HOLD_P) or once
        plus an L2 re-read, and one write of the gradient, the least any in-place kernel can do."""
        cols = tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)  # [BLOCK]
        p = tl.load(p_row + cols, mask=inside, other=0.0, eviction_policy="evict_last").to(tl.float32)
        m = tl.max(z, axis=0)
        lse = m + tl.log(tl.sum(tl.exp(z - m), axis=0))
        s = tl.sum(p, axis=0)
        spz = tl.sum(p * tl.where(inside, z, 0.0), axis=0)  # no 0 * -inf on ragged lanes
        tl.store(loss_at, keep * (s * lse - spz))
        if WRITE_GRAD:
            if not HOLD_P:  # read again (from L2) rather than kept live beside z
                p = tl.load(p_row + cols, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32)
            grad = coef0 * keep * (s * tl.exp(z - lse) - p)  # a masked row gets 0 everywhere
            tl.store(z_row + cols, grad.to(z_row.dtype.element_ty), mask=inside)

    @triton.jit
    def _soft_ce_chunked_row(z_row, p_row, loss_at, keep, coef0, V: tl.constexpr, BLOCK: tl.constexpr,
                             WRITE_GRAD: tl.constexpr, EVICT: tl.constexpr):
        """One row in [BLOCK] chunks: pass 1 (its loss), then (WRITE_GRAD) pass 2 (its gradient)."""
        m = tl.full([], float("-inf"), tl.float32)  # running max
        d = tl.zeros([], tl.float32)  # running sum of exp(z - m)
        s = tl.zeros([], tl.float32)  # sum p
        spz = tl.zeros([], tl.float32)  # sum p * z
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            if EVICT:  # kept in L2 for pass 2
                z = tl.load(z_row + cols, mask=inside, other=float("-inf"), eviction_policy="evict_last")
                p = tl.load(p_row + cols, mask=inside, other=0.0, eviction_policy="evict_last")
            else:
                z = tl.load(z_row + cols, mask=inside, other=float("-inf"))
                p = tl.load(p_row + cols, mask=inside, other=0.0)
            z = z.to(tl.float32)
            p = p.to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))  # finite: every chunk holds a real column
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            s += tl.sum(p, axis=0)
            spz += tl.sum(p * tl.where(inside, z, 0.0), axis=0)  # no 0 * -inf on ragged lanes
        lse = m + tl.log(d)
        tl.store(loss_at, keep * (s * lse - spz))
        if WRITE_GRAD:
            coef = coef0 * keep  # a masked row gets 0 * (finite) = 0 everywhere
            for start in range(0, V, BLOCK):  # the same chunks again, now mostly from L2
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                if EVICT:  # read for the last time, and the gradient is not read again here
                    z = tl.load(z_row + cols, mask=inside, other=0.0, eviction_policy="evict_first")
                    p = tl.load(p_row + cols, mask=inside, other=0.0, eviction_policy="evict_first")
                else:
                    z = tl.load(z_row + cols, mask=inside, other=0.0)
                    p = tl.load(p_row + cols, mask=inside, other=0.0)
                grad = coef * (s * tl.exp(z.to(tl.float32) - lse) - p.to(tl.float32))
                if EVICT:
                    tl.store(z_row + cols, grad.to(z_row.dtype.element_ty), mask=inside, eviction_policy="evict_first")
                else:
                    tl.store(z_row + cols, grad.to(z_row.dtype.element_ty), mask=inside)

    @triton.jit
    def _rescale_kernel(z_ptr, upstream_ptr, grad_scale, n_rows, z_stride, V: tl.constexpr, BLOCK: tl.constexpr):
        """z *= g / g0 over every row, unless the ratio is 1 (then nothing is read or written)."""
        ratio = tl.load(upstream_ptr).to(tl.float32) / grad_scale
        if tl.abs(ratio - 1.0) > 1e-6:
            row = tl.program_id(0)
            while row < n_rows:
                z_row = z_ptr + row.to(tl.int64) * z_stride
                for start in range(0, V, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    inside = cols < V
                    z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
                    tl.store(z_row + cols, (z * ratio).to(z_ptr.dtype.element_ty), mask=inside)
                row += tl.num_programs(0)


@dataclass
class LaunchConfig:
    """How the kernel is launched for one layout of rows (see benchmarks/soft_ce_tuning.py)."""

    programs_per_sm: int  # persistent programs per SM: more hide more load latency, but share L2
    num_warps: int | None  # None: by BLOCK
    evict: bool = True  # chunked rows: L2 hints keep pass 1's reads for pass 2
    hold_p: bool = False  # whole rows: keep p in registers too instead of re-reading it from L2


# Rows of WHOLE_ROW_DTYPES no wider than WHOLE_ROW_MAX are one register tile (the draft vocab of
# 32000 is); others (bf16, or 49152, 151936 wide) go in chunks of CHUNK. The defaults below are
# the sweep's picks (benchmarks/soft_ce_tuning.py; the figures are in docs/LOG.md);
# soft_target_cross_entropy's `launch` and `whole_row` override them per call:
WHOLE_ROW_MAX = 32768
WHOLE_ROW_DTYPES = (torch.float32,)
CHUNK = 8192
WHOLE = LaunchConfig(programs_per_sm=2, num_warps=8)
CHUNKED = LaunchConfig(programs_per_sm=4, num_warps=8)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _warps_by_block(block: int) -> int:
    """Warps for a [BLOCK] tile when the launch config names none: wider tiles, more warps."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _launch_config(z: torch.Tensor, block: int | None, launch: LaunchConfig | None = None,
                   whole_row: bool | None = None) -> tuple[tuple[int], int, int, bool, LaunchConfig]:
    """(grid, BLOCK, num_warps, whole_row, config) for logits z [N, V]. block: force chunks of
    that width (tests); the default holds an fp32 row in registers where it fits. whole_row:
    force (True, V <= WHOLE_ROW_MAX) or forbid whole rows whatever the dtype; launch: the
    LaunchConfig to use instead of WHOLE / CHUNKED."""
    n, v = z.shape
    fits = block is None and triton.next_power_of_2(v) <= WHOLE_ROW_MAX
    whole = fits and (z.dtype in WHOLE_ROW_DTYPES if whole_row is None else whole_row)
    block = triton.next_power_of_2(v) if whole else block or min(triton.next_power_of_2(v), CHUNK)
    config = launch or (WHOLE if whole else CHUNKED)
    warps = config.num_warps or _warps_by_block(block)
    if z.device.type == "cuda":
        programs = _sm_count(z.device.index if z.device.index is not None else torch.cuda.current_device()) \
            * config.programs_per_sm
    else:
        programs = 5  # the CPU interpreter: few programs, so the tests take the rows-per-program loop too
    return (max(1, min(n, programs)),), block, warps, whole, config


class SoftTargetCrossEntropy(torch.autograd.Function):
    """autograd.Function over the two kernels; see the module docstring (logits are consumed)."""

    @staticmethod
    def forward(ctx, logits, target, mask, normaliser, block=None, grad_scale=1.0, write_grad=True, launch=None,
                whole_row=None):
        assert logits.shape == target.shape and logits.dim() == 2, (logits.shape, target.shape)
        assert logits.stride(-1) == 1 and target.stride(-1) == 1, "last dim must be contiguous"
        n, v = logits.shape
        row_loss = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        norm = _normaliser(mask, normaliser)  # a 0-d device tensor: no sync
        grid, blk, warps, whole, config = _launch_config(logits, block, launch, whole_row)
        if n:
            _soft_ce_kernel[grid](logits, target, mask.contiguous(), norm, row_loss, grad_scale, n, logits.stride(0),
                                  target.stride(0), v, BLOCK=blk, WRITE_GRAD=write_grad, WHOLE_ROW=whole,
                                  HOLD_P=config.hold_p, EVICT=config.evict, num_warps=warps)
        ctx.save_for_backward(logits)
        ctx.block, ctx.grad_scale, ctx.wrote_grad = block, grad_scale, write_grad
        ctx.launch, ctx.whole_row = launch, whole_row
        return row_loss.sum() / norm

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors  # the logits buffer, holding dL/dz for grad_scale
        if not ctx.wrote_grad:
            raise RuntimeError("soft_target_cross_entropy: backward through a loss computed with "
                               "write_grad=False")
        n, v = grad.shape
        grid, _, _, _, _ = _launch_config(grad, ctx.block, ctx.launch, ctx.whole_row)
        block = min(triton.next_power_of_2(v), CHUNK)
        if n:  # the ratio g / g0 is read on the device: no sync
            _rescale_kernel[grid](grad, grad_output, ctx.grad_scale, n, grad.stride(0), v, BLOCK=block,
                                  num_warps=_warps_by_block(block))
        return grad, None, None, None, None, None, None, None, None


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1, tests only)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def soft_target_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                              normaliser: torch.Tensor | float | None = None, impl: str = "auto",
                              block: int | None = None, grad_scale: float = 1.0, *,
                              launch: LaunchConfig | None = None, whole_row: bool | None = None) -> torch.Tensor:
    """The masked soft-target CE. impl: "triton" (in place: the forward consumes logits),
    "reference", or "auto" (triton where it can run, else reference). grad_scale: the upstream
    gradient the caller expects to send back into this loss (e.g. its weight in a sum); any
    other is still right, at the cost of one more pass over the logits. launch, whole_row: the
    kernel's launch settings (default: WHOLE or CHUNKED by the row layout; see _launch_config)."""
    if impl == "auto":
        impl = "triton" if triton_available(logits.device) else "reference"
    if impl == "reference":
        return soft_ce_reference(logits, target, mask, normaliser)
    if impl != "triton":
        raise ValueError(f"unknown loss impl {impl!r}: choose triton, reference or auto")
    write_grad = logits.requires_grad and torch.is_grad_enabled()  # no gradient pass in evaluation
    if write_grad and not (math.isfinite(grad_scale) and grad_scale > 0):
        # the forward writes dL/dz for grad_scale and the backward divides by it: 0 would leave
        # a zero gradient no upstream gradient could scale back
        raise ValueError(f"soft_target_cross_entropy: grad_scale must be a positive finite number, got {grad_scale}")
    return SoftTargetCrossEntropy.apply(logits, target, mask, normaliser, block, float(grad_scale), write_grad,
                                        launch, whole_row)
