"""DFlash2's grouped dynamic causal convolution, as the engines run it around each sublayer (z-lab's
reference GroupedDynamicCausalConv, SpecForge's DFlashGroupedConv, vLLM's qwen3_dflash2.py
_grouped_conv, SGLang's DFlashGroupedConv). Pure math.

One projection of the sublayer's normed input x supplies the dynamic part of both sides' kernels.
At block position t, with T taps, G = H / group_size groups and g(c) = c // group_size:
    D_t           = kernel_projection(x_t)  viewed [2, T, G]      (side 0: the input, 1: the output)
    coef[s, j, c] = base_kernel[s, j, c] + D_t[s, j, g(c)]
    conv_s(z)_t   = sum_{j < T} coef[s, j, :] * z_{t-j}            z_{t-j} = 0 before the block's start
    u = conv_0(x);   y = sublayer(u);   out = conv_1(y)           (the output side reads x's kernel)
Causal (taps reach back), depthwise, and bounded by the block: position t of a block never reads
the block before it (training lays N blocks side by side; decoding runs one). At initialisation
base_kernel[:, 0] = 1, its other taps 0 and kernel_projection 0: both sides are the identity,
exactly, so a fresh DFlash2 draft computes what its DFlash backbone computes.
In training on a GPU (the draft's compiled elementwise switch, families/layers.py) each side runs
through torch.compile: eager, every tap's shifted copy of z is kept for the backward (one [b, S, H]
tensor a tap past the first, 10 of them for SmolLM2's 5 layers at T = 2); compiled, the backward
recomputes the shifts from z.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specfoundry.families.layers import CompiledElementwise


def grouped_dynamic_convolve(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int,
                             block_size: int) -> torch.Tensor:
    """x [b, S, H] (S: whole blocks of block_size), delta [b, S, T, G] the dynamic coefficients,
    base [T, H] one side's base kernel -> [b, S, H]. Per tap j: base_j * x_{t-j} + delta_j * x_{t-j},
    summed in the reference's order (so the identity kernel returns x bit for bit)."""
    b, s, h = x.shape
    taps, groups = base.shape[0], h // group_size
    blocks = x.view(b, s // block_size, block_size, groups, group_size)  # [b, n, B, G, gs]
    delta = delta.reshape(b, s // block_size, block_size, taps, groups, 1).to(x.dtype)  # [b, n, B, T, G, 1]
    base = base.view(taps, groups, group_size).to(x.dtype)
    out = torch.zeros_like(blocks)
    for j in range(min(taps, block_size)):  # a tap past the block's length reads nothing
        values = blocks if j == 0 else F.pad(blocks[:, :, :-j], (0, 0, 0, 0, j, 0))  # x_{t-j}, 0 before the start
        out = out + base[j] * values
        out = torch.addcmul(out, delta[:, :, :, j], values)
    return out.view(b, s, h)


class GroupedDynamicCausalConv(CompiledElementwise):
    """attention_conv / mlp_conv of a DFlash2 layer: base_kernel [2, T, H] and kernel_projection
    [2 T G, H] (no bias), the engines' names; identity at initialisation."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed sublayer input x [b, S, H] -> (conv_0(x) [b, S, H], the output side's
        coefficients [b, S, T, G], which finish reads)."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)  # [b, S, 2, T, G]
        out = self.elementwise(grouped_dynamic_convolve, x, delta[..., 0, :, :], self.base_kernel[0], self.group_size,
                               self.served_block(x))
        return out, delta[..., 1, :, :]

    def served_block(self, x: torch.Tensor) -> int:
        """The block the positions of x [b, S, H] form: training lays whole blocks of the trained size
        side by side (S >= block_size); decoding runs one block, which the engines may serve smaller
        than trained, its boundary then the served block's (SGLang's set_block_size, vLLM's
        1 + num_speculative_tokens)."""
        return min(self.block_size, x.shape[1])

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [b, S, H] -> conv_1(y) [b, S, H] with prepare's coefficients."""
        return self.elementwise(grouped_dynamic_convolve, y, delta, self.base_kernel[1], self.group_size,
                                self.served_block(y))
