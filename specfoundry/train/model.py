"""The EAGLE-3 draft exactly as SGLang serves it (`LlamaForCausalLMEagle3`), pure math.

    h0        = fc(aux)                          aux: [B, T, 3*Ht] target layers (step 0 only)
    x         = cat(input_norm(embed(ids)), hidden_norm(h))       [B, T, 2H]
    r1        = o_proj(attention(q/k/v_proj(x))) + h              residual is the incoming hidden
    r2        = mlp(post_attention_norm(r1)) + r1                 SwiGLU
    logits    = lm_head(norm(r2))                                 [B, T, Vd]
r2 (the pre-norm state) is what the next draft step receives as its hidden input.
Parallelism and checkpoints live elsewhere (train/loop.py). With `fuse_elementwise(True)` (the
trainer on a GPU) the chains of small elementwise ops (RMSNorm, SwiGLU, RoPE) run through
torch.compile, which fuses each chain and its backward into a kernel or two: in eager mode they
are ~8 memory passes each over [T, H..I] activations, per TTT step, forward and backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specfoundry.kernels.tree_attention import eager_tree_attention, tree_attention
from specfoundry.train.config import DraftConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), in fp32, rounded once to x's dtype (as SGLang's fused kernel does;
    an fp32 master weight under autocast would otherwise make the output fp32)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def compiled_on_cuda(fn):
    """fn(*args), through torch.compile when the first argument is on a GPU, else plain. The
    compiled function is made on first GPU use (making it imports inductor, over a second on a
    CPU-only run that never needs it); shapes that change become dynamic after the second."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args)

    return call


FUSED = {fn: compiled_on_cuda(fn) for fn in (rms_norm, swiglu, apply_rotary_pos_emb)}


class Fusable(nn.Module):
    """A module whose elementwise chains may run compiled (`fused`, set by fuse_elementwise)."""

    fused = False

    def call(self, fn, *args):
        return FUSED[fn](*args) if self.fused else fn(*args)


class RMSNorm(Fusable):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(rms_norm, x, self.weight, self.eps)


class KVCache:
    """The draft's keys/values for decoding one sequence at a time (sf-eval).

    A chain of proposals is appended and then cropped back to the accepted prefix, so every
    cached key is a real token with real target features, as in training's step-0 block.
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None  # [B, nkv, L, hd]
        self.values: torch.Tensor | None = None
        self.next_mask: torch.Tensor | None = None  # [new, L] bool for the next append only (trees)

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def mask_for(self, new: int, device) -> torch.Tensor:
        """[new, L] bool: every cached key, and the new tokens causally among themselves; or the
        mask set in `next_mask` (a token tree's nodes see only their ancestors), used once."""
        if self.next_mask is not None:
            mask, self.next_mask = self.next_mask, None
            assert mask.shape == (new, len(self)), (mask.shape, new, len(self))
            return mask
        past = len(self) - new
        j = torch.arange(len(self), device=device)
        i = torch.arange(new, device=device)[:, None]
        return j[None, :] <= past + i

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


class TTTCache:
    """What the steps of one Training-Time Test pass share: the earlier steps' keys and values,
    and the q/k/v projection weight concatenated once for all of them.

    One GEMM [T, 2H] x [2H, (nh + 2 nkv) hd] per step instead of three, and in backward one dX
    GEMM instead of three whose outputs two [T, 2H] adds then sum. On an H200, 8B draft shape:
    0.98x the attention block's time at T=4096 for 0.08 GiB more peak, the weight's copy and its
    gradient (benchmarks/results/attention_breakdown_final.json; 0.93-0.98x at T=2048-8192 with
    the weight concatenated beforehand, attention_breakdown.json). Concatenating once per pass,
    not per step, keeps the copy (and its backward, the split of the weight gradient) to one per
    training step; the parameters stay q/k/v_proj, SGLang's names.
    """

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: k, v [B, nkv, T, hd]
        self.qkv_weight: torch.Tensor | None = None  # [(nh + 2 nkv) hd, 2H]

    def fused_qkv(self, attn: Eagle3Attention) -> torch.Tensor:
        if self.qkv_weight is None:
            self.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        return self.qkv_weight


class Eagle3Attention(Fusable):
    """q/k/v read the 2H-wide concat; GQA; RoPE as the target's."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)

    def forward(self, x, cos, sin, cache: TTTCache | KVCache, lengths, step: int, attention: str) -> torch.Tensor:
        """cache: the TTT pass's TTTCache in training, or a KVCache when decoding."""
        b, t, _ = x.shape
        if isinstance(cache, KVCache):  # decoding: separate weights, no per-call concatenation
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = F.linear(x, cache.fused_qkv(self)).split([self.nh * self.hd, self.nkv * self.hd,
                                                                self.nkv * self.hd], dim=-1)
            # v's own copy [B, T, nkv*hd]: as a view it would keep the whole [B, T, (nh + 2 nkv) hd]
            # output alive in the cache for every later step (+0.27 GiB at T=4096 on the 8B shape)
            v = v.contiguous()
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = self.call(apply_rotary_pos_emb, q, k, cos, sin)
        if isinstance(cache, KVCache):  # inference (sf-eval): new tokens after a cached prefix
            keys, values = cache.append(k, v)  # [B, nkv, L+T, hd]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask_for(t, q.device),
                                                 enable_gqa=self.nh != self.nkv)
        else:
            cache.kv.append((k, v))
            keys = torch.cat([c[0] for c in cache.kv], dim=2)  # [B, nkv, T*(step+1), hd]
            values = torch.cat([c[1] for c in cache.kv], dim=2)
            if attention == "eager":
                out = eager_tree_attention(q, keys, values, lengths, step)
            else:
                out = tree_attention(q, keys, values, lengths, step,
                                     backend={"flex": "flex", "sdpa": "sdpa"}.get(attention, "auto"))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class Eagle3DecoderLayer(Fusable):
    def __init__(self, cfg: DraftConfig):
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

    def forward(self, embeds, hidden, cos, sin, cache, lengths, step, attention):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        r1 = self.self_attn(x, cos, sin, cache, lengths, step, attention) + hidden
        y = self.post_attention_layernorm(r1)
        mlp = self.mlp["down_proj"](self.call(swiglu, self.mlp["gate_proj"](y), self.mlp["up_proj"](y)))
        return mlp + r1  # [B, T, H] pre-norm state


class FrozenEmbedding(nn.Module):
    """The target's token embeddings, frozen. A buffer, not a parameter, so that FSDP/ZeRO never
    puts it into the sharded flat parameter: there it filled whole ranks' shares (it is half of
    an 8B draft's weights) and left the Adam state of the trainable weights on the others."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        # N(0, 1) as nn.Embedding initialises (same values, same RNG use) until the target's are copied in
        self.register_buffer("weight", nn.init.normal_(torch.empty(vocab_size, hidden_size)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, h)  # copied from the target
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        rope = LlamaConfig(hidden_size=h, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                           rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                           max_position_embeddings=cfg.max_position_embeddings)
        self.rotary = LlamaRotaryEmbedding(rope)

    def step(self, input_ids, hidden, positions, cache: TTTCache | KVCache, lengths, step: int, attention: str = "auto"):
        """One draft step. input_ids, positions: [B, T]; hidden: [B, T, H] (fc(aux) at step 0,
        else the previous step's pre-norm state). Returns (pre-norm [B, T, H], normed [B, T, H])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, positions)
        pre = self.midlayer(embeds, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), cache, lengths, step, attention)
        return pre, self.norm(pre)

    def fuse_elementwise(self, on: bool = True) -> Eagle3Draft:
        """Run RMSNorm, SwiGLU and RoPE through torch.compile on GPU tensors (training); off by
        default, so that decoding (sf-eval) compiles nothing."""
        for m in self.modules():
            if isinstance(m, Fusable):
                m.fused = on
        return self

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]
