"""masked_sdpa against attention written out (scores, mask, softmax, weighted sum), forward and
gradients; on the GPU, that no call reaches cuDNN's attention."""

from __future__ import annotations

import pytest
import torch

from specfoundry.kernels.masked_sdpa import masked_sdpa

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference(q, k, v, mask, scale=None):
    """Plain attention in float64: query head h reads KV head h // (Hq / Hkv)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, -1) @ v


def random_mask(b, t, length, generator):
    """[B, 1, T, L] bool with at least one key per row (a row over nothing has no softmax)."""
    mask = torch.rand(b, 1, t, length, generator=generator) < 0.6
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,t,length,d", [(1, 4, 4, 5, 5, 16), (2, 9, 3, 7, 21, 64), (3, 8, 2, 33, 99, 32),
                                                (2, 6, 1, 16, 48, 64)])
def test_equals_attention_written_out(device, masked, dtype, b, hq, hkv, t, length, d):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(b * 100 + t)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, t), (hkv, length), (hkv, length)))
    mask = random_mask(b, t, length, g) if masked else None
    grad_out = torch.randn(b, hq, t, d, generator=g)
    want = reference(q, k, v, mask)
    qd, kd, vd = (x.to(device, dtype, copy=True).requires_grad_() for x in (q, k, v))
    out = masked_sdpa(qd, kd, vd, mask.to(device) if masked else None)
    out.backward(grad_out.to(device, dtype))
    # float32: the kernels' sums of at most L = 99 products in float32 (unit roundoff 6e-8 times L
    # and the values' scale, ~1e-5); bfloat16: the inputs themselves round to 8 bits (2^-8 = 4e-3
    # relative), through a softmax and a weighted sum of O(1) values, so 3e-2 absolute
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    reference(q64, k64, v64, mask).backward(grad_out.double())
    for got, ref in ((qd.grad, q64.grad), (kd.grad, k64.grad), (vd.grad, v64.grad)):
        torch.testing.assert_close(got.double().cpu(), ref, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_no_call_reaches_cudnn_attention_at_any_shape():
    """Batches of new widths, as training meets them, with grouped KV heads (the case where torch
    would otherwise pick cuDNN, which builds a plan on the host for every new shape)."""
    from torch.profiler import ProfilerActivity, profile

    names = set()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for t in (64, 96, 200, 333):
            q = torch.randn(2, 9, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, 3, 2 * t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            mask = torch.ones(2, 1, t, 2 * t, dtype=torch.bool, device="cuda").tril(t)
            masked_sdpa(q, k, v, mask).sum().backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    assert any("efficient_attention" in n for n in names), sorted(n for n in names if "attention" in n)
