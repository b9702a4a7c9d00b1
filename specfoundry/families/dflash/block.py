"""DFlash's block decoding: one draft forward proposes a block, the target verifies it in one
forward (decoding/rounds.py decode_rounds, one sequence).

Notation: p tokens t_0..t_{p-1} have been read by the target; the bonus b = t_p is the target's
own choice after them, not read yet. Invariants at the start of a round:
    target KV cache   positions 0..p-1
    draft context     positions 0..p-1: hidden_norm(fc(a_i)), a_i = the target's features at i
                      (concatenated layers), as keys and values in every draft layer
A round:
    1. propose  one draft forward over the block [b, M, ..., M] (M the mask token, B positions
                p..p+B-1, bidirectional within the block, seeing all of the context); slot j
                (1 <= j < B) proposes d_j = argmax of the draft's logits there (block_logits: the
                target's lm_head over its state), the token at p+j.
    2. verify   the target reads [b, d_1..d_{B-1}] at positions p..p+B-1 in one forward; row r of
                its logits predicts the token at p+r+1.
    3. accept   greedy: the longest prefix with d_j == argmax(row j-1); sampling: the draft's
                proposal is a point mass q = 1 at d_j, so the rejection rule keeps d_j with
                probability p_j(d_j) and otherwise samples from p_j without d_j (renormalised).
                After a accepted proposals the target's own token from row a is the new bonus.
    4. commit   crop the target cache to p+a+1 entries; the draft context takes the features of
                the a+1 committed positions p..p+a (b and the accepted proposals); p += a+1.
Acceptance length = mean over rounds of (a+1), as for EAGLE-3's chains: tokens per target verify.
"""

from __future__ import annotations

import torch

from specfoundry.decoding.accept import accept_point_mass
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.model import DFlashCache, DFlashDraft


class BlockDraftRunner:
    """The DFlash draft with its context cache, and the target's lm_head its block_logits read."""

    def __init__(self, draft: DFlashDraft, lm_head: torch.Tensor):
        self.draft = draft
        self.lm_head = lm_head  # [V, H] the target's
        self.block_size = draft.cfg.block_size
        self.mask_token_id = draft.cfg.mask_token_id
        self.cache = DFlashCache()

    def reset(self) -> None:
        self.cache = DFlashCache()

    def __len__(self) -> int:
        return len(self.cache)

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Take the target's features aux [T, K*H] of the next T positions as context."""
        dtype = self.draft.fc.weight.dtype
        start = len(self.cache)
        context = self.draft.project_context(aux.to(dtype)[None])  # [1, T, H]
        positions = torch.arange(start, start + aux.shape[0], device=aux.device)[None]
        self.cache.append_context(self.draft, context, positions)

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's B-1 proposals after `bonus` (greedy, target ids [B-1] on the device: the host reads
        them with the acceptance decision) and their logits [B-1, V]."""
        p = len(self.cache)
        device = self.lm_head.device
        ids = torch.full((1, self.block_size), self.mask_token_id, device=device)
        ids[0, 0] = bonus
        positions = torch.arange(p, p + self.block_size, device=device)[None]
        states = self.draft.decode_block(ids, positions, self.cache)  # [1, B, H]
        logits = self.draft.block_logits(states[0, 1:], self.lm_head).float()  # [B-1, V], the draft's own
        return logits.argmax(-1), logits


def block_generate(target: TargetRunner, draft: BlockDraftRunner, prompt: list[int], *, max_new_tokens: int,
                   eos: set[int], sampler: Sampler) -> DecodeResult:
    draft.reset()
    return decode_rounds(
        target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
        start=lambda first, aux: draft.extend(aux),
        propose=draft.propose,
        verify=lambda drafts, _, logits: accept_point_mass(drafts, logits, sampler),
        commit=lambda new, aux: draft.extend(aux))  # b and the accepted proposals' features
