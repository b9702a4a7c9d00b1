"""Training-Time Test (TTT) attention: the tree mask as a FlexAttention BlockMask.

During TTT step s (0-based) the draft's queries are the T positions of that step; the keys are
the T positions of every step 0..s laid out as [step0 | step1 | ... | step s] (KV length
T*(s+1)). Position i of step t holds the draft's t-th guess on the branch that starts at i, so

    query i may see key (block b, position j)  iff  j is not padding and
        b == 0  and j <= i        (M_causal: the real prefix, causal)
     or b >= 1  and j == i        (M_suffix: its own earlier guesses, the kv_idx % T diagonal)

Siblings (the other branches' guesses) are never visible. With a batch of variable lengths the
padding test uses each row's length; padded queries still see their row's valid prefix, so no
row of the mask is empty (no NaN from a softmax over nothing).

On CUDA the attention runs through compiled `flex_attention` over a cached BlockMask, which
skips the empty blocks (most of the later step blocks). On CPU, where PyTorch implements
FlexAttention's forward but not its backward, the same mask_mod is materialised densely
(kernels/dense_mask.py) and fed to SDPA: the mask logic is written once.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from specfoundry.kernels.dense_mask import dense_mask
from specfoundry.kernels.masked_sdpa import masked_sdpa


def ttt_mask_mod(lengths: torch.Tensor, seq_len: int):
    """The TTT tree mask as a FlexAttention mask_mod. lengths: [B] int, valid tokens per row."""

    def ttt_tree_mask(b, h, q_idx, kv_idx):
        block = kv_idx // seq_len  # which TTT step the key belongs to
        j = kv_idx % seq_len  # the key's position inside its step
        key_valid = j < lengths[b]
        causal = (block == 0) & (j <= q_idx)
        own_branch = (block > 0) & (j == q_idx)
        return key_valid & (causal | own_branch)

    return ttt_tree_mask


class _BlockMaskCache:
    """LRU cache of BlockMasks keyed by (mask_mod factory, lengths, T, step, device): a training
    loop that sees the same shape again (every TTT step of every batch of one length bucket)
    reuses it."""

    def __init__(self, size: int = 64):
        self.size = size
        self.entries: OrderedDict[tuple, BlockMask] = OrderedDict()

    def get(self, lengths: tuple[int, ...], seq_len: int, step: int, device: torch.device,
            mask_mod=ttt_mask_mod) -> BlockMask:
        key = (mask_mod, lengths, seq_len, step, str(device))
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        mask = create_block_mask(mask_mod(lens, seq_len), B=len(lengths), H=None, Q_LEN=seq_len,
                                 KV_LEN=seq_len * (step + 1), device=device,
                                 _compile=device.type == "cuda")
        self.entries[key] = mask
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return mask


BLOCK_MASKS = _BlockMaskCache()


def ttt_block_mask(lengths, seq_len: int, step: int, device, mask_mod=ttt_mask_mod) -> BlockMask:
    """The cached BlockMask for a batch with these row lengths at TTT step `step`.
    mask_mod: a factory (lengths [B] tensor, T) -> mask_mod, ttt_mask_mod's signature."""
    return BLOCK_MASKS.get(tuple(int(x) for x in lengths), seq_len, step, torch.device(device), mask_mod)


def dense_ttt_mask(lengths, seq_len: int, step: int, device, mask_mod=ttt_mask_mod) -> torch.Tensor:
    """The same mask as a dense boolean tensor [B, 1, T, T*(step+1)] (True = may attend)."""
    lens = torch.as_tensor(list(lengths), dtype=torch.int32, device=device)
    return dense_mask(mask_mod(lens, seq_len), len(lens), 1, seq_len, seq_len * (step + 1), device)


RECOMPILE_LIMIT = 1024
"""Compiled shapes allowed: every (rows, width, step) triple is its own static shape, 7 per
batch shape; sf-train's width rounding (--pad-multiple) keeps the shapes far below this."""

_COMPILED: dict[tuple, object] = {}


def compiled_flex(dynamic: bool = False, mode: str | None = None):
    """flex_attention under torch.compile(dynamic=, mode=), built once per (dynamic, mode).

    Past dynamo's recompile limit (8 by default) flex_attention would silently run eagerly,
    materialising the [T, T*(s+1)] scores: out of memory hours into a run at real shapes. So the
    limits are raised to RECOMPILE_LIMIT and reaching them is made an error (tree_attention
    says what to do)."""
    key = (dynamic, mode)
    if key not in _COMPILED:
        config = torch._dynamo.config
        # torch renamed these (the old names are aliases for a while): set whichever exists
        raise_config(config, ("recompile_limit", "cache_size_limit"), RECOMPILE_LIMIT)
        raise_config(config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4 * RECOMPILE_LIMIT)
        if hasattr(config, "fail_on_recompile_limit_hit"):
            config.fail_on_recompile_limit_hit = True
        _COMPILED[key] = torch.compile(flex_attention, dynamic=dynamic, mode=mode)
    return _COMPILED[key]


def _flex():
    """The compiled flex_attention training runs with (static shapes, default mode)."""
    return compiled_flex()


def raise_config(config, names: tuple[str, ...], value: int) -> None:
    """Raise the first of `names` that config has to at least value."""
    for name in names:
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), value))
            return


def recompile_limit_hit() -> type[Exception] | tuple:
    """What dynamo raises at the limit with fail_on_recompile_limit_hit (() catches nothing on a
    torch without it), for an `except recompile_limit_hit():` around a compiled call (the
    expression is evaluated only when an exception reaches it). A function, not a module
    constant: reading torch._dynamo.exc imports torch._dynamo, a heavy import that a process
    importing this module need not otherwise pay (sf-train --help, an early error)."""
    return getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


class TooManyShapesError(RuntimeError):
    """Compiled FlexAttention met more batch shapes than the recompile limit allows."""


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths, step: int,
                   scale: float | None = None, backend: str = "auto", *, kernel_options: dict | None = None,
                   compiled=None, mask_mod=ttt_mask_mod) -> torch.Tensor:
    """Attention of TTT step `step` under the tree mask.

    q: [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, T*(step+1), D] (Hq a multiple of Hkv: GQA);
    lengths: [B] valid tokens per row. Returns [B, Hq, T, D].
    backend: "flex" (compiled FlexAttention, CUDA), "sdpa" (dense mask), "auto" (flex on CUDA).
    kernel_options: Triton launch options of the flex kernels (None: inductor's defaults for the
    card). compiled: the compiled flex_attention to call (default compiled_flex(): static shapes,
    default mode). mask_mod: the mask factory (ttt_mask_mod's signature), for both backends.
    """
    bsz, hq, seq_len, _ = q.shape
    assert k_cache.shape[2] == seq_len * (step + 1), (k_cache.shape, seq_len, step)
    gqa = hq != k_cache.shape[1]
    if backend == "auto":
        backend = "flex" if q.is_cuda else "sdpa"
    if backend == "flex":
        mask = ttt_block_mask(lengths, seq_len, step, q.device, mask_mod)
        compiled = compiled if compiled is not None else compiled_flex()
        try:
            return compiled(q, k_cache, v_cache, block_mask=mask, scale=scale, enable_gqa=gqa,
                            kernel_options=kernel_options)
        except recompile_limit_hit() as e:
            raise TooManyShapesError(
                f"compiled FlexAttention reached torch._dynamo's recompile limit "
                f"({getattr(torch._dynamo.config, 'cache_size_limit', RECOMPILE_LIMIT)}) at batch shape {tuple(q.shape[:3])}, TTT step {step}: "
                "each new (rows, width, step) compiles anew; round widths coarser (sf-train --pad-multiple 256) "
                "or use --attention sdpa") from e
    mask = dense_ttt_mask(lengths, seq_len, step, q.device, mask_mod)
    return masked_sdpa(q, k_cache, v_cache, mask, scale=scale)


def eager_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths, step: int,
                         scale: float | None = None) -> torch.Tensor:
    """The original EAGLE-3 formulation: explicit [T, T*(s+1)] scores, dense mask, fp32 softmax.
    Used as the plain-torch path (`--attention eager`) and as a benchmark baseline."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq != hkv:
        k_cache = k_cache.repeat_interleave(hq // hkv, dim=1)
        v_cache = v_cache.repeat_interleave(hq // hkv, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k_cache.transpose(-1, -2)) * scale  # [B, H, T, T*(s+1)]
    mask = dense_ttt_mask(lengths, q.shape[2], step, q.device)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    return torch.matmul(probs, v_cache)
