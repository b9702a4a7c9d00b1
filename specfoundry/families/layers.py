"""Building blocks every draft family uses: RMSNorm, SwiGLU, the frozen target embedding, and the
switch that runs their elementwise chains through torch.compile on a GPU.

With `compiled_elementwise` on (the trainer on a GPU) the chains of small elementwise ops
(RMSNorm, SwiGLU, RoPE) run through torch.compile, which fuses each chain and its backward into a
kernel or two instead of one memory pass over [T, H..I] activations per op.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), in fp32, rounded once to x's dtype (as SGLang's fused kernel does;
    an fp32 master weight under autocast would otherwise make the output fp32)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def compiled_on_cuda(fn):
    """fn(*args), through torch.compile when the first argument is on a GPU, else plain. The
    compiled function is made on first GPU use (making it imports inductor, which a CPU-only run
    never needs); shapes that change become dynamic after the second."""
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


COMPILED_ELEMENTWISE = {fn: compiled_on_cuda(fn) for fn in (rms_norm, swiglu, apply_rotary_pos_emb)}


class CompiledElementwise(nn.Module):
    """A module whose elementwise chains may run compiled (`compiled_elementwise`, set for the
    whole draft by set_compiled_elementwise)."""

    compiled_elementwise = False

    def elementwise(self, fn, *args):
        """fn(*args), compiled where the switch is on: fn is one of COMPILED_ELEMENTWISE's, or a
        family's own chain (DFlash2's convolution), given its compiled form at its first use."""
        if not self.compiled_elementwise:
            return fn(*args)
        if fn not in COMPILED_ELEMENTWISE:
            COMPILED_ELEMENTWISE[fn] = compiled_on_cuda(fn)
        return COMPILED_ELEMENTWISE[fn](*args)


class RMSNorm(CompiledElementwise):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.elementwise(rms_norm, x, self.weight, self.eps)


class FrozenEmbedding(nn.Module):
    """The target's token embeddings, frozen. A buffer, not a parameter, so that FSDP/ZeRO never
    puts it into the sharded flat parameter: there it would fill whole ranks' shares (it is half
    of an 8B draft's weights) and leave the Adam state of the trainable weights on the others.

    Not persistent: outside the state dict, so sf-train's checkpoints do not hold a copy of the
    target's embeddings (4 bytes for each of vocab x hidden values: 49,152 x 576 for SmolLM2,
    128,256 x 8,192 for a Llama-3-70B draft). Every draft is built with them copied from the
    target (the families' build, folders.load_draft), and no export writes them. A state dict
    that holds them (a checkpoint written before) still loads: the copy is dropped, being the
    target's own."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        # N(0, 1) as nn.Embedding initialises (same values, same RNG use) until the target's are copied in
        self.register_buffer("weight", nn.init.normal_(torch.empty(vocab_size, hidden_size)), persistent=False)
        self._register_load_state_dict_pre_hook(drop_stored_embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def drop_stored_embedding(state_dict, prefix, *args) -> None:
    """A load_state_dict pre-hook of FrozenEmbedding: an older checkpoint's copy of the target's
    embeddings is dropped, not reported as an unexpected key."""
    state_dict.pop(prefix + "weight", None)


def compiles_elementwise(model: nn.Module) -> bool:
    """Whether set_compiled_elementwise turned `model`'s chains on (a loss then compiles its own)."""
    return any(m.compiled_elementwise for m in model.modules() if isinstance(m, CompiledElementwise))


def set_compiled_elementwise(model: nn.Module, on: bool) -> nn.Module:
    """Run the elementwise chains of every CompiledElementwise module of `model` compiled (on) or
    plain; off by default, so that decoding (sf-eval) compiles nothing."""
    for m in model.modules():
        if isinstance(m, CompiledElementwise):
            m.compiled_elementwise = on
    return model


class DraftRotary(nn.Module):
    """The draft's RoPE, the target's (theta, scaling, head_dim); cos and sin in the states' dtype."""

    def __init__(self, cfg):
        super().__init__()
        rope = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                           head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                           max_position_embeddings=cfg.max_position_embeddings)
        self.rotary = LlamaRotaryEmbedding(rope)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, hd] for positions [B, T]."""
        cos, sin = self.rotary(hidden, positions)
        return cos.to(hidden.dtype), sin.to(hidden.dtype)
