"""Domino in sf-eval: DFlash's block decoding (families/dflash/block.py) with the GRU run over the block's
own proposals, one token at a time, as SGLang's domino_greedy_rollout does
(python/sglang/srt/speculative/domino_utils.py).

A round after the bonus b at position p: one draft forward over [b, M, ..., M] at p..p+B-1 gives
z_0..z_{B-1}; then for j = 0..B-2
    d_{j+1} = argmax final_j,   final_0 = z_0 W^T,   final_j = z_j W^T + P2(silu(P1([z_j; g_j])))
with g_j = GRU(e(b), e(d_1), ..., e(d_j)), advanced by one GRU step per proposal. The B-1
proposals are verified as DFlash's are (point masses; greedy output equals the target's own)."""

from __future__ import annotations

import torch

from specfoundry.families.dflash.block import BlockDraftRunner
from specfoundry.families.dflash.decode import sequential_first_round, training_block_states
from specfoundry.families.domino.model import DominoDraft


class DominoRunner(BlockDraftRunner):
    """BlockDraftRunner whose proposals go through the sequential GRU correction."""

    def propose_body(self, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's B-1 proposals after the bonus and their final logits [B-1, V]."""
        draft: DominoDraft = self.draft
        z = self.block_states(bonus)  # [B, H]
        n = self.block_size - 1
        base = draft.base_logits(z[:n], self.lm_head)  # [B-1, V]: one product for the block
        slots = self.slots[:n]
        state = draft.gru_step(bonus.view(1), None)  # g_0: the GRU after e(b)
        # each proposal stays on the device until the block is done: no host sync per slot
        drafts, rows = [], []
        for j in range(n):
            final, _ = draft.corrected_logits(z[j:j + 1], self.lm_head, slots[j:j + 1], state, base=base[j:j + 1])
            d = final[0].argmax()
            drafts.append(d)
            rows.append(final[0].float())
            if j < n - 1:
                state = draft.gru_step(d.view(1), state)  # g_{j+1}
        return torch.stack(drafts), torch.stack(rows)  # [B-1] on the device, [B-1, V]


@torch.inference_mode()
def training_block_logits(draft: DominoDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor,
                          anchor: int) -> torch.Tensor:
    """The training forward's final logits [B-1, V] of slots 0..B-2 of the block anchored at
    `anchor`, the GRU teacher-forced on ids[anchor..anchor+B-2] (ids must reach that far)."""
    cfg, device = draft.cfg, draft.fc.weight.device
    states = training_block_states(draft, ids, aux, anchor)  # [B, H]
    n = cfg.block_size - 1
    tokens = ids[anchor:anchor + n].to(device)
    return draft.block_logits(states[:n], lm_head, torch.arange(n, device=device), tokens).float()


def decode_matches_training(draft: DominoDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """(the first round's final logits after the prompt ids[:-1] and the bonus ids[-1], the training
    forward's at the same anchor teacher-forced on the round's own proposals), [B-1, V] each."""
    return sequential_first_round(DominoRunner(draft, lm_head), lm_head, ids, aux, training_block_logits)
