"""Domino in sf-eval: DFlash's block decoding (eval/block.py) with the GRU run over the block's
own proposals, one token at a time, as SGLang's domino_greedy_rollout does
(python/sglang/srt/speculative/domino_utils.py).

A round after the bonus b at position p: one draft forward over [b, M, ..., M] at p..p+B-1 gives
z_0..z_{B-1}; then for j = 0..B-2
    d_{j+1} = argmax final_j,   final_0 = z_0 W^T,   final_j = z_j W^T + P2(silu(P1([z_j; g_j])))
with g_j = GRU(e(b), e(d_1), ..., e(d_j)), advanced by one GRU step per proposal. The B-1
proposals are verified as DFlash's are (point masses; greedy output equals the target's own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.eval.block import BlockDraftRunner, block_generate
from specfoundry.eval.speculative import DecodeResult, Sampler, TargetRunner
from specfoundry.train.dflash.loss import block_inputs
from specfoundry.train.domino.model import DominoDraft


class DominoRunner(BlockDraftRunner):
    """BlockDraftRunner whose proposals go through the sequential GRU correction."""

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[list[int], torch.Tensor]:
        """The block's B-1 proposals after `bonus` and their final logits [B-1, V]."""
        draft: DominoDraft = self.draft
        p, device = len(self.cache), self.lm_head.device
        ids = torch.full((1, self.block_size), self.mask_token_id, device=device)
        ids[0, 0] = bonus
        positions = torch.arange(p, p + self.block_size, device=device)[None]
        z = draft.decode_block(ids, positions, self.cache)[0]  # [B, H]
        state = draft.gru_step(ids[0, :1], None)  # g_0: the GRU after e(b)
        drafts, rows = [], []
        for j in range(self.block_size - 1):
            final, _ = draft.corrected_logits(z[j:j + 1], self.lm_head, torch.tensor([j], device=device), state)
            d = int(final[0].argmax())
            drafts.append(d)
            rows.append(final[0].float())
            if j < self.block_size - 2:
                state = draft.gru_step(torch.tensor([d], device=device), state)  # g_{j+1}
        return drafts, torch.stack(rows)


@dataclass
class DominoDecoder:
    """One block of block_size - 1 proposals per round."""

    runner: DominoRunner

    def generate(self, target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                 sampler: Sampler) -> DecodeResult:
        return block_generate(target, self.runner, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler)


@torch.inference_mode()
def training_block_logits(draft: DominoDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor,
                          anchor: int) -> torch.Tensor:
    """The training forward's final logits [B-1, V] of slots 0..B-2 of the block anchored at
    `anchor`, the GRU teacher-forced on ids[anchor..anchor+B-2] (ids must reach that far)."""
    cfg = draft.cfg
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    anchors = torch.tensor([[anchor]], device=device)
    block_ids, positions = block_inputs(ids[None].to(device), anchors, cfg.block_size, cfg.mask_token_id)
    context = draft.project_context(aux[None].to(device, dtype))
    keep = torch.ones_like(anchors, dtype=torch.bool)
    states = draft.train_forward(context, block_ids, positions, anchors, keep, [len(ids)], "sdpa")[0]  # [B, H]
    n = cfg.block_size - 1
    tokens = ids[anchor:anchor + n].to(device)
    return draft.block_logits(states[:n], lm_head, torch.arange(n, device=device), tokens).float()


def decode_matches_training(draft: DominoDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """(the first round's final logits after the prompt ids[:-1] and the bonus ids[-1], the training
    forward's at the same anchor teacher-forced on the round's own proposals), [B-1, V] each."""
    p = len(ids) - 1
    runner = DominoRunner(draft, lm_head)
    runner.extend(aux[:p].to(lm_head.device))
    drafts, decoded = runner.propose(int(ids[p]))
    forced = torch.cat([ids[: p + 1].cpu(), torch.tensor(drafts)])  # the sequence the round drafted
    features = torch.cat([aux[: p + 1].cpu(), aux.new_zeros(len(drafts), aux.shape[1]).cpu()])  # unseen after p
    return decoded, training_block_logits(draft, lm_head, forced, features, p)
