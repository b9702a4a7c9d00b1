"""EAGLE-3's chain: the draft proposes k tokens on its own states, the target verifies them in
one forward (decoding/rounds.py decode_rounds, one sequence).

Notation: the committed text is t_0..t_{m-1}; t_{m-1} is the newest token, which the target has
not read yet. Invariants at the start of a round:
    target KV cache   positions 0..m-2
    draft KV cache    positions 0..m-2; entry i holds (token t_{i+1}, fc(a_i)), a_i = the target's
                      aux features at i (exactly training's step-0 inputs)
    draft output      at m-2: its next-step state (pre-norm, or normed under
                      norm_output) and logits, which predict t_m
A round:
    1. propose  d_1 = pick(draft logits at m-2); for j = 2..k the draft reads (d_{j-1}, its own
                next-step state) at position m-2+(j-1) and proposes d_j (training's step j-1);
                then its cache is cropped back to m-1 entries.
    2. verify   the target reads [t_{m-1}, d_1..d_k] at positions m-1..m-1+k in one forward;
                row r of its logits predicts the token after position m-1+r.
    3. accept   greedy: the longest prefix with d_j == argmax(row j-1); sampling: d_j is kept
                with probability min(1, p_j(d_j) / q_j(d_j)), a rejection samples from
                norm(max(0, p_j - q_j)) (Leviathan et al. 2023; the output is distributed as the
                target's own samples). After a accepted drafts the target adds its own token
                (from row a, the "bonus"), so a round yields a+1 tokens.
    4. commit   crop the target cache to m+a entries; the draft reads the a+1 new (token,
                aux feature) pairs at positions m-1..m-1+a, restoring the invariants.
Acceptance length = mean over rounds of (a+1): tokens per target verify forward, counting the
target's own token. The first token (from the prompt's prefill) is not part of any round.
"""

from __future__ import annotations

import torch

from specfoundry.decoding.accept import accept
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.eagle3.model import Eagle3Draft, KVCache
from specfoundry.families.vocab import draft_ids_from_d2t


class DraftRunner:
    """The draft with its own KV cache, following the invariants in the module docstring."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.draft_to_target = draft_ids_from_d2t(draft.d2t)  # [Vd]
        self.target_ids: list[int] = self.draft_to_target.tolist()  # the same on the host: no sync per lookup
        self.cache = KVCache()
        self.pre: torch.Tensor | None = None  # [1, 1, H] next-step state at the newest position
        self.logits: torch.Tensor | None = None  # [Vd] logits at the newest position

    def reset(self) -> None:
        self.cache = KVCache()

    def run(self, ids: list[int], hidden: torch.Tensor, positions: list[int]):
        """Read tokens `ids` with hidden inputs [1, T, H] at `positions` after the cache."""
        device = hidden.device
        x = torch.tensor([ids], device=device)
        pos = torch.tensor([positions], device=device)
        pre, normed = self.draft.decode_forward(x, hidden, pos, self.cache)
        return pre, self.draft.lm_head(normed)[0].float()  # [1, T, H], [T, Vd]

    @torch.inference_mode()
    def extend(self, tokens: list[int], aux: torch.Tensor) -> torch.Tensor:
        """Read (token t_{i+1}, aux a_i) for the next len(tokens) positions. Returns all their
        logits [T, Vd] (the last row predicts the next token)."""
        dtype = self.draft.fc.weight.dtype
        hidden = self.draft.project(aux.to(dtype)[None])  # [1, T, H]
        start = len(self.cache)
        pre, logits = self.run(tokens, hidden, list(range(start, start + len(tokens))))
        self.pre, self.logits = pre[:, -1:], logits[-1]
        return logits

    @torch.inference_mode()
    def propose(self, k: int, pick) -> tuple[list[int], list[torch.Tensor]]:
        """k tokens (target ids) chained on the draft's own states, and each one's draft
        logits [Vd]. The cache is left as it was found."""
        base = len(self.cache)
        logits, pre = self.logits, self.pre
        tokens, all_logits = [], []
        for j in range(k):
            d = self.target_ids[int(pick(logits))]
            tokens.append(d)
            all_logits.append(logits)
            if j + 1 < k:
                # training's step j+1: own token, own next-step state, position (m-2) + (j+1)
                pre, out = self.run([d], pre, [base - 1 + j + 1])
                logits = out[-1]
        self.cache.crop(base)
        return tokens, all_logits

    def crop(self, length: int) -> None:
        self.cache.crop(length)


def speculative_generate(target: TargetRunner, draft: DraftRunner, prompt: list[int], *, k: int,
                         max_new_tokens: int, eos: set[int], sampler: Sampler) -> DecodeResult:
    draft.reset()
    return decode_rounds(
        target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
        start=lambda first, aux: draft.extend(prompt[1:] + first, aux),
        propose=lambda last: draft.propose(k, sampler.pick),
        verify=lambda drafts, draft_logits, logits: accept(drafts, draft_logits, logits, draft.draft_to_target,
                                                           sampler),
        commit=draft.extend)
