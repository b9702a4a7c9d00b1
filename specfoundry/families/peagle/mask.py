"""P-EAGLE's training attention mask, written once as a FlexAttention mask_mod and used by both the
BlockMask (GPU, --attention flex) and the dense SDPA mask (CPU, where FlexAttention has no backward).

One training row packs P elements, element e = (anchor a_e, depth d_e) (COD sampling, loss.py): the
depth-0 elements are the context (one per position, a = position), a depth-d element is the d-th
draft slot of the rollout anchored at a. Query q may attend key k iff both are real (not padding) and

    (d_k == 0 and a_k <= a_q)          the context up to and including its own anchor, or
    (a_k == a_q and d_k <= d_q)        the earlier slots of its own rollout (and itself)

which is exactly what a decoding round sees: the committed positions (the draft's cache) and the
round's own mask slots before it (causal). A padding element sees itself only, so no row is empty.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from specfoundry.kernels.dense_mask import dense_mask


def peagle_mask_mod(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor):
    """The mask as a mask_mod; anchor, depth: [B, P] int64, real: [B, P] bool (False: padding)."""

    def peagle_mask(b, h, q_idx, kv_idx):
        aq, ak = anchor[b, q_idx], anchor[b, kv_idx]
        dq, dk = depth[b, q_idx], depth[b, kv_idx]
        context = (dk == 0) & (ak <= aq)
        own_rollout = (ak == aq) & (dk <= dq)
        return (real[b, q_idx] & real[b, kv_idx] & (context | own_rollout)) | (q_idx == kv_idx)

    return peagle_mask


def dense_peagle_mask(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mask as a dense boolean tensor [B, 1, P, P] (True = may attend), for SDPA."""
    bsz, p = anchor.shape
    return dense_mask(peagle_mask_mod(anchor, depth, real), bsz, 1, p, p, anchor.device)


def peagle_block_mask(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor) -> BlockMask:
    """The mask as a FlexAttention BlockMask (built eagerly from the same mask_mod; GPU)."""
    bsz, p = anchor.shape
    return create_block_mask(peagle_mask_mod(anchor, depth, real), bsz, None, p, p, device=anchor.device)


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto is SDPA under the dense mask on every device; flex is opt-in (see docs/families.md)."""
    if backend in ("auto", "sdpa", "eager"):
        return "sdpa"
    if backend != "flex":
        raise ValueError(f"unknown P-EAGLE attention backend {backend!r}: choose auto, flex or sdpa")
    return backend


def peagle_mask(backend: str, anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor):
    """The mask the resolved backend takes, built once per forward and shared by every layer."""
    if resolve_backend(backend, anchor.device) == "flex":
        return peagle_block_mask(anchor, depth, real)
    return dense_peagle_mask(anchor, depth, real)
