"""The DSpark draft: the DFlash draft (families/dflash/model.py) plus a low-rank Markov head and a
confidence head, as SGLang serves it (python/sglang/srt/models/dspark.py: VanillaMarkov,
DSparkConfidenceHead; speculative/dspark_components/dspark_confidence.py) and SpecForge trains it
(specforge/modeling/draft/dspark.py). Pure math.

Labels come from the anchor: block slot j (0 <= j < B) of the block [x_a, M, ..., M] at positions
a..a+B-1 predicts x_{a+j+1} (every slot predicts; DFlash's slot 0 predicts nothing). The slot's
previous token is u_j = x_{a+j}: the anchor for slot 0, then the token slot j-1 predicts (the true
one in training, the slot's own proposal in decoding). With z_j the DFlash stack's final-normed
state, W the target's lm_head [V, H], A = markov_w1 [V, R], P = markov_w2 [V, R]:
    logits_j     = z_j W^T + P A[u_j]                                         [V]
    confidence_j = sigmoid(c^T [z_j; A[u_j]] + c_0)    (c: confidence_head.proj, [1, H + R])
(without confidence_with_markov, c reads z_j alone). The bias makes decoding sequential within
the block: slot j's proposal needs slot j-1's (decode.py). P starts at zero, so a fresh DSpark
draft is its DFlash backbone with shifted labels.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dspark.config import DSparkConfig


class MarkovHead(nn.Module):
    """SGLang's VanillaMarkov: the previous token's low-rank logit bias, markov_w2(markov_w1(u))."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [R] token ids -> bias [R, V]."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """SGLang's DSparkConfidenceHead: one linear unit with a bias; its sigmoid is the predicted
    probability that the slot's proposal is accepted."""

    def __init__(self, inputs: int):
        super().__init__()
        self.proj = nn.Linear(inputs, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDraft(DFlashDraft):
    plain_head = False
    """The Markov head has parameters: the loss goes through autograd (families/dspark/loss.py)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = ConfidenceHead(cfg.confidence_inputs)

    def step_logits(self, states: torch.Tensor, head: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of states [R, H] whose previous tokens are prev [R]: z W^T + P A[u]."""
        return self.with_markov_bias(self.base_logits(states, head), prev)

    def with_markov_bias(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """base_logits [R, V] plus the Markov bias of the previous tokens prev [R]: + P A[u]."""
        return base + self.markov_head(prev).to(base.dtype)

    def confidence_logit(self, states: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [R] (before the sigmoid) of states [R, H] after tokens prev [R]."""
        features = states
        if self.cfg.confidence_with_markov:
            features = torch.cat([states, self.markov_head.markov_w1(prev).to(states.dtype)], dim=-1)
        return self.confidence_head(features)

    def block_logits(self, states: torch.Tensor, head: torch.Tensor, slots: torch.Tensor | None = None,
                     tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, V] of states [R, H]; slots [R]: each row's block slot j (it predicts x_{a+j+1};
        None: slots 0..R-1 of one block); tokens [R, B] (or [B] for one block): x_a, x_{a+1}, ... of
        each row's block (teacher-forced): slot j's previous token is tokens[:, j]."""
        rows = states.shape[0]
        if slots is None:
            slots = torch.arange(rows, device=states.device)
        assert tokens is not None, "DSpark's logits read each slot's previous token"
        if tokens.dim() == 1:
            tokens = tokens[None].expand(rows, -1)
        prev = tokens[torch.arange(rows, device=states.device), slots]
        return self.step_logits(states, head, prev)


def head_parameters(draft: DSparkDraft) -> list[nn.Parameter]:
    """The heads' own parameters (markov_head, confidence_head)."""
    return [*draft.markov_head.parameters(), *draft.confidence_head.parameters()]


__all__ = ["DSparkDraft", "head_parameters"]
