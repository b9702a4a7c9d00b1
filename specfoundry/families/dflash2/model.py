"""The DFlash2 draft: the DFlash draft (families/dflash/model.py) with a grouped dynamic causal
convolution around each sublayer (conv.py) and a candidate selector (selector.py), as SGLang and
vLLM serve `DFlash2DraftModel` and SpecForge trains it. Pure math.

Per layer, after each pre-norm and inside the residual (every engine's Qwen3DFlashDecoderLayer):
    x, k = attention_conv.prepare(input_layernorm(h));  h = h + attention_conv.finish(attn(x), k)
    y, k = mlp_conv.prepare(post_attention_layernorm(h)); h = h + mlp_conv.finish(mlp(y), k)
The attention's block keys and values come from the convolved x; the context's are DFlash's
(hidden_norm(fc(aux)), untouched). Labels are DFlash's: slot t (1 <= t < B) of [x_a, M, ..., M]
predicts x_{a+t}. Its unary logits are DFlash's, z_t W^T with the target's lm_head (block_logits);
the selector rescores their top K after the slot's predecessor. Both convolutions start as the
identity, so a fresh DFlash2 draft's states are its DFlash backbone's, bit for bit.
"""

from __future__ import annotations

import torch

from specfoundry.families.dflash.model import DFlashDecoderLayer, DFlashDraft
from specfoundry.families.dflash2.config import DFlash2Config
from specfoundry.families.dflash2.conv import GroupedDynamicCausalConv
from specfoundry.families.dflash2.selector import CandidateSelector


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg: DFlash2Config, layer_idx: int):
        super().__init__(cfg, layer_idx)
        shape = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        self.attention_conv = GroupedDynamicCausalConv(*shape)
        self.mlp_conv = GroupedDynamicCausalConv(*shape)

    def forward(self, h: torch.Tensor, attend) -> torch.Tensor:
        """h [b, S, H] block states (S: whole blocks) -> [b, S, H]; each sublayer inside its convolution."""
        x, kernel = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(attend(self.self_attn, x), kernel)
        y, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp_forward(y), kernel)


class DFlash2Draft(DFlashDraft):
    layer_class = DFlash2DecoderLayer
    plain_head = True
    """The unary logits are the target's lm_head over the states, DFlash's: the loss keeps DFlash's
    hand-written chunked gradient for them; the selector's term goes through autograd."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def candidate_scores(self, states: torch.Tensor, head: torch.Tensor, predecessors: torch.Tensor):
        """(scores [R, K] fp32, candidates [R, K]) of slot states [R, H] after tokens predecessors [R]:
        the selector over the top K of the unary logits (teacher-forced: the true previous tokens)."""
        unary, ids = self.candidate_selector.candidates(self.base_logits(states, head))
        return self.candidate_selector.score(unary, ids, states, predecessors), ids

    def block_lattice(self, states: torch.Tensor, head: torch.Tensor, anchor: torch.Tensor):
        """(lattice [L, K, K] fp32, candidates [L, K]) of one block's slots 1..B-1, states [L, H],
        after the anchor [1] (selector.py lattice)."""
        unary, ids = self.candidate_selector.candidates(self.base_logits(states, head))
        return self.candidate_selector.lattice(unary, ids, states, anchor), ids


def selector_parameters(draft: DFlash2Draft) -> list[torch.nn.Parameter]:
    return list(draft.candidate_selector.parameters())


__all__ = ["DFlash2Draft", "selector_parameters"]
