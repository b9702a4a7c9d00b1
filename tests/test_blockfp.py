"""featureset/blockfp.py: 4- and 6-bit codes with a float8 scale per block of 16 and a float32 scale
per row, each format's round trip against the bound its docstring derives."""

from __future__ import annotations

import pytest
import torch

from specfoundry.featureset import blockfp
from specfoundry.featureset.blockfp import BLOCK, FORMATS
from specfoundry.featureset.fp8 import E4M3, E4M3_MAX
from tests.test_fp8 import random_rows

FLOAT32_SLACK = 2.0**-22
"""The float32 roundings of the quotient x / (e s) and of the product c e s: two of 2^-24 each of
the element, twice over for the scale's own product e * s (the docstring's last term)."""


def bound_given_scales(x, scale, stored, fmt):
    """|x - read| <= D/2 e_b s per element, [..., H], from the stored scales."""
    e = blockfp.block_scales(stored, fmt).contiguous().view(E4M3).float()  # [..., nb]
    per_block = fmt.largest_gap / 2 * e * scale.unsqueeze(-1)  # [..., nb]
    return per_block.repeat_interleave(BLOCK, dim=-1) + FLOAT32_SLACK * x.abs()


def bound_before_scales(x, scale, fmt):
    """absmax(block) D/(2G) (1 + 2^-3) + s D/2 2^-9, per element: the bound in the row's own terms."""
    h = x.shape[-1]
    block = x.abs().unflatten(-1, (h // BLOCK, BLOCK)).amax(-1)  # [..., nb]
    d, g = fmt.largest_gap, fmt.largest
    per_block = block * d / (2 * g) * (1 + 2.0**-3) + scale.unsqueeze(-1) * d / 2 * 2.0**-9
    return per_block.repeat_interleave(BLOCK, dim=-1) + FLOAT32_SLACK * x.abs()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_round_trip_within_the_derived_bound(name, dtype):
    fmt = FORMATS[name]
    x = random_rows(dtype)  # [64, 3, 256]: Gaussian, heavy-tailed, a massive element, tiny and huge rows
    stored, scale = blockfp.quantize(x, fmt)
    assert stored.dtype == torch.uint8 and stored.shape == (*x.shape[:-1], fmt.row_bytes(256))
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    xf = x.float()
    err = (blockfp.dequantize(stored, scale, fmt, torch.float32) - xf).abs()
    worst = (err / bound_given_scales(xf, scale, stored, fmt)).max().item()
    assert worst <= 1.0, f"{name}: error {worst:.3f} x the bound given the scales"
    assert worst > 0.5, f"{name}: error only {worst:.3f} x the bound: is the bound or the test wrong?"
    assert (err <= bound_before_scales(xf, scale, fmt)).all()
    # the row's largest element sits in a block whose scale is float8's largest: the whole range is used
    assert (blockfp.block_scales(stored, fmt).view(E4M3).float().amax(-1) == E4M3_MAX).all()
    # and no block scale is below its ideal (rounded up), none a whole step above it
    e = blockfp.block_scales(stored, fmt).contiguous().view(E4M3).float()
    a = xf.abs().unflatten(-1, (16, BLOCK)).amax(-1) / (fmt.largest * torch.where(scale > 0, scale, 1).unsqueeze(-1))
    assert (e >= a * (1 - 2.0**-23)).all() and (e <= a * (1 + 2.0**-3) + 2.0**-9).all()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_grids_are_the_formats_own_and_every_code_packs_and_unpacks(name):
    fmt = FORMATS[name]
    want = {"fp4": (0, 0.5, 1, 1.5, 2, 3, 4, 6), "int4": tuple(range(8)),
            "fp6": tuple([i / 8 for i in range(16)] + [2 + i / 4 for i in range(8)] + [4 + i / 2 for i in range(8)]),
            "int6": tuple(range(32))}[name]
    assert fmt.magnitudes == tuple(float(v) for v in want) and len(fmt.magnitudes) == 2 ** (fmt.bits - 1)
    codes = torch.arange(2**fmt.bits, dtype=torch.uint8).repeat(2, 4)  # [2, 4 * 2^bits] every code
    packed = blockfp._pack(codes, fmt.bits)
    assert packed.shape == (2, codes.shape[-1] * fmt.bits // 8)
    assert torch.equal(blockfp._unpack(packed, fmt.bits, codes.shape[-1]), codes)
    assert fmt.width(fmt.row_bytes(4096)) == 4096


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grid_values_at_unit_scales_read_back_to_float32_rounding(name):
    """A row whose block maxima are G and whose values are grid values (signs mixed) reads back
    up to float32 rounding: the codes are the nearest magnitudes, e_b = 1 and s = 1/448."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor(fmt.magnitudes)
    picks = grid[torch.randint(len(grid), (4, 64), generator=g)]
    picks[:, ::BLOCK] = fmt.largest  # each block's maximum is G
    x = picks * torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0) / E4M3_MAX
    stored, scale = blockfp.quantize(x, fmt)
    # s = absmax / (G 448) and the two products each round once in float32: 3 x 2^-24 < 2^-22
    torch.testing.assert_close(blockfp.dequantize(stored, scale, fmt, torch.float32), x, rtol=2.0**-22, atol=0)


def test_zero_rows_and_blocks_read_back_as_zeros_and_width_must_be_whole_blocks():
    fmt = FORMATS["fp4"]
    x = torch.randn(3, 64)
    x[1] = 0.0
    x[2, 16:32] = 0.0
    stored, scale = blockfp.quantize(x, fmt)
    back = blockfp.dequantize(stored, scale, fmt, torch.float32)
    assert scale[1] == 0 and torch.equal(back[1], torch.zeros(64)) and torch.equal(back[2, 16:32], torch.zeros(16))
    with pytest.raises(ValueError, match="multiple of 16"):
        blockfp.quantize(torch.randn(2, 24), fmt)
    # a row so small that its scale underflows to 0 reads back as zeros, and its scales are possible ones
    tiny = torch.full((1, 32), 1e-44)
    stored, scale = blockfp.quantize(tiny, fmt)
    assert scale[0] == 0 and not blockfp.impossible_scales(stored, scale[:, None], fmt).any()
    assert torch.equal(blockfp.dequantize(stored, scale, fmt, torch.float32), torch.zeros(1, 32))


def test_nonfinite_and_impossible_scales_are_found_without_decoding():
    fmt = FORMATS["int4"]
    stored, scale = blockfp.quantize(torch.randn(4, 2 * 64), fmt)  # rows of 2 layers' 64 values
    assert blockfp.is_finite(stored, scale, fmt)
    layers = scale.new_ones(4, 2)  # [rows, L] stand-in row scales of two layers
    rows = torch.cat([stored, stored], dim=-1)  # [4, 2 * row_bytes]
    assert not blockfp.impossible_scales(rows, layers, fmt).any()
    nan = stored.clone()
    blockfp.block_scales(nan, fmt)[2, 1] = 0x7F  # e4m3fn's NaN
    assert not blockfp.is_finite(nan, scale, fmt)
    assert not blockfp.is_finite(stored, torch.where(torch.arange(4) == 1, torch.inf, scale), fmt)
    negative = rows.clone()
    blockfp.block_scales(negative[:, fmt.row_bytes(128):], fmt)[3, 0] |= 0x80  # a block scale's sign bit
    found = blockfp.impossible_scales(negative, layers, fmt)
    assert found.tolist() == [[False, False]] * 3 + [[False, True]]
    zero = layers.clone()
    zero[0, 0] = 0.0  # a zero row scale beside non-zero block scales
    assert blockfp.impossible_scales(rows, zero, fmt)[0].tolist() == [True, False]
