"""The LK losses' in-place kernel (kernels/lk_loss.py) against its plain torch reference's autograd.

On CPU the kernel runs under TRITON_INTERPRET=1 (conftest); block=16 makes small rows take several
chunks, as a real 32k row does.

Tolerances. The kernel and the reference compute the same fp32 sums over a row in another order:
each of lse, s, alpha and A, a sum of V terms of magnitude <= 1 (or of |z| for lse's argument),
is off by at most V * u (u = 2^-24) of its scale, and the loss and every gradient element are
O(1) combinations of them. 8 * V * u bounds that with margin; a wrong mask, chunk or sign is off
by O(1 / V) or more. bf16 logits: the gradient is stored in bf16, one rounding: half an ulp
(2^-8 relative) on a GPU, a whole ulp (2^-7) under Triton's CPU interpreter, which truncates.
"""

from __future__ import annotations

import pytest
import torch

from specfoundry.kernels.lk_loss import lk_loss, lk_loss_reference, lk_rows_reference, token_loss
from specfoundry.kernels.soft_ce import soft_ce_reference

U32 = 2.0 ** -24
ULP_BF16 = 2.0 ** -7  # one bf16 ulp, relative
LOSSES = ["tv", "lk-alpha", "lk-lambda"]


def case(n: int, v: int, *, seed: int = 0, outside: int = 5, sharp: float = 2.0):
    """Draft logits [n, v] and the teacher's full-softmax probabilities of those v tokens (the
    teacher has `outside` more tokens, so each row's mass s is below 1)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * sharp
    p = torch.softmax(torch.randn(n, v + outside, generator=g) * sharp, -1)[:, :v].contiguous()
    mask = torch.rand(n, generator=g) > 0.2
    mask[0] = True
    return z, p, mask


def both(z, p, mask, loss, dtype=torch.float32, grad_scale=1.0, upstream=1.0, **kw):
    """(kernel loss, kernel grad, reference loss, reference grad, kernel alpha)."""
    zr = z.to(dtype).float().clone().requires_grad_()
    ref = lk_loss_reference(zr, p.to(dtype).float(), mask, loss=loss, **kw)
    (ref * upstream).backward()
    zk = z.to(dtype).clone().requires_grad_()
    logits = zk * 1  # the buffer the kernel consumes
    out, alpha = lk_loss(logits, p.to(dtype), mask, loss=loss, impl="triton", block=16, grad_scale=grad_scale, **kw)
    (out * upstream).backward()
    return out, zk.grad, ref, zr.grad, alpha


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("n,v", [(1, 16), (7, 37), (5, 100), (3, 513)])
def test_kernel_equals_reference_autograd_in_fp32(loss, n, v):
    z, p, mask = case(n, v)
    out, grad, ref, ref_grad, alpha = both(z, p, mask, loss)
    tol = 8 * v * U32
    torch.testing.assert_close(out, ref, rtol=0, atol=tol * max(1.0, ref.abs().item()))
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=tol)
    torch.testing.assert_close(alpha, torch.minimum(p, torch.softmax(z, -1)).sum(-1), rtol=0, atol=tol)
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))  # masked rows learn nothing


@pytest.mark.parametrize("loss", LOSSES)
def test_kernel_equals_reference_with_bf16_logits(loss):
    z, p, mask = case(6, 77, seed=1)
    out, grad, ref, ref_grad, _ = both(z, p, mask, loss, dtype=torch.bfloat16)
    assert grad.dtype == torch.bfloat16
    tol = 8 * 77 * U32
    torch.testing.assert_close(out, ref, rtol=0, atol=tol * max(1.0, ref.abs().item()))
    torch.testing.assert_close(grad.float(), ref_grad, rtol=ULP_BF16, atol=tol)


@pytest.mark.parametrize("loss", LOSSES)
def test_another_upstream_gradient_than_announced_is_rescaled(loss):
    z, p, mask = case(4, 40, seed=2)
    _, grad, _, ref_grad, _ = both(z, p, mask, loss, grad_scale=0.8, upstream=0.3)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=8 * 40 * U32)


@pytest.mark.parametrize("loss", LOSSES)
def test_rows_with_alpha_near_zero_and_near_one(loss):
    """alpha ~ 0: the teacher's mass sits where the draft puts almost none; alpha ~ 1: the draft
    nearly equals the teacher (s = 1; 1% apart, so that which of p and q is smaller at each token
    is not decided by rounding: at alpha = 1 exactly TV has a kink and any subgradient is right).
    The gradient stays finite and equals the reference's."""
    v = 40
    z = torch.full((2, v), -30.0)
    z[0, 0] = 30.0  # q = e_0
    p = torch.zeros(2, v)
    p[0, 1] = 1.0  # p = e_1: alpha = q_1 ~ e^-60
    p[1] = torch.softmax(torch.randn(v, generator=torch.Generator().manual_seed(3)), -1)
    z[1] = torch.log(p[1]) + 0.01 * torch.randn(v, generator=torch.Generator().manual_seed(4))  # q ~ p
    mask = torch.ones(2, dtype=torch.bool)
    out, grad, ref, ref_grad, alpha = both(z, p, mask, loss)
    assert alpha[0] < 1e-20 and 0.99 < alpha[1] < 1
    assert torch.isfinite(grad).all() and torch.isfinite(out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=8 * v * U32)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=8 * v * U32)


def test_lk_alpha_at_a_point_mass_teacher_is_cross_entropy():
    z, _, mask = case(5, 33, seed=4)
    y = torch.randint(0, 33, (5,), generator=torch.Generator().manual_seed(5))
    p = torch.nn.functional.one_hot(y, 33).float()
    out, grad, _, _, _ = both(z, p, mask, "lk-alpha")
    zc = z.clone().requires_grad_()
    ce = soft_ce_reference(zc, p, mask)
    ce.backward()
    torch.testing.assert_close(out, ce, rtol=0, atol=8 * 33 * U32)
    torch.testing.assert_close(grad, zc.grad, rtol=0, atol=8 * 33 * U32)


def test_lk_lambda_is_kl_far_away_and_tv_close():
    """lam = kl_scale * exp(-kl_decay * alpha): kl_decay 0 and kl_scale 1 make it KL alone (whose
    gradient is cross-entropy's against the renormalised teacher), kl_scale 0 makes it TV."""
    z, p, mask = case(4, 30, seed=6)
    kl, _ = lk_rows_reference(z, p, "lk-lambda", kl_scale=1.0, kl_decay=0.0)
    tv, _ = lk_rows_reference(z, p, "tv")
    only_tv, _ = lk_rows_reference(z, p, "lk-lambda", kl_scale=0.0)
    torch.testing.assert_close(only_tv, tv)
    p_hat = p / p.sum(-1, keepdim=True)
    want = (torch.xlogy(p_hat, p_hat) - p_hat * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(kl, want)


def test_token_loss_ce_is_todays_soft_cross_entropy_and_unknown_names_are_refused():
    z, p, mask = case(3, 20, seed=7)
    p_hat = p / p.sum(-1, keepdim=True)
    torch.testing.assert_close(token_loss(z.clone(), p_hat, mask, loss="ce", impl="reference"),
                               soft_ce_reference(z, p_hat, mask))
    with pytest.raises(ValueError, match="unknown LK loss 'kl'"):
        token_loss(z.clone(), p, mask, loss="kl")
