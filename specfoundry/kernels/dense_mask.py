"""A FlexAttention mask_mod materialised as a dense boolean mask, for SDPA (the CPU paths).

FlexAttention's own `create_mask` vmaps the mask_mod over (b, h, q_idx, kv_idx) under
torch._dynamo's TransformGetItemToIndex, so its first call imports torch._dynamo (a heavy import
where nothing else needs it) and each call runs the mask_mod through vmap. `dense_mask` gives the
mask_mod the four index tensors shaped to broadcast against one another instead, and evaluates it
once: each element goes through the same tensor ops with the same indices (indexing a buffer by
an index tensor, `lengths[b]`, broadcasts like the rest), so the mask is the same, for every
mask_mod FlexAttention accepts (tensor ops only, no Python branching on the indices).
"""

from __future__ import annotations

import torch


def dense_mask(mask_mod, B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> torch.Tensor:
    """mask_mod(b, h, q_idx, kv_idx) at every index: a [B, H, Q_LEN, KV_LEN] tensor (True = may
    attend), what `create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device)` returns."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q_idx = torch.arange(Q_LEN, device=device).view(1, 1, Q_LEN, 1)
    kv_idx = torch.arange(KV_LEN, device=device).view(1, 1, 1, KV_LEN)
    # a mask_mod that ignores an index (h, usually) leaves that dimension 1: expanded (stride 0,
    # no copy), as create_mask's vmap leaves it
    return mask_mod(b, h, q_idx, kv_idx).expand(B, H, Q_LEN, KV_LEN)
