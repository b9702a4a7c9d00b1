"""The P-EAGLE draft as vLLM serves it (speculators `peagle` -> Eagle3LlamaForCausalLM with
parallel drafting: vllm/model_executor/models/llama_eagle3.py), pure math.

    h         = fc(a)                    at depth 0, a: [3*Ht] the target's three captured layers
              = fc(mask_hidden)          at depths 1..K-1 (a learned [1, 3*Ht], vLLM's mask_hidden)
    token     = the next real token      at depth 0; the mask (pard) token at depths 1..K-1
    layer 0   x = cat(input_norm(embed(token)), hidden_norm(h));  r = attn(x) + h;  s = mlp(post_norm(r)) + r
    layer i>0 r = attn(input_norm(s)) + s;  s = mlp(post_norm(r)) + r          (plain Llama layers)
    logits    = lm_head(norm(s))          over the draft vocabulary (d2t / t2d as EAGLE-3's)

Every depth runs in the same forward: a slot at depth d of the rollout anchored at i sits at
position i + d and attends to the context up to i and to its own earlier slots (mask.py). Two
entry points share the weights: `train_forward` (a packed row of COD-sampled elements under the
mask) and `decode_forward` (new tokens after per-layer KV caches, causal: sf-eval).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specfoundry.decoding.attention import grouped_attention
from specfoundry.decoding.cache import StaticKVCache
from specfoundry.families.layers import (
    CompiledElementwise,
    DraftRotary,
    FrozenEmbedding,
    RMSNorm,
    set_compiled_elementwise,
    swiglu,
)
from specfoundry.families.peagle.config import PEagleConfig
from specfoundry.kernels.masked_sdpa import masked_sdpa


class PEagleAttention(CompiledElementwise):
    """q/k/v read `width` (2H in layer 0, H after); GQA; RoPE as the target's."""

    def __init__(self, cfg: PEagleConfig, width: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(width, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask: torch.Tensor | BlockMask | None = None, cache: StaticKVCache | None = None,
                layer: int = 0):
        """x [B, T, width] -> [B, T, H]: under `mask` ([B, 1, T, T] bool or a BlockMask, training), or
        over the decoding core's static cache (decoding: the keys written at cache.columns as layer
        `layer`'s, mask [1, 1, T, C] over every column)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = self.elementwise(apply_rotary_pos_emb, q, k, cos, sin)
        gqa = self.nh != self.nkv
        if cache is not None:
            keys, values = cache.update(k, v, layer)  # [1, nkv, C, hd]
            return self.o_proj(grouped_attention(q, keys, values, mask).transpose(1, 2).reshape(b, t, self.nh * self.hd))
        if isinstance(mask, BlockMask):
            from specfoundry.kernels.tree_attention import compiled_flex

            out = compiled_flex(dynamic=True)(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = masked_sdpa(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


def mlp(cfg: PEagleConfig) -> nn.ModuleDict:
    h = cfg.hidden_size
    return nn.ModuleDict({"gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                          "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                          "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False)})


class PEagleLayer(CompiledElementwise):
    """Layer 0 (first=True): EAGLE-3's, over [norm(embed), norm(hidden)], the residual the incoming
    hidden (vLLM's norm_before_residual false). Later layers: a pre-norm Llama layer."""

    def __init__(self, cfg: PEagleConfig, first: bool):
        super().__init__()
        h = cfg.hidden_size
        self.first = first
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = PEagleAttention(cfg, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = mlp(cfg)

    def forward(self, hidden, embeds, attend):
        """hidden [B, T, H] (layer 0: fc's output; else the previous layer's), embeds [B, T, H] (layer 0
        only); attend: x -> attention output. Returns the pre-norm state [B, T, H]."""
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)
        r = attend(self.self_attn, x) + hidden
        y = self.post_attention_layernorm(r)
        return self.mlp["down_proj"](self.elementwise(swiglu, self.mlp["gate_proj"](y), self.mlp["up_proj"](y))) + r


class PEagleDraft(nn.Module):
    def __init__(self, cfg: PEagleConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, h)  # the target's (engines share it)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, h, bias=False)
        # the features of a mask slot, in the captured space (fc projects it): vLLM's mask_hidden [1, 3*Ht]
        self.mask_hidden = nn.Parameter(torch.randn(1, cfg.num_aux * cfg.target_hidden_size))
        self.layers = nn.ModuleList(PEagleLayer(cfg, first=i == 0) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rope = DraftRotary(cfg)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3*Ht] -> fc(aux) [B, T, H]."""
        return self.fc(aux)

    def mask_state(self) -> torch.Tensor:
        """fc(mask_hidden) [H]: the hidden input of every mask slot."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype))[0]

    def states(self, input_ids, hidden, positions, attend) -> torch.Tensor:
        """The normed final states [B, T, H] of tokens input_ids [B, T] with hidden inputs [B, T, H]."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(hidden, positions)
        s = hidden
        for i, layer in enumerate(self.layers):
            s = layer(s, embeds, lambda attn, x, i=i: attend(i, attn, x, cos, sin))
        return self.norm(s)

    def train_forward(self, input_ids, hidden, positions, mask) -> torch.Tensor:
        """A packed training row (families/peagle/loss.py): normed states [B, P, H] under `mask`
        (mask.py's, [B, 1, P, P] bool or a BlockMask)."""
        return self.states(input_ids, hidden, positions, lambda i, attn, x, cos, sin: attn(x, cos, sin, mask=mask))

    def decode_forward(self, input_ids, hidden, positions, cache: StaticKVCache, mask: torch.Tensor) -> torch.Tensor:
        """New tokens written into the decoding core's static cache at cache.columns, each seeing what
        mask [1, 1, T, C] says (sf-eval): normed states [1, T, H]."""
        return self.states(input_ids, hidden, positions,
                           lambda i, attn, x, cos, sin: attn(x, cos, sin, mask=mask, cache=cache, layer=i))

    def compile_elementwise(self, on: bool = True) -> PEagleDraft:
        """Run RMSNorm, SwiGLU and RoPE through torch.compile on GPU tensors (training)."""
        return set_compiled_elementwise(self, on)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]
