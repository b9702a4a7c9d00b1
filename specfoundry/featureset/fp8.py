"""float8 (e4m3fn) hidden states with one float32 scale per row: half of bf16's bytes.

A row is one token's output of one layer (H values). It is stored as
    values  float8_e4m3fn [..., H]   x / scale rounded to nearest (even), uint8 bit patterns on disk
    scale   float32       [...]      absmax(row) / 448, 448 being e4m3fn's largest finite value
and read back as values * scale. Each row spends e4m3's range on its own values, so a massive
activation costs precision in its own row only, never in its neighbours'.

The error bound (tests/test_fp8.py checks it on random rows and on SmolLM2's features). e4m3fn
has 4 significant bits (3 stored), normal values from 2^-6 up, subnormals spaced 2^-9. The
quantised y = x / scale lies in [-448, 448]; rounding to nearest moves it by at most half a unit
in the last place: 2^-4 |y| where |y| >= 2^-6 (4 significant bits), 2^-10 below (half the
subnormal spacing). In x's units, per element,
    |dequantize(quantize(x)) - x| <= 2^-4 |x| + 2^-10 scale,   scale = absmax / 448,
so at most 2^-4 of the row's absmax at its largest element, and an absolute absmax * 2^-18.8
for the elements more than 2^14.8 times smaller than the row's largest (e4m3's subnormals). The
sum (instead of the max of the two terms) covers the float32 rounding of x / scale and of
values * scale. A row of zeros has scale 0 and reads back as zeros exactly. A row whose absmax is
NaN or Inf has no scale: the capture refuses it (find_nonfinite), it is never stored.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
RELATIVE_ERROR = 2.0**-4  # per element, relative to the element (see the module docstring)
SUBNORMAL_ERROR = 2.0**-10  # per element, absolute, in units of the row's scale


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any float dtype) -> (values [..., H] float8_e4m3fn, scale [...] float32), on x's
    device. A non-finite row gets a non-finite scale (and meaningless values)."""
    scale = x.abs().amax(dim=-1).float() / E4M3_MAX  # [...]; abs and max are exact in x's dtype
    # a zero row divides by 1 (its values are 0 either way): 0 / 0 would make them NaN
    y = x / torch.where(scale > 0, scale, 1).unsqueeze(-1)  # [..., H] float32
    # |y| <= 448 up to the division's rounding; clamped so no cast sees a value out of range
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(values [..., H] float8_e4m3fn, scale [...] float32) -> [..., H] in dtype, on their device.
    The product is taken in float32 (exact up to its rounding), then cast once to dtype.

    Two passes over the values, 7 bytes moved per value: float8 -> bfloat16 is exact (e4m3's 4
    significant bits and 2^-9..448 range sit inside bfloat16's), and one mul reads that and the
    scale, multiplies in float32 (the promoted dtype) and writes dtype. This gives the bits of
    (values.float() * scale).to(dtype), which moves 15 bytes per value through two float32
    temporaries (torch does not promote float8, so the mul cannot read it directly)."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    return torch.mul(values.to(torch.bfloat16), scale.unsqueeze(-1), out=out)


def find_nonfinite(scale: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first row whose scale (so absmax) is NaN or Inf, or None if every one is finite."""
    bad = (~torch.isfinite(scale)).nonzero()
    return tuple(bad[0].tolist()) if len(bad) else None


def is_finite(values: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether values * scale is finite everywhere (in float32), without dequantising: no value is
    e4m3fn's NaN (S.1111.111; it has no Inf) and every scale is finite with room for 448x."""
    nan = (values.view(torch.uint8) & 0x7F) == 0x7F
    return not bool(nan.any()) and bool(torch.isfinite(scale * E4M3_MAX).all())


def impossible_scales(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., L] bool: rows whose scale no quantize() gives, read back as wrong finite numbers
    without a sign: a negative scale (every value's sign flipped), or 0 beside non-zero values
    (the row read as zeros). values [..., L*H] float8_e4m3fn, scale [..., L]. A NaN or Inf scale
    reads back as NaN or Inf, which the non-finite checks name."""
    bits = values.view(torch.uint8).unflatten(-1, (scale.shape[-1], -1))  # [..., L, H]
    nonzero = ((bits & 0x7F) != 0).any(-1)  # a value other than +0 and -0
    return (scale < 0) | ((scale == 0) & nonzero)
