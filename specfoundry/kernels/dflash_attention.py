"""DFlash training attention: many anchored blocks per row against one shared context.

One training row holds T context positions (the target's projected features, keys and values
only) and N sampled anchors a_0 < a_1 < ... ; anchor n owns a block of B query slots, slot t at
position a_n + t, laid out at query index n*B + t. The keys are [T context | N*B block], and

    query (n, t) may see context key j       iff  keep[n] and j < a_n and j < length
                 may see block key (m, u)    iff  m == n                      (its own block)

Context strictly before the anchor: at serving time the anchor is the bonus token, which the
target has not run yet, so its own feature (and everything after it) is unknown. Blocks never
see one another, so overlapping blocks (anchors closer than B) leak nothing. A padding anchor
(keep False) sees only its own block, so no row of the mask is empty (no NaN); it gets no loss.

A sliding layer (window W) is causal inside the block and sees only the W positions ending at
its own, p = a_n + t:  context j iff p - j < W;  block key u iff u <= t and t - u < W.

On CUDA the attention runs through compiled `flex_attention` over a BlockMask. The anchors change
every step, so the BlockMask's tiles are rebuilt every step, from the anchors by a few small
tensor ops (dflash_block_mask: nothing traced, nothing compiled); the mask_mod captures the
anchors as tensors, so the compiled attention (one per shape, compiled_flex) is reused, not
recompiled, when they change. On CPU (PyTorch has no FlexAttention backward there) the same
mask_mod is materialised densely (kernels/dense_mask.py) and fed to SDPA: the mask logic is
written once.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from specfoundry.kernels.dense_mask import dense_mask
from specfoundry.kernels.masked_sdpa import masked_sdpa
from specfoundry.kernels.tree_attention import TooManyShapesError, compiled_flex, recompile_limit_hit


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int,
                    ctx_lengths: torch.Tensor, sliding_window: int | None = None):
    """The DFlash mask as a FlexAttention mask_mod (see the module docstring).

    anchors: [Bsz, N] int, anchor positions; keep: [Bsz, N] bool, real (not padding) anchors;
    ctx_len: T, the context keys before the block keys; block_size: B; ctx_lengths: [Bsz] int,
    each row's real length; sliding_window: None (full, bidirectional layer) or W."""
    num_anchors = anchors.shape[1]

    def dflash_mask(b, h, q_idx, kv_idx):
        # clamped: FlexAttention may evaluate padded query rows past N*B (their output is dropped)
        n = torch.clamp(q_idx // block_size, max=num_anchors - 1)  # the query's anchor
        t = q_idx % block_size  # its slot in the block
        anchor = anchors[b, n]
        is_context = kv_idx < ctx_len
        rel = kv_idx - ctx_len  # block keys: (rel // B, rel % B) = (their anchor, their slot)
        context = is_context & (kv_idx < anchor) & (kv_idx < ctx_lengths[b]) & keep[b, n]
        own_block = ~is_context & (rel // block_size == n)
        if sliding_window is None:
            return context | own_block
        u = rel % block_size
        context = context & (anchor + t - kv_idx < sliding_window)
        own_block = own_block & (u <= t) & (t - u < sliding_window)
        return context | own_block

    return dflash_mask


def _as_lengths(lengths, device) -> torch.Tensor:
    return torch.as_tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)


def dense_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, lengths, ctx_len: int, block_size: int,
                      sliding_window: int | None = None) -> torch.Tensor:
    """The mask as a dense boolean tensor [Bsz, 1, N*B, T + N*B] (True = may attend)."""
    bsz, n = anchors.shape
    mod = dflash_mask_mod(anchors, keep, ctx_len, block_size, _as_lengths(lengths, anchors.device), sliding_window)
    return dense_mask(mod, bsz, 1, n * block_size, ctx_len + n * block_size, anchors.device)


def _blocks_to_indices(occupied: torch.Tensor):
    """[Bsz, nq, nkv] bool tile occupancy -> (num [Bsz, 1, nq], indices [Bsz, 1, nq, nkv]) int32,
    BlockMask's layout: each q-block's kept kv-blocks first, in ascending order."""
    num = occupied.sum(-1, dtype=torch.int32)
    order = torch.argsort((~occupied).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], order[:, None]


def dflash_block_mask(anchors: torch.Tensor, keep: torch.Tensor, lengths, ctx_len: int, block_size: int,
                      sliding_window: int | None = None, *, tile: int = 128) -> BlockMask:
    """The BlockMask for these anchors, its tiles worked out from the anchors directly: small
    [Bsz, N] / [Bsz, nq, nkv] tensor ops, no [N*B, T+N*B] evaluation and nothing to compile (a
    compiled create_block_mask took minutes to compile per shape at the real one). The kernel still
    applies dflash_mask_mod inside every partial tile, so the tiles need only cover the mask:

    q-tile i holds the queries of anchors n_lo..n_hi; anchor n sees context j < hi_n with
    hi_n = min(a_n, length) if kept, else 0. A context tile [s, e) is needed iff s < max hi_n
    (and, in a sliding layer, e > min a_n - W + 1), and full (every query sees all of it, so the
    kernel skips the mask) iff e <= min hi_n in a full layer and the q-tile is whole. The block keys of the tile's anchors,
    [T + n_lo*B, T + (n_hi+1)*B), are needed, and never full. Exact for full layers; for sliding
    ones a cover (the window inside the block is left to the mask_mod)."""
    bsz, n = anchors.shape
    device = anchors.device
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    lens = _as_lengths(lengths, device)
    keep = keep.to(torch.bool)
    q_start = torch.arange(0, q_len, tile, device=device)  # [nq]
    n_lo = q_start // block_size
    n_hi = ((q_start + tile).clamp(max=q_len) - 1) // block_size
    member = (torch.arange(n, device=device) >= n_lo[:, None]) & (torch.arange(n, device=device) <= n_hi[:, None])
    hi = torch.where(keep, torch.minimum(anchors, lens[:, None]), 0)[:, None, :]  # [Bsz, 1, N]
    big = torch.iinfo(hi.dtype).max
    hi_max = torch.where(member, hi, 0).amax(-1)[..., None]  # [Bsz, nq, 1]
    hi_min = torch.where(member, hi, big).amin(-1)[..., None]
    kv_start = torch.arange(0, kv_len, tile, device=device)  # [nkv]
    kv_end = kv_start + tile
    context = kv_start < hi_max  # [Bsz, nq, nkv]
    if sliding_window is not None:
        lo = torch.where(member, anchors[:, None, :] - sliding_window + 1, big).amin(-1)[..., None]
        context = context & (kv_end > lo)
    own = (kv_end > ctx_len + n_lo[:, None] * block_size) & (kv_start < ctx_len + (n_hi[:, None] + 1) * block_size)
    # a ragged last q-tile stays partial, as create_block_mask leaves it (its padding rows are masked)
    full = (kv_end <= hi_min) & (q_start + tile <= q_len)[:, None] & (sliding_window is None)
    partial = (context | own) & ~full
    mod = dflash_mask_mod(anchors, keep, ctx_len, block_size, lens, sliding_window)
    return BlockMask.from_kv_blocks(*_blocks_to_indices(partial), *_blocks_to_indices(full), BLOCK_SIZE=tile,
                                    mask_mod=mod, seq_lengths=(q_len, kv_len))


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"unknown DFlash attention backend {backend!r}: choose auto, flex or sdpa")
    return backend


def dflash_mask(backend: str, anchors: torch.Tensor, keep: torch.Tensor, lengths, ctx_len: int, block_size: int,
                sliding_window: int | None = None) -> BlockMask | torch.Tensor:
    """The mask a backend ("flex" or "sdpa", resolved) takes: built once per forward and shared by
    every layer of one kind (full or sliding)."""
    if backend == "flex":
        return dflash_block_mask(anchors, keep, lengths, ctx_len, block_size, sliding_window)
    return dense_dflash_mask(anchors, keep, lengths, ctx_len, block_size, sliding_window)


def dflash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                     lengths, block_size: int, backend: str = "auto", sliding_window: int | None = None, *,
                     mask: BlockMask | torch.Tensor | None = None, scale: float | None = None,
                     kernel_options: dict | None = None) -> torch.Tensor:
    """Attention of the block queries over [context | blocks] under the DFlash mask.

    q: [Bsz, Hq, N*B, D]; k, v: [Bsz, Hkv, T + N*B, D] (Hq a multiple of Hkv: GQA); anchors,
    keep: [Bsz, N]; lengths: [Bsz] real lengths. Returns [Bsz, Hq, N*B, D].
    backend: "flex" (compiled FlexAttention, CUDA), "sdpa" (dense mask), "auto" (flex on CUDA).
    mask: the backend's mask built beforehand by dflash_mask (one per forward, not per layer).
    kernel_options: Triton launch options of the flex kernels (None: inductor's defaults)."""
    bsz, hq, q_len, _ = q.shape
    num_anchors = anchors.shape[1]
    ctx_len = k.shape[2] - num_anchors * block_size
    assert q_len == num_anchors * block_size and ctx_len >= 0, (q.shape, k.shape, anchors.shape, block_size)
    backend = resolve_backend(backend, q.device)
    if mask is None:
        mask = dflash_mask(backend, anchors, keep, lengths, ctx_len, block_size, sliding_window)
    gqa = hq != k.shape[1]
    if backend == "sdpa":
        return masked_sdpa(q, k, v, mask, scale=scale)
    try:
        return compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=kernel_options)
    except recompile_limit_hit() as e:
        raise TooManyShapesError(
            f"compiled FlexAttention reached torch._dynamo's recompile limit at DFlash shape {tuple(q.shape)} "
            f"x {tuple(k.shape)}: each new (rows, anchors, width) compiles anew; round widths coarser "
            "(sf-train --pad-multiple 256) or use --attention sdpa") from e
