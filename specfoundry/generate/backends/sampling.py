"""Next-token choice for the slot engine, with one random stream per request.

Greedy is the argmax, as `model.generate`'s. Sampling draws the k-th token of a request by
inverse CDF from the filtered distribution (temperature, then top-k, then top-p, in
`model.generate`'s order) with one uniform number u = U(seed, k): a counter-based hash of the
request's seed and k. So what a request samples depends on its seed, the position and its own
logits only, not on which requests share its batch or when it was admitted. (The logits of one
row can differ in the last bit between batch shapes; a draw changes only where u falls within
that distance of a CDF boundary.)
"""

from __future__ import annotations

import torch

from specfoundry.generate.backends.interface import SamplingConfig

MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the `lowbias32` finaliser) of int64 values held in [0, 2^32).
    Products wrap in int64; the low 32 bits, all that is kept, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] float64 uniforms in (0, 1) from [B] int64 seeds and [B] int64 counters."""
    x = _mix32(seeds & MASK32)
    x = _mix32(((x ^ (counters & MASK32)) + 0x9E3779B9) & MASK32)
    return (x.double() + 0.5) / 2.0**32


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[B, V] fp32 logits after temperature, top-k and top-p (removed tokens at -inf)."""
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # drop the least likely tokens whose mass together is at most 1 - top_p; keep the likeliest
        ordered, order = torch.sort(logits, dim=-1)  # ascending
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor,
                counters: torch.Tensor) -> torch.Tensor:
    """[B] token ids from [B, V] fp32 logits; seeds and counters [B] pick each row's uniform."""
    if sampling.greedy:
        return logits.argmax(-1)
    cdf = filtered_logits(logits, sampling).softmax(-1).cumsum(-1)  # [B, V], nondecreasing per row
    u = uniform(seeds, counters).to(cdf.dtype) * cdf[:, -1]  # [B], below each row's total mass
    # the first token whose CDF exceeds u: a token of zero probability never is the first
    return torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
