"""Masked soft-target cross entropy whose backward writes the gradient into the logits buffer.

For logits z [N, V], a target distribution p [N, V] (rows need not sum to 1) and a row mask
m [N], the loss is

    L = (1 / normaliser) * sum_r m_r * l_r,     l_r = -sum_v p_rv * log softmax(z_r)_v

where the caller chooses `normaliser` (the trainer passes the number of valid positions, so L
is the mean over valid positions; default: the number of masked-in rows, at least 1).

Math per row (dropping r). With lse = log sum_v exp(z_v) and s = sum_v p_v:
    l = -sum_v p_v (z_v - lse) = s * lse - sum_v p_v z_v
    dl/dz_v = s * softmax(z)_v - p_v
so with the upstream gradient g: dL/dz_v = g * m / normaliser * (s * exp(z_v - lse) - p_v).

Forward (one program per row, V in chunks): an online max / sum-exp gives lse without storing
exp(z) (m' = max(m, max chunk); d = d * exp(m - m') + sum exp(chunk - m')), while s and sum p*z
accumulate alongside; it stores l, lse and s per row ([N] fp32 each).
Backward: reads z and p again chunk by chunk and overwrites z with dL/dz in its own dtype. No
second [N, V] buffer is ever allocated (the SpecForge paper's Algorithm 3).

THE LOGITS BUFFER IS CONSUMED: after backward, the tensor passed as `logits` holds the
gradient, not the logits. Read anything you need from it (argmax, accuracy) before backward.
Accumulation is fp32 for fp32 and bf16 logits alike.
"""

from __future__ import annotations

import os

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
    def _soft_ce_forward_kernel(z_ptr, p_ptr, mask_ptr, loss_ptr, lse_ptr, psum_ptr,
                                z_stride, p_stride, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * z_stride
        p_row = p_ptr + row * p_stride
        m = tl.full([], float("-inf"), tl.float32)  # running max
        d = tl.zeros([], tl.float32)  # running sum of exp(z - m)
        s = tl.zeros([], tl.float32)  # sum p
        spz = tl.zeros([], tl.float32)  # sum p * z
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))  # finite: every chunk holds a real column
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            s += tl.sum(p, axis=0)
            spz += tl.sum(p * tl.where(inside, z, 0.0), axis=0)  # no 0 * -inf on ragged lanes
        lse = m + tl.log(d)
        keep = tl.load(mask_ptr + row)
        tl.store(loss_ptr + row, keep * (s * lse - spz))
        tl.store(lse_ptr + row, lse)
        tl.store(psum_ptr + row, s)

    @triton.jit
    def _soft_ce_backward_kernel(z_ptr, p_ptr, mask_ptr, lse_ptr, psum_ptr, scale_ptr,
                                 z_stride, p_stride, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * z_stride
        p_row = p_ptr + row * p_stride
        # g * m_r / normaliser; a masked row gets 0 * (finite) = 0 everywhere
        coef = tl.load(scale_ptr) * tl.load(mask_ptr + row)
        lse = tl.load(lse_ptr + row)
        s = tl.load(psum_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            grad = coef * (s * tl.exp(z - lse) - p)
            tl.store(z_row + cols, grad.to(z_ptr.dtype.element_ty), mask=inside)


def _launch_config(V: int, block: int | None) -> tuple[int, int]:
    block = block or min(triton.next_power_of_2(V), 8192)
    return block, (16 if block >= 8192 else 8 if block >= 2048 else 4)


class SoftTargetCrossEntropy(torch.autograd.Function):
    """autograd.Function over the two kernels; see the module docstring (logits are consumed)."""

    @staticmethod
    def forward(ctx, logits, target, mask, normaliser, block=None):
        assert logits.shape == target.shape and logits.dim() == 2, (logits.shape, target.shape)
        assert logits.stride(-1) == 1 and target.stride(-1) == 1, "last dim must be contiguous"
        n, v = logits.shape
        maskf = mask.to(torch.float32).contiguous()  # [N]
        row_loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(row_loss)
        psum = torch.empty_like(row_loss)
        blk, warps = _launch_config(v, block)
        if n:
            _soft_ce_forward_kernel[(n,)](logits, target, maskf, row_loss, lse, psum,
                                          logits.stride(0), target.stride(0), v, BLOCK=blk, num_warps=warps)
        norm = _normaliser(mask, normaliser)
        ctx.save_for_backward(logits, target, maskf, lse, psum, norm)
        ctx.block = block
        return row_loss.sum() / norm

    @staticmethod
    def backward(ctx, grad_output):
        logits, target, maskf, lse, psum, norm = ctx.saved_tensors
        n, v = logits.shape
        scale = (grad_output.float() / norm).reshape(1)  # stays on device: no sync
        blk, warps = _launch_config(v, ctx.block)
        if n:
            _soft_ce_backward_kernel[(n,)](logits, target, maskf, lse, psum, scale,
                                           logits.stride(0), target.stride(0), v, BLOCK=blk, num_warps=warps)
        return logits, None, None, None, None


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1, tests only)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def soft_target_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                              normaliser: torch.Tensor | float | None = None, impl: str = "auto",
                              block: int | None = None) -> torch.Tensor:
    """The masked soft-target CE. impl: "triton" (in place, consumes logits), "reference", or
    "auto" (triton where it can run, else reference)."""
    if impl == "auto":
        impl = "triton" if triton_available(logits.device) else "reference"
    if impl == "reference":
        return soft_ce_reference(logits, target, mask, normaliser)
    if impl != "triton":
        raise ValueError(f"unknown loss impl {impl!r}: choose triton, reference or auto")
    return SoftTargetCrossEntropy.apply(logits, target, mask, normaliser, block)
