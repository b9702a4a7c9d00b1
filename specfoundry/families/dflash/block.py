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
from specfoundry.decoding.graphs import CapturedCall
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.model import DFlashCache, DFlashDraft


class BlockDraftRunner:
    """The DFlash draft with its context cache, and the target's lm_head its block_logits read.

    A proposal (propose_body: the block forward and its proposals, on the device alone; a family on
    DFlash's backbone overrides it with its sequential head) is captured once as a CUDA graph on a
    GPU and replayed; it reads the bonus token and the committed length from device buffers."""

    def __init__(self, draft: DFlashDraft, lm_head: torch.Tensor, *, graphs: bool | None = None):
        self.draft = draft
        self.lm_head = lm_head  # [V, H] the target's
        self.device = lm_head.device
        self.block_size = draft.cfg.block_size
        self.mask_token_id = draft.cfg.mask_token_id
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.bonus = torch.zeros((), dtype=torch.long, device=self.device)  # the block's first token
        self.slots = torch.arange(self.block_size, device=self.device)
        self.cache = DFlashCache()
        self.cache.on(self.device)
        self.proposal: CapturedCall | None = None

    def reset(self, reserve: int = 0) -> None:
        """A new sequence (its cache reused, grown to `reserve` columns where needed)."""
        self.cache.crop(0)
        if self.cache.reserve(reserve + self.block_size):
            self.proposal = None  # it read the old cache

    def __len__(self) -> int:
        return len(self.cache)

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Take the target's features aux [T, K*H] of the next T positions as context."""
        dtype = self.draft.fc.weight.dtype
        context = self.draft.project_context(aux.to(dtype)[None])  # [1, T, H]
        if self.cache.reserve(len(self.cache) + aux.shape[0] + self.block_size):
            self.proposal = None
        self.cache.append_context(self.draft, context)

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's proposals after `bonus` (greedy, target ids on the device: the host reads them
        with the acceptance decision) and their logits [proposals, V]."""
        self.bonus.fill_(bonus)
        if not self.graphs:
            return self.propose_body()
        if self.proposal is None:
            self.proposal = CapturedCall(self.propose_body, self.device)
        return self.proposal()

    def block_states(self) -> torch.Tensor:
        """The block [bonus, M, ..., M] at the next B positions after the committed context: its
        final-normed states [B, H] (the cache's committed part unchanged)."""
        ids = torch.where(self.slots == 0, self.bonus, self.mask_token_id)[None]  # [1, B]
        positions = (self.cache.start + self.slots)[None]  # [1, B]
        return self.draft.decode_block(ids, positions, self.cache)[0]

    def propose_body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash's proposals: slot j (1 <= j < B) proposes the argmax of the draft's logits there."""
        logits = self.draft.block_logits(self.block_states()[1:], self.lm_head).float()  # [B-1, V], the draft's own
        return logits.argmax(-1), logits


def block_generate(target: TargetRunner, draft: BlockDraftRunner, prompt: list[int], *, max_new_tokens: int,
                   eos: set[int], sampler: Sampler) -> DecodeResult:
    draft.reset(len(prompt) + max_new_tokens)
    return decode_rounds(
        target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
        start=lambda first, aux: draft.extend(aux),
        propose=draft.propose,
        verify=lambda drafts, _, logits: accept_point_mass(drafts, logits, sampler),
        commit=lambda new, aux: draft.extend(aux))  # b and the accepted proposals' features
