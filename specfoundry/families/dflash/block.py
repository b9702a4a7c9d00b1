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
from specfoundry.decoding.steps import CapturedSteps, Step, prompt_keys, read_rows
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.model import DFlashCache, DFlashDraft

APPEND_GRAPH_MAX = 64
"""The most positions a captured context append (BlockDraftRunner.extend after committed context)
takes: a round commits a + 1 <= B of them, one key per count. The prompt's append is captured in
its bucket (decoding/steps.py prompt_bucket); anything else runs eagerly."""


class BlockDraftRunner:
    """The DFlash draft with its context cache, and the target's lm_head its block_logits read.

    A proposal (propose_body: the block forward and its proposals, on the device alone; a family on
    DFlash's backbone overrides it with its sequential head) is one captured step (decoding/steps.py),
    `compiled` through torch.compile; it reads the bonus token (its input) and the committed length
    (the cache's device `start`). `block_size` is the block served, at most the trained one: its
    first slots are the trained block's first slots (the mask tokens after them left out)."""

    def __init__(self, draft: DFlashDraft, lm_head: torch.Tensor, *, block_size: int | None = None,
                 graphs: bool | None = None, compiled: bool = False):
        self.draft = draft
        self.lm_head = lm_head  # [V, H] the target's
        self.device = lm_head.device
        # the served block, the trained one unless given: the engines run a draft at any block up to
        # the one it was trained at (SGLang --speculative-num-draft-tokens, vLLM num_speculative_tokens)
        self.block_size = draft.cfg.block_size if block_size is None else block_size
        if not 1 <= self.block_size <= draft.cfg.block_size:
            raise ValueError(f"a block of {self.block_size}: the draft serves blocks of 1 to its trained "
                             f"{draft.cfg.block_size}")
        self.mask_token_id = draft.cfg.mask_token_id
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.slots = torch.arange(self.block_size, device=self.device)
        self.cache = DFlashCache()
        self.cache.on(self.device)
        self.proposals = CapturedSteps(self.device, self.proposal_step, graphs=self.graphs, compiled=compiled)
        self.appends = CapturedSteps(self.device, self.append_step, graphs=self.graphs)  # by position count

    def reset(self, reserve: int = 0) -> None:
        """A new sequence (its cache reused, grown to `reserve` columns where needed)."""
        self.cache.crop(0)
        if self.cache.reserve(reserve + self.block_size):
            self.drop()

    def __len__(self) -> int:
        return len(self.cache)

    def drop(self) -> None:
        self.proposals.drop()  # they read the old cache
        self.appends.drop()

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Take the target's features aux [T, K*H] of the next T positions as context. A round's commit
        (at most APPEND_GRAPH_MAX positions after committed context) is a captured step, and so is the
        prompt's append on a GPU, in its bucket."""
        count = aux.shape[0]
        length = len(self.cache)
        key = read_rows(length, count, APPEND_GRAPH_MAX, self.graphs)
        # the bucket's pad columns, and the next block's scratch columns after the committed ones: the
        # trained block's, at least the served one, which the eager append (DFlashCache.append_context)
        # reserves too; a growth there, after this, would leave captured steps on the old buffers
        if self.cache.reserve(length + max(key or count, count + self.draft.cfg.block_size)):
            self.drop()
        if key is None:
            dtype = self.draft.fc.weight.dtype
            self.cache.append_context(self.draft, self.draft.project_context(aux.to(dtype)[None]))  # [1, T, H]
            return
        self.appends(key, start=length, rows=count, aux=aux)
        self.cache.length += count  # (its device `start` the step set)

    def append_step(self, positions: int) -> Step:
        """extend of T positions after `start` committed ones, of which the first `rows` are real (a
        prompt's bucket: the rest are pad rows, whose columns come after the committed ones): start,
        rows [] int64, aux [T, K*H] in the draft's dtype. Idempotent: it writes columns
        start..start+T-1 of every layer and sets the cache's device `start` to start + rows from its
        inputs, never by adding."""
        offsets = torch.arange(positions, device=self.device)  # [T]

        def body(x):
            context = self.draft.project_context(x.aux[None])  # [1, T, H]
            self.cache.write_context(self.draft, context, x.start + offsets)  # positions [T]
            self.cache.start.copy_(x.start + x.rows)
            return self.cache.start  # (an output, as the CPU stand-in of a capture expects one)

        inputs = dict(start=torch.tensor(0), rows=torch.tensor(positions),
                      aux=torch.zeros(positions, self.draft.fc.in_features, dtype=self.draft.fc.weight.dtype))
        return Step(body, inputs)

    @property
    def proposal_count(self) -> int:
        """Proposals a round: the block's slots after the bonus."""
        return self.block_size - 1

    def step_keys(self, prompts: list[int]) -> list[tuple[CapturedSteps, object]]:
        """The proposal, the append of every count a round may commit (a + 1 for a accepted proposals:
        a block proposes block_size - 1, DSpark's block_size, so counts 1..block_size + 1 serve all),
        and the prompt's append in the buckets of these prompt lengths."""
        keys = [(self.proposals, None)]
        keys += [(self.appends, n) for n in range(1, min(self.block_size + 1, APPEND_GRAPH_MAX) + 1)]
        return keys + prompt_keys(self.appends, prompts)

    @torch.inference_mode()
    def propose(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's proposals after `bonus` (greedy, target ids on the device: the host reads them
        with the acceptance decision) and their logits [proposals, V]."""
        return self.proposals(None, bonus=bonus)

    def proposal_step(self, key: None) -> Step:
        """The proposal (propose_body) reading the bonus token from its input; through torch.compile
        under `compiled`: the block forward is some dozens of small kernels a draft layer, which
        inductor fuses."""
        return Step(lambda x: self.propose_body(x.bonus), dict(bonus=torch.tensor(0)))

    def block_states(self, bonus: torch.Tensor) -> torch.Tensor:
        """The block [bonus, M, ..., M] at the next B positions after the committed context: its
        final-normed states [B, H] (the cache's committed part unchanged)."""
        ids = torch.where(self.slots == 0, bonus, self.mask_token_id)[None]  # [1, B]
        positions = (self.cache.start + self.slots)[None]  # [1, B]
        return self.draft.decode_block(ids, positions, self.cache)[0]

    def propose_body(self, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash's proposals: slot j (1 <= j < B) proposes the argmax of the draft's logits there."""
        logits = self.draft.block_logits(self.block_states(bonus)[1:], self.lm_head).float()  # [B-1, V], the draft's own
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
