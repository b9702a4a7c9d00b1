"""The DFlash draft exactly as SGLang serves it (`DFlashDraftModel`), pure math.

A block of B tokens is drafted in one forward: slot 0 holds the anchor (the bonus token at
position p, already sampled by the target), slots 1..B-1 the mask token; slot t predicts the
token at position p + t. The context is the target's features of positions 0..p-1:

    c      = hidden_norm(fc(aux))                     aux: [T, K*Ht] K target layers; c: [T, H]
    h      = embed(block_ids)                          [B, H], the target's embeddings
    per layer:
      x    = input_layernorm(h)                        the block only: c is not normed again
      q    = RoPE(q_norm(q_proj(x)))                   per-head RMSNorm before RoPE
      K, V = [RoPE(k_norm(k_proj(c))) | RoPE(k_norm(k_proj(x)))],  [v_proj(c) | v_proj(x)]
      h    = h + o_proj(attention(q, K, V))             non-causal: all context + the whole block
      h    = h + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(h)
    out    = norm(h)                                   [B, H]
    logits = block_logits(out) = out @ W^T             W: the target's lm_head [V, H]

Two forwards share these weights: `train_forward` (training: N anchored blocks per row against
the row's whole context under the DFlash mask, kernels/dflash_attention.py) and `decode_block`
(sf-eval: one block after a DFlashCache of context keys and values); `block_logits` turns either's
states into logits, for the loss, the decoder and the gate alike. Parallelism and checkpoints
live elsewhere (train/trainer.py); the building blocks shared with other families, in
families/layers.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from specfoundry.decoding.attention import grouped_attention
from specfoundry.decoding.cache import StaticKVCache
from specfoundry.families.dflash.config import DFlashConfig
from specfoundry.families.layers import (
    COMPILED_ELEMENTWISE,
    CompiledElementwise,
    DraftRotary,
    FrozenEmbedding,
    RMSNorm,
    compiled_on_cuda,
    set_compiled_elementwise,
    swiglu,
)
from specfoundry.kernels.dflash_attention import dflash_attention, dflash_mask, resolve_backend


def rope_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE on keys alone (the context's, which have no queries): k [b, n, s, hd],
    cos/sin [b, s, hd]. The key half of apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return k * cos + rotate_half(k) * sin


# compiled with the other elementwise chains when a module's compiled_elementwise is on
COMPILED_ELEMENTWISE.setdefault(rope_keys, compiled_on_cuda(rope_keys))


class DFlashCache:
    """The context keys and values of every layer for decoding one sequence (sf-eval), in a static
    cache (decoding/cache.py StaticKVCache): column i holds the context of position i.

    Holds the committed tokens only: a drafted block's keys are written after them, for the block's
    own forward, and never committed (SGLang drops them after the forward); after verification the
    caller appends the accepted tokens' features, over them. `start` is the committed length on the
    device, which a captured block forward reads."""

    def __init__(self, capacity: int = 256):
        self.kv = StaticKVCache(capacity)
        self.length = 0
        self.start: torch.Tensor | None = None  # [] the committed length, on the device
        self.kv_index: torch.Tensor | None = None  # [C] arange on the device

    def __len__(self) -> int:
        return self.length

    def on(self, device: torch.device) -> None:
        """The device-side state, made at the first use (where the draft is)."""
        if self.start is None:
            self.start = torch.zeros((), dtype=torch.long, device=device)
            self.kv_index = torch.arange(self.kv.capacity, device=device)

    def reserve(self, tokens: int) -> bool:
        """Room for `tokens` columns (a cache that grows keeps what it holds); whether it grew."""
        if tokens <= self.kv.capacity:
            return False
        capacity = -(-tokens // 256) * 256
        self.kv = self.kv.grown(capacity)
        if self.kv_index is not None:
            self.kv_index = torch.arange(capacity, device=self.kv_index.device)
        return True

    def append_context(self, model: DFlashDraft, context_hidden: torch.Tensor) -> None:
        """context_hidden: [1, n, H], already projected (model.project_context), of the positions
        length..length+n-1."""
        n = context_hidden.shape[1]
        self.on(context_hidden.device)
        self.reserve(self.length + n + model.cfg.block_size)  # and the next block's scratch columns
        self.write_context(model, context_hidden, torch.arange(self.length, self.length + n,
                                                                device=context_hidden.device))
        self.crop(self.length + n)

    def write_context(self, model: DFlashDraft, context_hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Every layer's context keys and values of context_hidden [1, n, H] at columns and positions
        `positions` [n] (on the device: a captured append computes them there, block.py append_step)."""
        cos, sin = model.rope(context_hidden, positions[None])
        self.kv.columns = positions
        for i, layer in enumerate(model.layers):
            self.kv.update(*layer.self_attn.context_kv(context_hidden, cos, sin), i)

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens (e.g. to drop the rejected part of a round)."""
        self.length = length
        if self.start is not None:
            self.start.fill_(length)

    def block_mask(self, block: int, positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """[B, C] bool: a block's queries (at positions [B]) see every committed column and the
        block's own (columns start..start+B-1, bidirectional); a sliding layer only the keys within
        the window ending at each query's position, causal inside the block."""
        allowed = (self.kv_index < self.start + block)[None, :]  # [1, C]
        if sliding_window is None:
            return allowed.expand(block, -1)
        dist = positions[:, None] - self.kv_index[None, :]  # [B, C]
        return allowed & (dist >= 0) & (dist < sliding_window)


class DFlashAttention(CompiledElementwise):
    """Queries from the block; keys/values from the projected context and the block (GQA). Two
    entry points, one per use: `train_attention` and `decode_attention`."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.layer_idx = layer_idx  # its keys' slot in a DFlashCache
        sliding = cfg.layer_type(layer_idx) == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None

    def heads(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """[b, s, n*hd] -> [b, s, n, hd] (per-head norms act on the last dim)."""
        return y.view(*y.shape[:2], n, self.hd)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Context c [b, T, H] -> k, v [b, nkv, T, hd]: k_norm then RoPE on k, v as projected."""
        k = self.k_norm(self.heads(self.k_proj(context), self.nkv)).transpose(1, 2)
        k = self.elementwise(rope_keys, k, cos, sin)
        v = self.heads(self.v_proj(context), self.nkv).transpose(1, 2)
        return k, v

    def block_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed block x [b, S, H] -> q [b, nh, S, hd], k and v [b, nkv, S, hd]."""
        q = self.q_norm(self.heads(self.q_proj(x), self.nh)).transpose(1, 2)
        k = self.k_norm(self.heads(self.k_proj(x), self.nkv)).transpose(1, 2)
        v = self.heads(self.v_proj(x), self.nkv).transpose(1, 2)
        q, k = self.elementwise(apply_rotary_pos_emb, q, k, cos, sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[b, nh, S, hd] attention output -> [b, S, H]."""
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.nh * self.hd))

    def train_attention(self, x, context, block_rope, context_rope, anchors, keep, lengths, backend, mask):
        """x [Bsz, N*B, H] the normed blocks of every anchor; context [Bsz, T, H]; mask: this
        layer kind's mask, built once per forward (dflash_mask)."""
        q, kb, vb = self.block_qkv(x, *block_rope)
        kc, vc = self.context_kv(context, *context_rope)
        keys = torch.cat([kc, kb], dim=2)  # [Bsz, nkv, T + N*B, hd]
        values = torch.cat([vc, vb], dim=2)
        block = x.shape[1] // anchors.shape[1]
        out = dflash_attention(q, keys, values, anchors, keep, lengths, block, backend=backend,
                               sliding_window=self.sliding_window, mask=mask)
        return self.output(out)

    def decode_attention(self, x, cos, sin, cache: DFlashCache, positions: torch.Tensor):
        """x [1, B, H] one normed block after the cached context; positions [1, B]. The block's keys
        go to the scratch columns after the committed ones, and every query attends over the cache
        as block_mask says."""
        q, kb, vb = self.block_qkv(x, cos, sin)
        block = kb.shape[2]
        cache.on(x.device)
        cache.kv.columns = cache.start + cache.kv_index[:block]  # [B]
        keys, values = cache.kv.update(kb, vb, self.layer_idx)  # [1, nkv, C, hd]
        mask = cache.block_mask(block, positions[0], self.sliding_window)  # [B, C]
        return self.output(grouped_attention(q, keys, values, mask[None, None]))


class DFlashDecoderLayer(CompiledElementwise):
    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False),
        })

    def forward(self, h: torch.Tensor, attend) -> torch.Tensor:
        """h [b, S, H] block states -> [b, S, H]; attend(self_attn, x) is training's or decoding's attention."""
        h = h + attend(self.self_attn, self.input_layernorm(h))
        return h + self.mlp_forward(self.post_attention_layernorm(h))

    def mlp_forward(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer over normed states y [b, S, H] (a family that wraps the sublayers calls it)."""
        return self.mlp["down_proj"](self.elementwise(swiglu, self.mlp["gate_proj"](y), self.mlp["up_proj"](y)))


class DFlashDraft(nn.Module):
    layer_class = DFlashDecoderLayer
    """The decoder layer of the stack (a family that wraps the sublayers, DFlash2, gives its own)."""
    plain_head = True
    """block_logits is states @ W^T, W the target's frozen lm_head, with no parameter of the draft:
    the loss may then take its gradient by hand, chunk by chunk (families/dflash/loss.py). A draft
    that adds a head of its own sets it False, and the loss goes through autograd instead."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, h)  # copied from the target, never exported
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rope = DraftRotary(cfg)

    def project_context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [Bsz, T, K*Ht] captured target layers -> context c [Bsz, T, H]."""
        return self.hidden_norm(self.fc(aux))

    def train_forward(self, context, block_ids, block_positions, anchors, keep, lengths, attention: str = "auto"):
        """All anchored blocks of a batch in one pass. context [Bsz, T, H] (project_context);
        block_ids, block_positions [Bsz, N*B]; anchors [Bsz, N]; keep [Bsz, N] bool; lengths: the
        rows' real lengths; attention: auto, flex, sdpa (eager: sdpa, the plain torch path).
        Returns the final-normed block states [Bsz, N*B, H]."""
        bsz, t, _ = context.shape
        h = self.embed_tokens(block_ids).to(context.dtype)  # [Bsz, N*B, H]
        block_rope = self.rope(h, block_positions)
        context_rope = self.rope(context, torch.arange(t, device=context.device).expand(bsz, t))
        backend = resolve_backend("sdpa" if attention == "eager" else attention, context.device)
        masks = {}  # sliding window (None: full) -> its mask, built once for all layers of that kind

        def attend(attn: DFlashAttention, x: torch.Tensor) -> torch.Tensor:
            w = attn.sliding_window
            if w not in masks:
                masks[w] = dflash_mask(backend, anchors, keep, lengths, t, self.cfg.block_size, w)
            return attn.train_attention(x, context, block_rope, context_rope, anchors, keep, lengths, backend,
                                        masks[w])

        for layer in self.layers:
            h = layer(h, attend)
        return self.norm(h)

    def decode_block(self, block_ids: torch.Tensor, positions: torch.Tensor, cache: DFlashCache) -> torch.Tensor:
        """One block after the cached context (sf-eval). block_ids, positions [1, B]: the bonus token
        then mask tokens at p..p+B-1. Returns final-normed states [1, B, H]; the cache is unchanged."""
        h = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rope(h, positions)

        def attend(attn: DFlashAttention, x: torch.Tensor) -> torch.Tensor:
            return attn.decode_attention(x, cos, sin, cache, positions)

        for layer in self.layers:
            h = layer(h, attend)
        return self.norm(h)

    def block_logits(self, states: torch.Tensor, head: torch.Tensor, slots: torch.Tensor | None = None,
                     tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of final-normed block states [..., H]; head: the target's lm_head [V, H].
        slots: each row's block slot k (1..B-1; None: a block's slots 1..B-1 in order); tokens:
        [rows, B] each row's block tokens, the anchor then the ones before its slot (the true ones
        in training, the drafted ones in decoding). This draft's head reads neither."""
        return self.base_logits(states, head)

    def base_logits(self, states: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """z W^T [..., V]: the target's lm_head [V, H] over final-normed block states [..., H], the
        logits of every slot before any family's own head (Domino's correction, DSpark's bias)."""
        return states @ head.T.to(states.dtype)

    def compile_elementwise(self, on: bool = True) -> DFlashDraft:
        """Run RMSNorm, SwiGLU and RoPE through torch.compile on GPU tensors (training)."""
        return set_compiled_elementwise(self, on)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]
