"""Losses on the acceptance rate itself (LK losses, Samarin et al., arXiv 2602.23881), with the
gradient written into the logits buffer, as soft_ce.py does: no second [N, V] buffer.

Per row: draft logits z [V] over the draft vocabulary, q = softmax(z); the teacher's
probabilities p [V] of the same tokens, taken from the teacher's FULL softmax, so s = sum_v p_v <= 1
and the teacher mass 1 - s outside the draft vocabulary, which the draft can never propose, can
never be accepted. The acceptance rate of one speculative step at this position is

    alpha = sum_v min(p_v, q_v)          (1 - alpha is TV(p, q) over the target vocabulary)

and the token losses are

    tv         1 - alpha
    lk-alpha   -log alpha                (at a point-mass teacher p = e_y: -log q_y, cross-entropy)
    lk-lambda  lam * KL(p^ || q) + (1 - lam) * (1 - alpha),   lam = kl_scale * exp(-kl_decay * sg(alpha))

with p^ = p / s (the teacher renormalised over the draft vocabulary, the target today's
cross-entropy uses) and sg the stop-gradient: lam is a per-position weight, KL's strong gradient
while the draft is far from the teacher, TV's acceptance-optimal one once it is close.

Gradients. With I_v = [q_v < p_v] (where min takes q; ties take p, a subgradient) and
A = sum_v I_v q_v:
    d alpha / d z_j = sum_v I_v q_v (delta_vj - q_j) = q_j (I_j - A)
    d tv / d z_j    = -q_j (I_j - A)
    d lk-alpha      = -q_j (I_j - A) / alpha
    d KL / d z_j    = q_j - p^_j
    d lk-lambda     = lam (q_j - p^_j) - (1 - lam) q_j (I_j - A)
KL's value is sum p^ log p^ - sum p^ log q = (sum_v p_v log p_v) / s - log s - (sum_v p_v z_v) / s + lse.

The kernel takes a row in chunks of BLOCK columns, three passes, each after the first mostly from
L2: (1) lse by an online max / sum-exp, s, and for LK-lambda sum p z and sum p log p; (2) alpha and A from
q = exp(z - lse); (3) the gradient, over z. The row losses and alphas are stored ([N] fp32 each).
alpha is clamped at ALPHA_FLOOR in lk-alpha's log and division (a row where the teacher's mass
lies entirely outside the draft vocabulary has alpha = 0; the trainers mask such rows anyway).

THE LOGITS BUFFER IS CONSUMED BY THE FORWARD, as in soft_ce.py, and the gradient is written for
the announced upstream gradient `grad_scale` (rescaled in the backward if another one comes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specfoundry.kernels.soft_ce import (
    _launch_config,
    _normaliser,
    soft_target_cross_entropy,
    triton_available,
)

try:
    import triton
    import triton.language as tl

    from specfoundry.kernels.soft_ce import _rescale_kernel
except ImportError:  # a CPU-only install without the kernels extra: the reference is used
    triton = None

TOKEN_LOSSES = ("ce", "lk-alpha", "lk-lambda", "tv")
MODES = {"tv": 0, "lk-alpha": 1, "lk-lambda": 2}
ALPHA_FLOOR = 1e-12
LK_CHUNK = 4096  # columns per chunk: three passes over a row's chunks stay in L2


@dataclass(frozen=True)
class TokenLoss:
    """A family's per-token loss: `kind` one of TOKEN_LOSSES; kl_scale and kl_decay are LK-lambda's."""

    kind: str = "ce"
    kl_scale: float = 1.0
    kl_decay: float = 3.0

    def __post_init__(self):
        if self.kind not in TOKEN_LOSSES:
            raise ValueError(f"unknown token loss {self.kind!r}: choose one of {', '.join(TOKEN_LOSSES)}")

    @property
    def renormalised_teacher(self) -> bool:
        """Cross-entropy learns the teacher renormalised over the draft vocabulary (as always); the
        LK losses take its full-softmax probabilities, the mass outside never accepted."""
        return self.kind == "ce"

    def __call__(self, logits, target, mask, normaliser=None, *, impl: str = "auto", grad_scale: float = 1.0):
        return token_loss(logits, target, mask, normaliser, loss=self.kind, kl_scale=self.kl_scale,
                          kl_decay=self.kl_decay, impl=impl, grad_scale=grad_scale)


# ---- the plain torch reference ---------------------------------------------------------------------

def lk_rows_reference(logits: torch.Tensor, target: torch.Tensor, loss: str, kl_scale: float = 1.0,
                      kl_decay: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(row losses [N], alpha [N]) in fp32 through autograd (allocates [N, V] temporaries)."""
    q = torch.softmax(logits.float(), dim=-1)  # [N, V]
    p = target.float()
    alpha = torch.minimum(p, q).sum(-1)  # [N]
    if loss == "tv":
        return 1 - alpha, alpha.detach()
    if loss == "lk-alpha":
        return -torch.log(alpha.clamp(min=ALPHA_FLOOR)), alpha.detach()
    if loss != "lk-lambda":
        raise ValueError(f"unknown LK loss {loss!r}: choose one of {', '.join(MODES)}")
    s = p.sum(-1, keepdim=True).clamp(min=ALPHA_FLOOR)
    p_hat = p / s
    logq = torch.log_softmax(logits.float(), dim=-1)
    kl = (torch.xlogy(p_hat, p_hat) - p_hat * logq).sum(-1)
    lam = kl_scale * torch.exp(-kl_decay * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha), alpha.detach()


def lk_loss_reference(logits, target, mask, normaliser=None, loss: str = "lk-alpha", kl_scale: float = 1.0,
                      kl_decay: float = 3.0) -> torch.Tensor:
    rows, _ = lk_rows_reference(logits, target, loss, kl_scale, kl_decay)
    return (rows * mask.float()).sum() / _normaliser(mask, normaliser)


# ---- the kernel ------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _lk_kernel(z_ptr, p_ptr, mask_ptr, norm_ptr, loss_ptr, alpha_ptr, grad_scale, kl_scale, kl_decay, n_rows,
                   z_stride, p_stride, V: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
                   WRITE_GRAD: tl.constexpr):
        """Rows pid, pid + G, ...: the row's loss and alpha, then (WRITE_GRAD) dL/dz over z."""
        coef0 = grad_scale / tl.load(norm_ptr)
        row = tl.program_id(0)
        while row < n_rows:
            keep = tl.load(mask_ptr + row).to(tl.float32)
            z_row = z_ptr + row.to(tl.int64) * z_stride
            p_row = p_ptr + row.to(tl.int64) * p_stride
            # pass 1: lse (online), s, sum p z, sum p log p
            m = tl.full([], float("-inf"), tl.float32)
            d = tl.zeros([], tl.float32)
            s = tl.zeros([], tl.float32)
            spz = tl.zeros([], tl.float32)
            splogp = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
                m_new = tl.maximum(m, tl.max(z, axis=0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
                m = m_new
                s += tl.sum(p, axis=0)
                if MODE == 2:  # KL's terms: LK-lambda alone needs them (a log per element)
                    spz += tl.sum(p * tl.where(inside, z, 0.0), axis=0)
                    splogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), axis=0)
            lse = m + tl.log(d)
            # pass 2: alpha = sum min(p, q), A = sum_{q < p} q
            alpha = tl.zeros([], tl.float32)
            a_mass = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
                q = tl.exp(z - lse)  # 0 on ragged lanes
                alpha += tl.sum(tl.minimum(p, q), axis=0)
                a_mass += tl.sum(tl.where(q < p, q, 0.0), axis=0)
            floor = tl.maximum(alpha, 1e-12)
            s_safe = tl.maximum(s, 1e-12)
            lam = 0.0
            if MODE == 0:
                row_loss = 1.0 - alpha
            elif MODE == 1:
                row_loss = -tl.log(floor)
            else:
                lam = kl_scale * tl.exp(-kl_decay * alpha)
                kl = splogp / s_safe - tl.log(s_safe) - spz / s_safe + lse
                row_loss = lam * kl + (1.0 - lam) * (1.0 - alpha)
            tl.store(loss_ptr + row, keep * row_loss)
            tl.store(alpha_ptr + row, alpha)
            if WRITE_GRAD:  # pass 3
                coef = coef0 * keep
                for start in range(0, V, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    inside = cols < V
                    z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                    p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
                    q = tl.exp(z - lse)
                    dalpha = q * (tl.where(q < p, 1.0, 0.0) - a_mass)  # d alpha / dz
                    if MODE == 0:
                        grad = -dalpha
                    elif MODE == 1:
                        grad = -dalpha / floor
                    else:
                        grad = lam * (q - p / s_safe) - (1.0 - lam) * dalpha
                    tl.store(z_row + cols, (coef * grad).to(z_row.dtype.element_ty), mask=inside)
            row += tl.num_programs(0)


class LKLoss(torch.autograd.Function):
    """autograd.Function over the kernel; see the module docstring (logits are consumed)."""

    @staticmethod
    def forward(ctx, logits, target, mask, normaliser, loss, kl_scale, kl_decay, grad_scale, write_grad, block):
        assert logits.shape == target.shape and logits.dim() == 2, (logits.shape, target.shape)
        assert logits.stride(-1) == 1 and target.stride(-1) == 1, "last dim must be contiguous"
        n, v = logits.shape
        row_loss = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        alpha = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        norm = _normaliser(mask, normaliser)
        grid, _, warps, _, _ = _launch_config(logits, block, whole_row=False)
        blk = block or min(triton.next_power_of_2(v), LK_CHUNK)
        if n:
            _lk_kernel[grid](logits, target, mask.contiguous(), norm, row_loss, alpha, grad_scale, kl_scale, kl_decay,
                             n, logits.stride(0), target.stride(0), v, BLOCK=blk, MODE=MODES[loss],
                             WRITE_GRAD=write_grad, num_warps=warps)
        ctx.save_for_backward(logits)
        ctx.grad_scale, ctx.wrote_grad, ctx.block = grad_scale, write_grad, blk
        ctx.mark_non_differentiable(alpha, row_loss)
        return row_loss.sum() / norm, alpha, row_loss

    @staticmethod
    def backward(ctx, grad_output, _grad_alpha, _grad_rows):
        (grad,) = ctx.saved_tensors  # the logits buffer, holding dL/dz for grad_scale
        if not ctx.wrote_grad:
            raise RuntimeError("lk_loss: backward through a loss computed without its gradient")
        n, v = grad.shape
        if n:
            grid, _, warps, _, _ = _launch_config(grad, ctx.block, whole_row=False)
            _rescale_kernel[grid](grad, grad_output, ctx.grad_scale, n, grad.stride(0), v, BLOCK=ctx.block,
                                  num_warps=warps)
        return grad, None, None, None, None, None, None, None, None, None


def lk_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, normaliser=None, *,
            loss: str = "lk-alpha", kl_scale: float = 1.0, kl_decay: float = 3.0, impl: str = "auto",
            grad_scale: float = 1.0, block: int | None = None, rows: bool = False) -> tuple:
    """(the masked mean LK `loss`, alpha [N] detached), and with `rows` the rows' losses [N] fp32
    (detached, times the mask's weight). impl: triton (in place: consumes logits), reference, or
    auto. grad_scale: the upstream gradient announced, as soft_target_cross_entropy's."""
    if loss not in MODES:
        raise ValueError(f"unknown LK loss {loss!r}: choose one of {', '.join(MODES)}")
    if impl == "auto":
        impl = "triton" if triton_available(logits.device) else "reference"
    if impl == "reference":
        row_loss, alpha = lk_rows_reference(logits, target, loss, kl_scale, kl_decay)
        row_loss = row_loss * mask.float()
        out = row_loss.sum() / _normaliser(mask, normaliser), alpha
        return (*out, row_loss.detach()) if rows else out
    if impl != "triton":
        raise ValueError(f"unknown loss impl {impl!r}: choose triton, reference or auto")
    write_grad = logits.requires_grad and torch.is_grad_enabled()
    if write_grad and not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"lk_loss: grad_scale must be a positive finite number, got {grad_scale}")
    value, alpha, row_loss = LKLoss.apply(logits, target, mask, normaliser, loss, float(kl_scale), float(kl_decay),
                                          float(grad_scale), write_grad, block)
    return (value, alpha, row_loss) if rows else (value, alpha)


def token_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, normaliser=None, *, loss: str = "ce",
               kl_scale: float = 1.0, kl_decay: float = 3.0, impl: str = "auto",
               grad_scale: float = 1.0) -> torch.Tensor:
    """The trainers' one entry: `loss` ce (soft-target cross-entropy against `target`, as
    soft_target_cross_entropy) or an LK loss (`target`: the teacher's full-softmax probabilities
    of the draft vocabulary). Logits are consumed by the in-place kernels."""
    if loss == "ce":
        return soft_target_cross_entropy(logits, target, mask, normaliser, impl=impl, grad_scale=grad_scale)
    return lk_loss(logits, target, mask, normaliser, loss=loss, kl_scale=kl_scale, kl_decay=kl_decay, impl=impl,
                   grad_scale=grad_scale)[0]
