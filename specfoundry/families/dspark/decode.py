"""DSpark in sf-eval: DFlash's block decoding (families/dflash/block.py) with the Markov bias applied one slot
at a time, as SGLang's DSpark worker does (python/sglang/srt/models/dspark.py run_markov_block,
speculative/dspark_components/dspark_draft.py).

A round after the bonus b at position p: one draft forward over [b, M, ..., M] at p..p+B-1 gives
z_0..z_{B-1}; then for j = 0..B-1, with u_0 = b and u_j = d_j,
    d_{j+1} = argmax(z_j W^T + P A[u_j])        confidence_j = sigmoid(c^T [z_j; A[u_j]] + c_0)
so a block gives B proposals d_1..d_B (SGLang's gamma = block_size), verified as DFlash's are in
one target forward over [b, d_1..d_B] (point masses; greedy output equals the target's own).

The confidence head is reported, not acted on: every round verifies the whole block, and the
runner keeps each round's B confidences (`confidences`) next to how many proposals the target
accepted, so calibration can be measured; stopping a block early on it is left to a later step.
"""

from __future__ import annotations

import torch

from specfoundry.common.settings import MAX_DRAFT
from specfoundry.families.dflash.block import BlockDraftRunner
from specfoundry.families.dflash.decode import sequential_first_round, training_block_states
from specfoundry.families.dspark.config import DSparkConfig
from specfoundry.families.dspark.model import DSparkDraft


class DSparkRunner(BlockDraftRunner):
    """BlockDraftRunner whose B proposals go through the sequential Markov bias."""

    def __init__(self, draft: DSparkDraft, lm_head: torch.Tensor, *, block_size: int | None = None,
                 graphs: bool | None = None, compiled: bool = False):
        super().__init__(draft, lm_head, block_size=block_size, graphs=graphs, compiled=compiled)
        self.confidences: list[torch.Tensor] = []  # per round, the B predicted acceptance probabilities [B]

    @property
    def proposal_count(self) -> int:
        return self.block_size  # the bonus's slot proposes too

    def reset(self, reserve: int = 0) -> None:
        super().reset(reserve)
        self.confidences = []

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's B proposals after `bonus` and their logits [B, V]; each round's B confidences
        kept (a copy: the captured proposal's buffer is refilled next round)."""
        drafts, rows, confidence = super().propose(bonus)
        self.confidences.append(confidence.clone())  # [B], read after the decode
        return drafts, rows

    def propose_body(self, bonus: torch.Tensor):
        """(the B proposals, their logits [B, V], their predicted acceptance probabilities [B])."""
        draft: DSparkDraft = self.draft
        z = self.block_states(bonus)  # [B, H]
        base = draft.base_logits(z, self.lm_head)  # [B, V]: one product for the block
        prev = bonus.view(1)
        # each proposal stays on the device until the block is done: no host sync per slot
        drafts, rows, confidence = [], [], []
        for j in range(self.block_size):
            logits = draft.with_markov_bias(base[j:j + 1], prev)[0].float()
            confidence.append(draft.confidence_logit(z[j:j + 1], prev)[0])
            d = logits.argmax()
            drafts.append(d)
            rows.append(logits)
            prev = d.view(1)
        return torch.stack(drafts), torch.stack(rows), torch.sigmoid(torch.stack(confidence).float())


def decode_settings(cfg: DSparkConfig, *, k: int, tree, k_given: bool, source: str):
    """(k, no tree, no warning): a block of B proposes B tokens; -k serves a block of k <= B (SGLang's
    --speculative-dspark-block-size), else the trained block."""
    if tree:
        raise ValueError(f"--tree drafts EAGLE-3 token trees; {source} is a DSpark draft, which proposes blocks of "
                         f"{cfg.block_size}")
    if k_given and not 1 <= k <= cfg.block_size:
        raise ValueError(f"-k {k}: DSpark draft {source} proposes a block of 1 to its trained {cfg.block_size} "
                         "tokens a round")
    served = k if k_given else cfg.block_size
    if served > MAX_DRAFT:
        raise ValueError(f"{source} is a DSpark draft of blocks of {served} proposals; sf-eval decodes at most "
                         f"{MAX_DRAFT} (-k serves a smaller block)")
    return served, None, None


@torch.inference_mode()
def training_block_logits(draft: DSparkDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor,
                          anchor: int) -> torch.Tensor:
    """The training forward's logits [B, V] of the block anchored at `anchor`, the Markov bias
    teacher-forced on ids[anchor..anchor+B-1] (ids must reach that far)."""
    cfg, device = draft.cfg, draft.fc.weight.device
    states = training_block_states(draft, ids, aux, anchor)  # [B, H]
    b = cfg.block_size
    tokens = ids[anchor:anchor + b].to(device)
    return draft.block_logits(states, lm_head, torch.arange(b, device=device), tokens).float()


def decode_matches_training(draft: DSparkDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """(the first round's logits after the prompt ids[:-1] and the bonus ids[-1], the training
    forward's at the same anchor teacher-forced on the round's own proposals), [B, V] each."""
    return sequential_first_round(DSparkRunner(draft, lm_head), lm_head, ids, aux, training_block_logits)
