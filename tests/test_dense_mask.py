"""kernels/dense_mask.py: the dense mask of every family's mask_mod is FlexAttention's create_mask's,
value for value and in the same layout (a dimension the mask_mod ignores expanded, not copied)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from specfoundry.families.peagle.mask import peagle_mask_mod
from specfoundry.kernels.dense_mask import dense_mask
from specfoundry.kernels.dflash_attention import dflash_mask_mod
from specfoundry.kernels.tree_attention import ttt_mask_mod


def assert_same_as_create_mask(mask_mod, B, H, Q_LEN, KV_LEN):
    ref = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu")
    out = dense_mask(mask_mod, B, H, Q_LEN, KV_LEN, "cpu")
    assert out.dtype == ref.dtype == torch.bool and out.shape == ref.shape
    assert torch.equal(out, ref)
    assert strides(out) == strides(ref)


def strides(mask: torch.Tensor) -> list[int]:
    """The strides that matter: those of the dimensions longer than 1."""
    return [s for s, n in zip(mask.stride(), mask.shape, strict=True) if n > 1]


@pytest.mark.parametrize("case", range(8))
def test_dense_mask_is_create_masks_for_every_mask_mod(case):
    g = torch.Generator().manual_seed(case)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=g))

    B, T, step = randint(1, 3), randint(1, 20), randint(0, 6)
    lengths = torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32)  # 0: an empty row
    assert_same_as_create_mask(ttt_mask_mod(lengths, T), B, 1, T, T * (step + 1))
    assert_same_as_create_mask(ttt_mask_mod(lengths, T), B, 3, T, T * (step + 1))  # ignores h: expanded

    N, block, ctx = randint(1, 5), randint(1, 6), randint(0, 24)
    anchors = torch.randint(0, max(ctx, 1), (B, N), generator=g).sort(-1).values
    keep = torch.rand(B, N, generator=g) < 0.7
    ctx_lengths = torch.randint(0, ctx + 1, (B,), generator=g)
    for window in (None, randint(1, 8)):
        mod = dflash_mask_mod(anchors, keep, ctx, block, ctx_lengths, window)
        assert_same_as_create_mask(mod, B, 1, N * block, ctx + N * block)
        assert_same_as_create_mask(mod, B, 1, N * block + 3, ctx + N * block)  # padded query rows (clamped)

    P = randint(1, 24)
    anchor, depth = torch.randint(0, 8, (B, P), generator=g), torch.randint(0, 4, (B, P), generator=g)
    real = torch.rand(B, P, generator=g) < 0.8
    assert_same_as_create_mask(peagle_mask_mod(anchor, depth, real), B, 1, P, P)

    assert_same_as_create_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B, 2, T, T + 3)  # ignores b and h
