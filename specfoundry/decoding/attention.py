"""Attention over a KV cache as it is stored: grouped-query layers attend without repeat_kv.

transformers' sdpa attention, given an explicit mask (the ready 4D masks every decoding step and
the slot engine pass), does not use SDPA's `enable_gqa` (on CUDA a masked GQA call falls back to
the math kernel) but `repeat_kv`: a copy of every layer's attended cache, keys and values, at G =
heads / kv_heads times its size, at every step. The folded attention below gives each (head,
query) the same softmax over the same keys without that copy. It is registered with transformers
under a name (register_attention) and selected for a forward only (folded_attention).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

FOLDED_ATTENTION = "specfoundry_folded_sdpa"  # transformers' name of folded_sdpa_attention (any queries a row)
ONE_QUERY_FOLDED_ATTENTION = "specfoundry_slot_sdpa"  # the fold for one query a row, more to transformers' path
PLAIN_ONLY = ("softcap", "position_bias", "s_aux")  # sdpa's extras: the fold leaves them to transformers' path


def folded_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, max_queries: int | None = None, **kwargs):
    """transformers' sdpa attention function, except that the queries of a grouped-query layer
    attend over key / value [B, kv_heads, L, D] as they are, without repeat_kv.

    Query head h uses KV head h // G (G = heads / kv_heads: repeat_kv's order). The G heads of KV
    head j are G x T independent queries against the same keys and values, so
        out[b, j*G + g, t] = softmax(q[b, j*G + g, t] . K[b, j]^T * scale + mask[b, 0, t]) V[b, j]
    is SDPA over q as [B, kv_heads, G*T, D] (row g*T + t; the G heads are adjacent, so for T = 1 it
    is a view), K / V as they are, and the mask [B, 1, T, L] repeated G times along the query rows
    (row g*T + t is mask row t; broadcast when T = 1); the output [B, kv_heads, G*T, Dv] is viewed
    back as [B, heads, T, Dv]. Nothing of the cache is expanded or copied: only the queries, the
    mask's G copies and the output, all of T rows. G comes from the tensors, not the module: under
    tensor parallelism a rank holds heads / N query heads and kv_heads / N KV heads, the same G.
    More than `max_queries` queries a row (None: no limit; the slot engine's prefill), layers
    without groups, a mask per head and what sdpa's extras need go to transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if ((max_queries is not None and q_len > max_queries) or heads == kv_heads or heads % kv_heads or value.shape[1] != kv_heads
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))
            or any(kwargs.get(k) is not None for k in PLAIN_ONLY) or kwargs.get("output_attentions")
            or torch.jit.is_tracing()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = grouped_attention(query, key, value, attention_mask, dropout=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, T, heads, Dv]


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """SDPA of query [B, heads, T, D] over key / value [B, kv_heads, L, D] as stored, the G = heads /
    kv_heads query heads of each KV head folded into its query rows (folded_sdpa_attention's math);
    mask [B, 1, T, L] (bool: True attends; or additive) or None. Returns [B, heads, T, Dv]."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # [B, kv_heads, G*T, D], row g*T + t
    if mask is not None and q_len > 1 and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)  # [B, 1, G*T, L]: row g*T + t is row t
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                         scale=scale)  # [B, kv_heads, G*T, Dv]
    return out.reshape(batch, heads, q_len, value.shape[-1])


def register_attention(name: str, function) -> None:
    """Make `name` an attention implementation transformers knows (the function, and sdpa's mask
    builder for where one is built: the 4D masks passed here go through mask creation untouched)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])


def one_query_folded_attention(module, query, key, value, attention_mask, **kwargs):
    """folded_sdpa_attention for one query per row (a decode step); several queries a row (a
    prefill, a verify) go to transformers' sdpa path."""
    return folded_sdpa_attention(module, query, key, value, attention_mask, max_queries=1, **kwargs)


FOLDS = {None: (FOLDED_ATTENTION, folded_sdpa_attention), 1: (ONE_QUERY_FOLDED_ATTENTION, one_query_folded_attention)}
"""The folds by the most queries a row they take (None: any), as (transformers' name, function)."""
_registered: set[str] = set()  # the FOLDS names transformers knows already


@contextmanager
def folded_attention(config, max_queries: int | None = None, use: bool = True):
    """Run the layers of `config` (the text config the attention modules read) with the folded
    attention for at most `max_queries` queries a row (FOLDS), then restore what they had. A no-op
    unless `use` and the target is sdpa (eager keeps eager: its masks are additive and it repeats
    the cache in its own code)."""
    before = config._attn_implementation
    if not use or before != "sdpa":
        yield
        return
    name, function = FOLDS[max_queries]
    if name not in _registered:  # once per process, not at every forward
        register_attention(name, function)
        _registered.add(name)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
