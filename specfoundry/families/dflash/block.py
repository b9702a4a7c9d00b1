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
from specfoundry.decoding.graphs import CapturedCall, PinnedStaging, compiled_step
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.model import DFlashCache, DFlashDraft

APPEND_GRAPH_MAX = 64
"""The most positions a captured context append (BlockDraftRunner.extend after the prompt) takes: a
round commits a + 1 <= B of them, one graph per count. A longer one (the prompt) runs eagerly."""


class ContextAppend:
    """BlockDraftRunner.extend of T positions after the committed context, captured: the start staged
    from pinned memory, the features aux [T, K*H] copied on the device. Idempotent, as a captured
    call must be (decoding/graphs.py): it writes columns start..start+T-1 of every layer's cache
    and sets the cache's device `start` to start + T from its inputs, never by adding."""

    def __init__(self, runner: BlockDraftRunner, tokens: int, aux: torch.Tensor):
        device = runner.device
        self.tokens = tokens
        self.staging = PinnedStaging(device)
        self.host = self.staging.buffer(1, dtype=torch.int64)  # start
        self.start = torch.zeros(1, dtype=torch.int64, device=device)
        # [T, K*H] in the draft's dtype: the copy in converts as the eager extend's .to(dtype) does
        self.aux = torch.zeros(tokens, aux.shape[-1], dtype=runner.draft.fc.weight.dtype, device=device)
        self.offsets = torch.arange(tokens, device=device)  # [T]
        self.call = CapturedCall(lambda: self.body(runner), device)

    def body(self, runner: BlockDraftRunner) -> torch.Tensor:
        draft, cache = runner.draft, runner.cache
        context = draft.project_context(self.aux[None])  # [1, T, H]
        cache.write_context(draft, context, self.start + self.offsets)  # positions [T]
        cache.start.copy_(self.start[0] + self.tokens)
        return cache.start  # (an output, as CapturedCall's CPU stand-in expects one)

    def __call__(self, start: int, aux: torch.Tensor) -> None:
        self.staging.wait()  # the last copy from the host buffer has run
        self.host[0] = start
        self.start.copy_(self.host, non_blocking=True)
        self.staging.sent()
        self.aux.copy_(aux)
        self.call()


class BlockDraftRunner:
    """The DFlash draft with its context cache, and the target's lm_head its block_logits read.

    A proposal (propose_body: the block forward and its proposals, on the device alone; a family on
    DFlash's backbone overrides it with its sequential head) is captured once as a CUDA graph on a
    GPU and replayed; it reads the bonus token and the committed length from device buffers."""

    def __init__(self, draft: DFlashDraft, lm_head: torch.Tensor, *, graphs: bool | None = None,
                 compiled: bool = False):
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
        self.appends: dict[int, ContextAppend] = {}  # positions -> the captured context append
        self.compiled = compiled  # the captured proposal's body through torch.compile (proposal_body)
        self.compiled_body = compiled_step(self.propose_body) if compiled else None

    def reset(self, reserve: int = 0) -> None:
        """A new sequence (its cache reused, grown to `reserve` columns where needed)."""
        self.cache.crop(0)
        if self.cache.reserve(reserve + self.block_size):
            self.proposal = None  # it read the old cache
            self.appends.clear()

    def __len__(self) -> int:
        return len(self.cache)

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Take the target's features aux [T, K*H] of the next T positions as context. After the
        prompt, at most APPEND_GRAPH_MAX positions run as a captured step (ContextAppend) on a GPU: a
        round's commit, some dozens of eager kernels a draft layer otherwise."""
        count = aux.shape[0]
        if self.cache.reserve(len(self.cache) + count + self.block_size):
            self.proposal = None
            self.appends.clear()
        if self.graphs and len(self.cache) > 0 and 0 < count <= APPEND_GRAPH_MAX:
            self.cache.on(self.device)
            step = self.appends.get(count)
            if step is None:
                step = self.appends[count] = ContextAppend(self, count, aux)
            step(len(self.cache), aux)
            self.cache.length += count  # (its device `start` the step set)
            return
        dtype = self.draft.fc.weight.dtype
        context = self.draft.project_context(aux.to(dtype)[None])  # [1, T, H]
        self.cache.append_context(self.draft, context)

    @torch.inference_mode()
    def warm_commits(self, most: int) -> None:
        """Capture the context append (ContextAppend) of every count 1..most now, each after the same
        one-position scratch context (its columns 1..count), which the next reset forgets. A count is
        first met when a round accepts count - 1 proposals, which one decode need not reach."""
        if not self.graphs:
            return
        aux = torch.zeros(most, self.draft.fc.in_features, device=self.device)  # [most, K*H] any features
        self.reset()
        self.extend(aux[:1])  # the scratch position (eager: an append after context is captured)
        for count in range(1, min(most, APPEND_GRAPH_MAX) + 1):
            self.cache.crop(1)
            self.extend(aux[:count])
        self.reset()

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's proposals after `bonus` (greedy, target ids on the device: the host reads them
        with the acceptance decision) and their logits [proposals, V]."""
        self.bonus.fill_(bonus)
        if not self.graphs:
            return self.propose_body()
        if self.proposal is None:
            self.proposal = CapturedCall(self.proposal_body, self.device,
                                         check_host_reads=not self.compiled)  # (graphs.py: compiled code)
        return self.proposal()

    def proposal_body(self):
        """The captured proposal's body: propose_body as it is, or through torch.compile (`compiled`:
        decoding/graphs.py compiled_step). The block forward is some dozens of small kernels a draft
        layer, which inductor fuses."""
        return self.compiled_body() if self.compiled else self.propose_body()

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
