"""The Domino draft: the DFlash draft (families/dflash/model.py) plus a prefix GRU and a residual
logit correction, as SGLang serves it (DFlashDraftModel with dflash_config.projector_type "domino":
python/sglang/srt/speculative/domino_utils.py domino_greedy_rollout; SpecForge's
specforge/modeling/draft/domino.py trains the same head). Pure math.

Labels are shifted: block slot j (0 <= j < B) of the block [x_a, M, ..., M] at positions
a..a+B-1 predicts x_{a+j+1}, so every slot predicts (DFlash's slot 0 predicts nothing). With
z_j the DFlash stack's final-normed state of slot j, W the target's lm_head [V, H], e(t) the
target's embedding of token t and
    g_j     = GRU(e(x_a), e(x_{a+1}), ..., e(x_{a+j}))         [G]  the state after slot j's prefix
    base_j  = z_j W^T                                           [V]
    final_j = base_j                                            j < 1 (pure_draft_prefix_len = 1)
    final_j = base_j + P2(silu(P1([z_j; g_j])))                 j >= 1
P1 = embed_proj.0 [E, H + G], P2 = embed_proj.2 [V, E], GRU without biases (weight_ih [3G, H],
weight_hh [3G, G]). In training x_{a+1..} are the sample's tokens (teacher forcing); in decoding
they are the block's own proposals, so the GRU runs one token at a time (decode.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.domino.config import PURE_DRAFT_PREFIX_LEN, DominoConfig


class DominoDraft(DFlashDraft):
    plain_head = False
    """The correction has parameters: the loss goes through autograd (families/domino/loss.py)."""

    def __init__(self, cfg: DominoConfig):
        super().__init__(cfg)
        h, g, e = cfg.hidden_size, cfg.gru_hidden_dim, cfg.emb_dim
        self.prefix_gru = nn.GRU(h, g, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(h + g, e, bias=False), nn.SiLU(), nn.Linear(e, cfg.vocab_size,
                                                                                              bias=False))

    def prefix_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [R, L] -> g [R, L, G]: g[:, j] is the GRU state after e(tokens[:, 0..j])."""
        x = self.embed_tokens(tokens).to(self.prefix_gru.weight_ih_l0.dtype)
        return self.prefix_gru(x)[0]

    def gru_step(self, token: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """One more token [R] into the GRU state [R, G] (None: the empty prefix) -> [R, G]."""
        x = self.embed_tokens(token[:, None]).to(self.prefix_gru.weight_ih_l0.dtype)
        return self.prefix_gru(x, None if state is None else state[None].contiguous())[0][:, -1]

    def corrected_logits(self, states: torch.Tensor, head: torch.Tensor, slots: torch.Tensor,
                         prefix: torch.Tensor, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(final, base) logits [R, V] of states [R, H] at block slots [R] with GRU states prefix
        [R, G] (read where slot >= PURE_DRAFT_PREFIX_LEN only); base: the rows' base_logits when
        already computed (decoding takes a whole block's in one product)."""
        if base is None:
            base = self.base_logits(states, head)
        return self.corrected(base, self.correction_features(states, prefix), slots), base

    def correction_features(self, states: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """silu(P1 [z; g]) [R, E] of states [R, H] and GRU states prefix [R, G]: what P2 reads."""
        return self.embed_proj[1](self.embed_proj[0](torch.cat([states, prefix.to(states.dtype)], dim=-1)))

    def corrected(self, base: torch.Tensor, features: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """final [R, V] = base + P2 features where slot >= PURE_DRAFT_PREFIX_LEN, else base."""
        correction = self.embed_proj[2](features)
        on = (slots >= PURE_DRAFT_PREFIX_LEN)[:, None]
        return base + torch.where(on, correction, torch.zeros_like(correction))

    def block_logits(self, states: torch.Tensor, head: torch.Tensor, slots: torch.Tensor | None = None,
                     tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final logits [R, V] of states [R, H]; slots [R]: each row's block slot j (it predicts
        x_{a+j+1}; None: slots 0..R-1 of one block); tokens [R, B] (or [B] for one block): x_a,
        x_{a+1}, ... of each row's block, teacher-forced (the GRU reads tokens[:, :j+1])."""
        rows = states.shape[0]
        if slots is None:
            slots = torch.arange(rows, device=states.device)
        assert tokens is not None, "Domino's logits read the block's tokens before each slot"
        if tokens.dim() == 1:
            tokens = tokens[None].expand(rows, -1)
        prefix = self.prefix_states(tokens[:, : int(slots.max()) + 1])  # [R, j_max + 1, G]
        g = prefix[torch.arange(rows, device=states.device), slots]
        return self.corrected_logits(states, head, slots, g)[0]


def correction_parameters(draft: DominoDraft) -> list[nn.Parameter]:
    """The head's own parameters (prefix_gru, embed_proj)."""
    return [*draft.prefix_gru.parameters(), *draft.embed_proj.parameters()]


__all__ = ["DominoDraft", "correction_parameters"]
