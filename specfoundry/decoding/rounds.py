"""Draft-then-verify rounds of one sequence, whatever drafts the tokens, and the target alone.

Notation: the committed text is t_0..t_{m-1}; t_{m-1} is the newest token, which the target has
not read yet. A round: the draft proposes n tokens after t_{m-1}; the target reads [t_{m-1},
d_1..d_n] at positions m-1..m-1+n in one forward (row r of its logits predicts the token after
position m-1+r); an acceptance rule (accept.py) keeps a drafts and the target's own token after
them; the target's cache is cropped to the committed text and the draft reads the a+1 new tokens.
Acceptance length = mean over rounds of (a+1): tokens per target verify forward, counting the
target's own token. The first token (from the prompt's prefill) is not part of any round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specfoundry.common.settings import MAX_DRAFT
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (the prompt excluded), cut after the first eos
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def accept_length(self) -> float:
        """Tokens per target verify forward, the target's own token included."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)


def finish(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first eos; say whether generation is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def decode_rounds(target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int], sampler: Sampler,
                  start, propose, verify, commit) -> DecodeResult:
    """Draft-then-verify rounds of one sequence, whatever drafts the tokens:
        start(first, aux)                  the draft reads the prompt's features (and the first token)
        propose(last) -> (drafts, extra)   n proposals after the last committed token
        verify(drafts, extra, logits)      -> (a accepted, the target's own token after them), from
                                           the target's logits [n+1, V] over [last] + drafts
        commit(new, aux)                   the draft reads the a+1 committed tokens and their features
    The caller resets its draft; the target reads [last] + drafts in one forward and its cache is
    cropped to the committed tokens; draft time is propose + commit, target time the verify forward."""
    device = target.device
    t0 = time.perf_counter()
    target.reset(len(prompt) + max_new_tokens + 1 + MAX_DRAFT)  # a round verifies at most 1 + MAX_DRAFT tokens
    logits, aux, _ = target.forward(prompt)
    tokens = [sampler.pick(logits[-1])]
    result = DecodeResult(tokens)
    start(tokens, aux)
    tokens, done = finish(tokens, eos, max_new_tokens)
    while not done:
        sync(device)
        a0 = time.perf_counter()
        drafts, extra = propose(tokens[-1])
        sync(device)
        a1 = time.perf_counter()
        logits, aux, _ = target.forward([tokens[-1]] + drafts)  # [n+1, V]
        a, bonus = verify(drafts, extra, logits)
        target.crop(len(target) - len(drafts) + a)  # keep the last committed token and the a accepted drafts
        sync(device)
        a2 = time.perf_counter()
        new = drafts[:a] + [bonus]
        commit(new, aux[: a + 1])
        sync(device)
        result.draft_s += (a1 - a0) + (time.perf_counter() - a2)
        result.target_s += a2 - a1
        result.accepted.append(a)
        tokens, done = finish(tokens + new, eos, max_new_tokens)
    result.tokens = tokens
    result.total_s = time.perf_counter() - t0
    return result


def target_generate(target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                    sampler: Sampler) -> DecodeResult:
    """The target alone, one token per forward with the same KV cache: the speed baseline."""
    t0 = time.perf_counter()
    target.reset(len(prompt) + max_new_tokens)
    logits, _, _ = target.forward(prompt)
    tokens = [sampler.pick(logits[-1])]
    tokens, done = finish(tokens, eos, max_new_tokens)
    while not done:
        logits, _, _ = target.forward([tokens[-1]])
        tokens, done = finish(tokens + [sampler.pick(logits[-1])], eos, max_new_tokens)
    sync(target.device)
    return DecodeResult(tokens, total_s=time.perf_counter() - t0, target_s=time.perf_counter() - t0)
