"""Hidden states below 8 bits a value: 4- or 6-bit codes with a float8 scale per block of 16 values
and a float32 scale per row (NVFP4's two-level scaling, on our own grids). Pure math, on any device.

A row is one token's output of one layer (H values, H a multiple of 16). With G the largest
magnitude of the format's grid (the non-negative values a code can hold) and blocks of 16 values:
    s    = absmax(row) / (G * 448)                 float32, the row's scale
    a_b  = absmax(block b) / (G * s)               in [0, 448]: the block's ideal scale
    e_b  = the least float8_e4m3fn >= a_b          rounded up, so that no value of the block passes G
    u_i  = x_i / (e_b * s)                         the value in grid units, |u_i| <= G (0 where e_b = 0)
    c_i  = sign(u_i) * the grid magnitude nearest to |u_i|
and read back as c_i * e_b * s. Stored per row: the codes packed (H * bits / 8 bytes: two 4-bit
codes a byte, four 6-bit codes in three), then the H / 16 block scales' bytes; the row scales in
their own float32 array, as float8's are (featureset/fp8.py).

Grids (FORMATS): fp4 is OCP's E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), int4 the integers 0..7, fp6 E2M3
(0 to 7.5, eighths below 2, then 3 significant bits), int6 the integers 0..31; each with a sign bit.
Bytes a value: 4-bit 0.5625, 6-bit 0.8125 (codes and block scales), against float8's 1 and bf16's 2.

The error bound (tests/test_blockfp.py checks it on random rows and on SmolLM2's features). Let D be
the grid's largest gap between neighbours. Since e_b >= a_b, |u_i| <= absmax(block) / (a_b s) = G:
rounding to the nearest magnitude moves u_i by at most D / 2, so |x_i - read| <= (D / 2) e_b s.
Rounding a_b up to e4m3 raises it by less than one unit in the last place: 2^-3 a_b where
a_b >= 2^-6 (4 significant bits), 2^-9 below (the subnormal spacing). So, per element,
    |x_i - read| <= D / 2 * e_b * s                                                  (given the scales)
                 <= absmax(block) * D / (2 G) * (1 + 2^-3) + s * D / 2 * 2^-9          (before them)
plus the float32 roundings of the quotients and products (a relative 2^-22 of the element, which
the tests add). The worst element of a block is off by about D / (2G) of the block's absmax: fp4
1/6, int4 1/14, fp6 1/30, int6 1/62 (float8's is 1/16 of the element itself). Rounding e_b to
nearest instead would let the block's largest values pass G and be clamped, off by up to 2^-4 of
the block's absmax, twice the 6-bit grids' own error. A block of zeros gets e_b = 0 and reads back
as zeros; a row of zeros has s = 0 and reads back as zeros. A non-finite row has a non-finite s,
which the capture refuses (fp8.find_nonfinite).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.featureset.fp8 import E4M3, E4M3_MAX

BLOCK = 16
"""Values that share one float8 scale (NVFP4's block)."""


@dataclass(frozen=True)
class Format:
    """A code format: its grid of magnitudes (ascending, from 0) and its bits (sign included)."""

    name: str
    bits: int
    magnitudes: tuple[float, ...]

    @property
    def largest(self) -> float:
        """G: the grid's largest magnitude."""
        return self.magnitudes[-1]

    @property
    def largest_gap(self) -> float:
        """D: the grid's largest gap between neighbours."""
        return max(b - a for a, b in zip(self.magnitudes[:-1], self.magnitudes[1:], strict=True))

    def row_bytes(self, width: int) -> int:
        """Stored bytes of a row of `width` values: the packed codes, then the block scales."""
        return width * self.bits // 8 + width // BLOCK

    def width(self, row_bytes: int) -> int:
        """The inverse of row_bytes."""
        return row_bytes * 8 * BLOCK // (self.bits * BLOCK + 8)


def _e2m(mantissa_bits: int, exponent_bits: int) -> tuple[float, ...]:
    """The non-negative values of an OCP float format with no Inf or NaN (E2M1, E2M3): subnormals
    i * 2^(1 - m) for i < 2^m, then (1 + i / 2^m) * 2^e for e = 0 .. 2^E - 2 (bias 1)."""
    step = 2.0 ** -mantissa_bits
    values = [i * step for i in range(2**mantissa_bits)]
    for e in range(2**exponent_bits - 1):
        values += [(1 + i * step) * 2.0**e for i in range(2**mantissa_bits)]
    return tuple(values)


FORMATS = {
    "fp4": Format("fp4", 4, _e2m(1, 2)),       # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    "int4": Format("int4", 4, tuple(float(i) for i in range(8))),
    "fp6": Format("fp6", 6, _e2m(3, 2)),       # E2M3: 0 .. 7.5
    "int6": Format("int6", 6, tuple(float(i) for i in range(32))),
}


def _grid(fmt: Format, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the magnitudes [M], the midpoints between neighbours [M - 1]) as float32 on device."""
    grid = torch.tensor(fmt.magnitudes, dtype=torch.float32, device=device)
    return grid, (grid[1:] + grid[:-1]) / 2


def quantize(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any float dtype, H a multiple of 16) -> (row bytes [..., fmt.row_bytes(H)] uint8,
    row scale [...] float32), on x's device. A non-finite row gets a non-finite scale."""
    h = x.shape[-1]
    if h % BLOCK:
        raise ValueError(f"rows of {h} values: {fmt.name} storage needs a multiple of {BLOCK}")
    g = fmt.largest
    scale = x.abs().amax(dim=-1).float() / (g * E4M3_MAX)  # [...]
    safe = torch.where(scale > 0, scale, 1).unsqueeze(-1)  # a zero row divides by 1 (its values are 0)
    blocks = x.float().unflatten(-1, (h // BLOCK, BLOCK))  # [..., nb, 16]
    ideal = blocks.abs().amax(dim=-1) / (g * safe)  # [..., nb] a_b, in [0, 448] up to rounding
    ideal.clamp_(0, E4M3_MAX)
    nearest = ideal.to(E4M3)  # [..., nb]
    # up to the next e4m3 value where rounding went down: a positive e4m3's bit pattern + 1 is the
    # next larger value, and a_b <= 448 leaves room below 448 whenever it was rounded down
    bits = nearest.view(torch.uint8) + (nearest.float() < ideal).to(torch.uint8)
    # a row whose scale underflows to 0 (absmax below float32's 448 G-th of its least value) reads
    # back as zeros: its blocks' scales are 0 too, as verify expects of a zero scale
    bits = torch.where(scale.unsqueeze(-1) > 0, bits, 0)
    block_scale = bits.view(E4M3)  # [..., nb] e_b
    unit = block_scale.float() * safe  # [..., nb] e_b * s
    u = blocks / torch.where(unit > 0, unit, 1).unsqueeze(-1)  # [..., nb, 16]; a zero block stays 0
    grid, mids = _grid(fmt, x.device)
    # |u| <= G up to the float32 rounding of the quotient, which the clamp removes
    index = torch.bucketize(u.abs().clamp_(max=g), mids)  # [..., nb, 16] the nearest magnitude
    sign = (u < 0) & (index > 0)  # no negative zero: one code per value
    codes = (index | (sign.to(index.dtype) << (fmt.bits - 1))).to(torch.uint8).flatten(-2)  # [..., H]
    packed = _pack(codes, fmt.bits)
    return torch.cat([packed, block_scale.view(torch.uint8)], dim=-1), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, fmt: Format,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(row bytes [..., row_bytes(H)] uint8, row scale [...] float32) -> [..., H] in dtype, on their
    device; the products in float32, cast once."""
    h = fmt.width(stored.shape[-1])
    code_bytes = h * fmt.bits // 8
    codes = _unpack(stored[..., :code_bytes], fmt.bits, h).long()  # [..., H]
    block_scale = stored[..., code_bytes:].contiguous().view(E4M3).float()  # [..., nb]
    grid, _ = _grid(fmt, stored.device)
    magnitude = grid[codes & ((1 << (fmt.bits - 1)) - 1)]  # [..., H]
    value = torch.where((codes >> (fmt.bits - 1)).bool(), -magnitude, magnitude)
    unit = block_scale * scale.unsqueeze(-1)  # [..., nb]
    return (value.unflatten(-1, (h // BLOCK, BLOCK)) * unit.unsqueeze(-1)).flatten(-2).to(dtype)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., H] uint8 of `bits` bits -> [..., H * bits / 8] uint8: 4-bit codes two a byte (the
    first in the low half), 6-bit ones four in three bytes (24 bits, the first lowest, little-endian)."""
    if bits == 4:
        pairs = codes.unflatten(-1, (-1, 2))
        return pairs[..., 0] | (pairs[..., 1] << 4)
    quads = codes.unflatten(-1, (-1, 4)).to(torch.int32)
    word = quads[..., 0] | (quads[..., 1] << 6) | (quads[..., 2] << 12) | (quads[..., 3] << 18)  # [..., H/4]
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1).flatten(-2).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """_pack's inverse: [..., width * bits / 8] uint8 -> [..., width] uint8."""
    if bits == 4:
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    triples = packed.unflatten(-1, (-1, 3)).to(torch.int32)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)  # [..., H/4]
    codes = torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
    return codes.flatten(-2).to(torch.uint8)[..., :width]


def block_scales(stored: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The block scales' bit patterns [..., H / 16] uint8 of stored rows."""
    return stored[..., fmt.width(stored.shape[-1]) * fmt.bits // 8:]


def is_finite(stored: torch.Tensor, scale: torch.Tensor, fmt: Format) -> bool:
    """Whether stored rows read back finite, without decoding them: no block scale is e4m3fn's NaN
    (S.1111.111) and every row scale is finite with room for G * 448 times itself."""
    nan = (block_scales(stored, fmt) & 0x7F) == 0x7F
    return not bool(nan.any()) and bool(torch.isfinite(scale * (fmt.largest * E4M3_MAX)).all())


def impossible_scales(stored: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """[..., L] bool: rows no quantize() gives, read back as wrong finite numbers without a sign: a
    negative row or block scale (values' signs flipped), or a zero row scale beside non-zero block
    scales. stored [..., L * row_bytes] uint8, scale [..., L]."""
    rows = stored.unflatten(-1, (scale.shape[-1], -1))  # [..., L, row_bytes]
    blocks = block_scales(rows, fmt)  # [..., L, nb]
    negative = ((blocks & 0x80) != 0).any(-1)
    nonzero = ((blocks & 0x7F) != 0).any(-1)
    return (scale < 0) | negative | ((scale == 0) & nonzero)
