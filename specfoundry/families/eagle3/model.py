"""The EAGLE-3 draft exactly as SGLang serves it (`LlamaForCausalLMEagle3`), pure math.

    h0        = fc(aux)                          aux: [B, T, 3*Ht] target layers (step 0 only)
                (EAGLE-3.1 fc_norm: fc(cat(fc_norm_0(a_0), fc_norm_1(a_1), fc_norm_2(a_2))), a norm per layer)
    x         = cat(input_norm(embed(ids)), hidden_norm(h))       [B, T, 2H]
    r1        = o_proj(attention(q/k/v_proj(x))) + h              residual is the incoming hidden
    r2        = mlp(post_attention_norm(r1)) + r1                 SwiGLU
    logits    = lm_head(norm(r2))                                 [B, T, Vd]
r2 (the pre-norm state) is what the next draft step receives as its hidden input; with the
EAGLE-3.1 option norm_output it receives norm(r2) instead (the state the logits are taken from).
Two forwards share these weights: `ttt_forward` (training: one Training-Time Test step over whole
sequences, attending through the tree mask to the earlier steps' keys) and `decode_forward`
(sf-eval: new tokens after a KV cache). Parallelism and checkpoints live elsewhere
(train/trainer.py); the building blocks shared with other families, in families/layers.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specfoundry.decoding.attention import grouped_attention
from specfoundry.decoding.cache import StaticKVCache
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.layers import (
    CompiledElementwise,
    DraftRotary,
    FrozenEmbedding,
    RMSNorm,
    set_compiled_elementwise,
    swiglu,
)
from specfoundry.kernels.tree_attention import eager_tree_attention, tree_attention


class TTTCache:
    """What the steps of one Training-Time Test pass share: the earlier steps' keys and values,
    and the q/k/v projection weight concatenated once for all of them.

    One GEMM [T, 2H] x [2H, (nh + 2 nkv) hd] per TTT step instead of three, and in backward one
    dX GEMM instead of three whose outputs two [T, 2H] adds then sum; the price is the weight's
    copy and its gradient. Concatenating once per pass, not per TTT step, keeps the copy (and its
    backward, the split of the weight gradient) to one per optimizer step; the parameters stay
    q/k/v_proj, SGLang's names.
    """

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per TTT step: k, v [B, nkv, T, hd]
        self.qkv_weight: torch.Tensor | None = None  # [(nh + 2 nkv) hd, 2H]

    def concatenated_qkv(self, attn: Eagle3Attention) -> torch.Tensor:
        if self.qkv_weight is None:
            self.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        return self.qkv_weight


class Eagle3Attention(CompiledElementwise):
    """q/k/v read the 2H-wide concat; GQA; RoPE as the target's. Two entry points, one per use:
    `ttt_attention` (training) and `decode_attention` (sf-eval)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)

    def heads(self, q, k, v, cos, sin):
        """[B, T, n*hd] projections -> q [B, nh, T, hd], k and v [B, nkv, T, hd], RoPE on q and k."""
        b, t, _ = q.shape
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = self.elementwise(apply_rotary_pos_emb, q, k, cos, sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, nh, T, hd] attention output -> [B, T, H]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))

    def ttt_attention(self, x, cos, sin, cache: TTTCache, lengths, ttt_step: int, attention: str) -> torch.Tensor:
        """TTT step `ttt_step` over whole sequences x [B, T, 2H]: its keys join the cache, and the
        tree mask lets it see step 0's prefix and its own branch of the earlier steps."""
        q, k, v = F.linear(x, cache.concatenated_qkv(self)).split([self.nh * self.hd, self.nkv * self.hd,
                                                                    self.nkv * self.hd], dim=-1)
        # v's own copy [B, T, nkv*hd]: as a view it would keep the whole [B, T, (nh + 2 nkv) hd]
        # output alive in the cache for every later TTT step
        q, k, v = self.heads(q, k, v.contiguous(), cos, sin)
        cache.kv.append((k, v))
        keys = torch.cat([c[0] for c in cache.kv], dim=2)  # [B, nkv, T*(ttt_step+1), hd]
        values = torch.cat([c[1] for c in cache.kv], dim=2)
        if attention == "eager":
            out = eager_tree_attention(q, keys, values, lengths, ttt_step)
        else:
            out = tree_attention(q, keys, values, lengths, ttt_step,
                                 backend={"flex": "flex", "sdpa": "sdpa"}.get(attention, "auto"))
        return self.output(out)

    def decode_attention(self, x, cos, sin, cache: StaticKVCache, mask: torch.Tensor) -> torch.Tensor:
        """New tokens x [1, T, 2H] written into the static cache at its `columns`, attending over every
        column as mask [1, 1, T, C] (bool) says (sf-eval's decoding core: families/eagle3/chain.py)."""
        q, k, v = self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)
        keys, values = cache.update(k, v, 0)  # [1, nkv, C, hd]
        return self.output(grouped_attention(q, keys, values, mask))


class Eagle3DecoderLayer(CompiledElementwise):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False),
        })

    def forward(self, embeds, hidden, attend):
        """attend: x [B, T, 2H] -> [B, T, H], the attention of training or of decoding."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        r1 = attend(x) + hidden
        y = self.post_attention_layernorm(r1)
        mlp = self.mlp["down_proj"](self.elementwise(swiglu, self.mlp["gate_proj"](y), self.mlp["up_proj"](y)))
        return mlp + r1  # [B, T, H] pre-norm state


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, h)  # copied from the target
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, h, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rope = DraftRotary(cfg)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, K*Ht] (the captured layers, concatenated) -> fc(aux) [B, T, H], each layer's
        state normed first under fc_norm."""
        if self.cfg.fc_norm:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, dim=-1),
                                                        strict=True)], dim=-1)
        return self.fc(aux)

    def outputs(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state the next draft step receives, the normed state the logits come from)."""
        normed = self.norm(pre)
        return (normed if self.cfg.norm_output else pre), normed

    def ttt_forward(self, input_ids, hidden, positions, cache: TTTCache, lengths, ttt_step: int,
                    attention: str = "auto"):
        """TTT step `ttt_step` of a training pass. input_ids, positions: [B, T]; hidden: [B, T, H]
        (project(aux) at step 0, else the previous TTT step's next-step state); lengths: the rows'
        real lengths. Returns (next-step state [B, T, H], normed [B, T, H])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(hidden, positions)
        attn = self.midlayer.self_attn
        pre = self.midlayer(embeds, hidden,
                            lambda x: attn.ttt_attention(x, cos, sin, cache, lengths, ttt_step, attention))
        return self.outputs(pre)

    def decode_forward(self, input_ids, hidden, positions, cache: StaticKVCache, mask: torch.Tensor):
        """New tokens after the decoding core's static cache (sf-eval): input_ids, positions [1, T]; hidden
        [1, T, H]; the keys go to cache.columns and mask [1, 1, T, C] says what each token sees.
        Returns (next-step state [1, T, H], normed [1, T, H])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(hidden, positions)
        attn = self.midlayer.self_attn
        pre = self.midlayer(embeds, hidden, lambda x: attn.decode_attention(x, cos, sin, cache, mask))
        return self.outputs(pre)

    def compile_elementwise(self, on: bool = True) -> Eagle3Draft:
        """Run RMSNorm, SwiGLU and RoPE through torch.compile on GPU tensors (training)."""
        return set_compiled_elementwise(self, on)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]
