"""SDPA under a dense mask that varies in shape from call to call (training batches), without
cuDNN's attention backend.

Why. A masked call with grouped KV heads (GQA) leaves torch on CUDA two backends: cuDNN and math;
the memory-efficient kernel takes masks but not GQA, and flash takes no mask. cuDNN builds an
execution graph for every new shape, a cost paid on the host. A training batch's width changes
from batch to batch and EAGLE-3's keys grow with every TTT step, so nearly every call builds
one: profiled on a GPU, an EAGLE-3 training step on SmolLM2 was almost all host time, in cuDNN's
forward and backward (docs/LOG.md).

What. On CUDA the keys and values are repeated to the query heads (the efficient kernel's MHA)
and the call may use flash, the efficient kernel or math, never cuDNN; the efficient kernel runs
any shape without a plan. The repeat costs a copy of the keys and values at G = Hq / Hkv times
their size, kept for the backward, and its backward a sum over each group. Beside the [T, L]
additive mask the kernel reads (the bool mask in the query's dtype), the repeated K and V of one
row take 2 Hq D / T times as much: about half for SmolLM2's draft (9 heads of 64) at T = 2048,
four times for an 8B draft (32 heads of 128). Long rows of large drafts belong on FlexAttention
(`--attention flex`), which holds neither. Without a mask the call passes the grouped heads as
they are (flash takes GQA). The backends chosen here replace any the caller chose with
torch.nn.attention.sdpa_kernel. On CPU the call is F.scaled_dot_product_attention's own, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The CUDA backends that run a new shape without building a plan first (cuDNN is left out)."""


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q [B, Hq, T, D] over k, v [B, Hkv, L, D] (Hq a multiple
    of Hkv); mask [B or 1, 1, T, L] bool (True attends) or additive, or None. Returns [B, Hq, T, Dv]."""
    groups = q.shape[1] // k.shape[1]
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    if mask is None:  # flash takes the grouped heads as they are
        with sdpa_kernel(SHAPE_FREE_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # [B, Hq, L, D]: query head h reads KV head h // groups
        v = v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(SHAPE_FREE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
