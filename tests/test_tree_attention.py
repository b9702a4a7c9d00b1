"""The TTT tree mask and attention against references written independently."""

from __future__ import annotations

import pytest
import torch

from specfoundry.kernels.tree_attention import (
    BLOCK_MASKS,
    dense_ttt_mask,
    eager_tree_attention,
    tree_attention,
    ttt_block_mask,
)


def loop_mask(lengths, seq_len, step):
    """The rule spelled out with plain loops: [B, T, T*(step+1)] bool."""
    out = torch.zeros(len(lengths), seq_len, seq_len * (step + 1), dtype=torch.bool)
    for b, n in enumerate(lengths):
        for i in range(seq_len):
            for block in range(step + 1):
                for j in range(seq_len):
                    if j >= n:
                        continue  # padding keys are never seen
                    if block == 0 and j <= i or block > 0 and j == i:
                        out[b, i, block * seq_len + j] = True
    return out


@pytest.mark.parametrize("lengths,seq_len,step", [
    ([5], 5, 0), ([5], 5, 3), ([3, 5], 5, 2), ([1, 7, 4], 7, 6), ([16, 9], 16, 1), ([130, 70], 130, 2),
])
def test_mask_equals_loop_reference(lengths, seq_len, step):
    dense = dense_ttt_mask(lengths, seq_len, step, "cpu")[:, 0]
    assert torch.equal(dense, loop_mask(lengths, seq_len, step))
    block = ttt_block_mask(lengths, seq_len, step, "cpu").to_dense()  # [B, 1, nq, nkv] block occupancy
    blk = 128
    for b in range(len(lengths)):
        for qb in range(block.shape[2]):
            for kb in range(block.shape[3]):
                tile = dense[b, qb * blk:(qb + 1) * blk, kb * blk:(kb + 1) * blk]
                assert bool(block[b, 0, qb, kb]) == bool(tile.any()), (b, qb, kb)


def test_hand_checked_tree():
    """A 4-token prefix [p0..p3] with two TTT steps after it ([a*] and [b*]); node (step t, i) is
    the draft's t-th guess on the branch rooted at position i. Each node sees the prefix up to
    its root and its own ancestors on its branch, never a sibling branch. The last row has
    length 3, so p3 (and its branch) is padding there."""
    expected = torch.tensor([
        # p0 p1 p2 p3  a0 a1 a2 a3  b0 b1 b2 b3
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],  # b0: prefix p0, ancestor a0, itself b0
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],  # b1
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],  # b2
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],  # b3
    ], dtype=torch.bool)
    assert torch.equal(dense_ttt_mask([4], 4, 2, "cpu")[0, 0], expected)
    padded = expected.clone()
    padded[:, [3, 7, 11]] = False
    assert torch.equal(dense_ttt_mask([3], 4, 2, "cpu")[0, 0], padded)


def test_block_masks_are_cached_per_shape():
    BLOCK_MASKS.entries.clear()
    a = ttt_block_mask([6, 4], 8, 2, "cpu")
    assert ttt_block_mask((6, 4), 8, 2, "cpu") is a
    assert ttt_block_mask([6, 4], 8, 3, "cpu") is not a
    assert len(BLOCK_MASKS.entries) == 2


def reference_attention(q, k, v, lengths, step):
    """float64 softmax attention under the loop mask, GQA by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~loop_mask(lengths, q.shape[2], step)[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_cpu_attention_and_gradients_match_reference(hq, hkv, impl):
    lengths, seq_len, step, d = [9, 6], 9, 3, 8
    q = torch.randn(2, hq, seq_len, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, seq_len * (step + 1), d, dtype=torch.float64, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    fn = eager_tree_attention if impl == "eager" else lambda *a: tree_attention(*a, backend="sdpa")
    out = fn(q, k, v, lengths, step)
    ref = reference_attention(q, k, v, lengths, step)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len,step,lengths", [(512, 6, [512, 300]), (1000, 3, [1000, 999]), (4096, 6, [4096])])
def test_flex_matches_sdpa_on_gpu(seq_len, step, lengths):
    torch.manual_seed(0)
    b, hq, hkv, d = len(lengths), 32, 8, 128
    q = torch.randn(b, hq, seq_len, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, seq_len * (step + 1), d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = tree_attention(q, k, v, lengths, step, backend="flex")
    ref = tree_attention(q.float(), k.float(), v.float(), lengths, step, backend="sdpa")
    # bf16 inputs, fp32 accumulation in both; outputs are rounded to bf16 (2^-8 relative)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    up = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), up)
    r = torch.autograd.grad(ref, (q, k, v), up.float())
    for a, e in zip(g, r, strict=True):
        err = (a.float() - e).norm() / e.norm()
        assert err < 1e-2, err  # relative error of bf16 operands, per METHOD.md: 1e-3..1e-2


def test_too_many_flex_shapes_is_a_clear_error_not_a_silent_eager_fallback(monkeypatch):
    """Past dynamo's recompile limit flex_attention would run eagerly (the full score matrix):
    tree_attention fails at once and says how to bound the shapes instead. The limit is dynamo's,
    met before any backend runs, so the compiled call here traces with aot_eager: inductor's CPU
    code generation would cost most of the test and is not what it checks (sf-train refuses flex
    off a GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    from specfoundry.kernels import tree_attention as ta

    ta._flex()  # sets the limits training runs with; then lower the one that counts here
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 1)
    compiled = torch.compile(flex_attention, backend="aot_eager")
    q = torch.randn(1, 2, 128, 16)
    with torch.no_grad():
        out = tree_attention(q, q, q, [100], 0, backend="flex", compiled=compiled)
        torch.testing.assert_close(out, tree_attention(q, q, q, [100], 0, backend="sdpa"), atol=1e-5, rtol=1e-5)
        wider = torch.randn(1, 2, 256, 16)
        with pytest.raises(ta.TooManyShapesError, match=r"pad-multiple .*--attention sdpa"):
            tree_attention(wider, wider, wider, [200], 0, backend="flex", compiled=compiled)
    torch._dynamo.reset()
