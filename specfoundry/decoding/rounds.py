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
from collections import deque
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
    dropped_steps: int = 0  # target steps run after the eos and dropped (the greedy target alone)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round
    draft_s: float = 0.0  # the rounds' proposals and commits
    target_s: float = 0.0  # the rounds' verify forwards (the target alone: its whole decode)
    prefill_s: float = 0.0  # the target's read of the prompt and its first pick (with a draft)
    start_s: float = 0.0  # the draft's read of the prompt's features
    total_s: float = 0.0  # the decode's wall time: the phases above, and the host's work between them

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def accept_length(self) -> float:
        """Tokens per target verify forward, the target's own token included."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)


def cut_at_end(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first eos; say whether generation is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


class PhaseClock:
    """Time spent in each phase of a decode (the prompt's prefill, the draft's start, the rounds'
    draft and target parts) without a host synchronisation per phase: on a GPU, CUDA events
    recorded on the device's current stream at the phase boundaries and read once, after the
    decode (device time between them, the host's gaps included); elsewhere the host clock, whose
    work is done when a call returns."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the decode's device, whichever is current
        return event

    def add(self, phase: str, start, end) -> None:
        self.spans.append((phase, start, end))

    def seconds(self, phase: str) -> float:
        if self.cuda and self.spans:
            self.spans[-1][2].synchronize()
        return sum(a.elapsed_time(b) * 1e-3 if self.cuda else b - a for p, a, b in self.spans if p == phase)

    def fill(self, result: DecodeResult) -> None:
        """result's draft, target, prefill and start seconds from this clock's spans."""
        for phase in ("draft", "target", "prefill", "start"):
            setattr(result, f"{phase}_s", self.seconds(phase))


class NonFiniteLogitsError(ValueError):
    """The target's logits hold a NaN or an inf: every pick from them is meaningless (the argmax of
    NaN logits is token 0 on both sides, which a draft 'matches' every time)."""


def check_logits(logits: torch.Tensor, where: str) -> None:
    """NonFiniteLogitsError naming `where` when logits [T, V] hold a non-finite value (one host read)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError(f"the target's logits are not finite at {where}: the target or its weights are "
                                   "broken (a NaN or an inf); nothing it decodes can be measured")


def read_prompt(clock: PhaseClock, target: TargetRunner, prompt: list[int], pick, start) -> tuple[list[int], DecodeResult]:
    """A decode's opening, timed as two phases: the target's prefill of the prompt and `pick` of the
    first token from its last row (`prefill`), then `start(first, aux)`, the draft's read of the
    prompt's features (`start`). Returns the first token [t] and the decode's result. Refuses
    non-finite logits (check_logits)."""
    p0 = clock.mark()
    logits, aux, _ = target.forward(prompt)
    check_logits(logits[-1], "the prompt's prefill")
    first = [pick(logits[-1])]
    p1 = clock.mark()
    start(first, aux)
    clock.add("prefill", p0, p1)
    clock.add("start", p1, clock.mark())
    return first, DecodeResult(first)


def greedy_on_device(drafts: torch.Tensor, target_logits: torch.Tensor, where: str = "a verify"
                     ) -> tuple[int, int, list[int]]:
    """accept.greedy_prefix for drafts [k] held on the device (target ids) against target_logits
    [k+1, V]: (a, the target's own token after them, the drafts as a list), from one copy to the host
    (the round's one synchronisation, which also says whether the logits are finite: check_logits)."""
    choice = target_logits.argmax(-1)  # [k+1]
    a = torch.cumprod((drafts == choice[:-1]).long(), 0).sum()  # [] the longest agreeing prefix
    finite = torch.isfinite(target_logits).all().long()
    packed = torch.cat([finite.view(1), a.view(1), choice[a].view(1), drafts]).tolist()
    if not packed[0]:
        raise NonFiniteLogitsError(f"the target's logits are not finite at {where}: the target or its weights are "
                                   "broken (a NaN or an inf); nothing it decodes can be measured")
    return packed[1], packed[2], packed[3:]


def decode_rounds(target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int], sampler: Sampler,
                  start, propose, verify, commit) -> DecodeResult:
    """Draft-then-verify rounds of one sequence, whatever drafts the tokens:
        start(first, aux)                  the draft reads the prompt's features (and the first token)
        propose(last) -> (drafts, extra)   n proposals after the last committed token: target ids, a list,
                                           or a tensor [n] on the device (greedy proposals not yet read
                                           by the host)
        verify(drafts, extra, logits)      -> (a accepted, the target's own token after them), from
                                           the target's logits [n+1, V] over [last] + drafts
        commit(new, aux)                   the draft reads the a+1 committed tokens and their features
    The caller resets its draft; the target reads [last] + drafts in one forward and its cache is
    cropped to the committed tokens; draft time is propose + commit, target time the verify forward,
    prefill time the prompt's forward and first pick, start time `start`.
    Drafts on the device under greedy decoding are verified by the greedy prefix rule on the device
    (greedy_on_device): the proposals reach the target's step without the host, and a round has one
    synchronisation, the acceptance decision; with host drafts or sampling, `verify` decides."""
    device = target.device
    t0 = time.perf_counter()
    target.reset(len(prompt) + max_new_tokens + 1 + MAX_DRAFT)  # a round verifies at most 1 + MAX_DRAFT tokens
    clock = PhaseClock(device)
    tokens, result = read_prompt(clock, target, prompt, sampler.pick, start)
    tokens, done = cut_at_end(tokens, eos, max_new_tokens)
    while not done:
        proposing = clock.mark()
        drafts, extra = propose(tokens[-1])
        verifying = clock.mark()
        on_device = isinstance(drafts, torch.Tensor)
        logits, aux, _ = (target.forward([tokens[-1]], tail=drafts) if on_device
                          else target.forward([tokens[-1]] + drafts))  # [n+1, V]
        n = len(drafts)
        if on_device and sampler.greedy:
            a, bonus, drafts = greedy_on_device(drafts, logits, f"round {len(result.accepted) + 1}")
        else:
            check_logits(logits, f"round {len(result.accepted) + 1}")
            drafts = drafts.tolist() if on_device else drafts
            a, bonus = verify(drafts, extra, logits)
        target.crop(len(target) - n + a)  # keep the last committed token and the a accepted drafts
        committing = clock.mark()
        new = drafts[:a] + [bonus]
        commit(new, aux[: a + 1])
        done_round = clock.mark()
        clock.add("draft", proposing, verifying)
        clock.add("target", verifying, committing)
        clock.add("draft", committing, done_round)
        result.accepted.append(a)
        tokens, done = cut_at_end(tokens + new, eos, max_new_tokens)
    result.tokens = tokens
    clock.fill(result)
    result.total_s = time.perf_counter() - t0
    return result


GREEDY_READBACK = 2
"""Greedy target-alone decoding never waits for the host to read a token before the next step:
each step's input is the previous step's argmax, left on the device (TargetRunner's `tail`), and
the picks go to the host in chunks of GREEDY_READBACK by an asynchronous copy, read once a newer
chunk is on its way (by then the copy has long run). The host so queues the next step while the
device runs one, as an engine's asynchronous scheduling does. The cost: an eos is seen up to
2 * GREEDY_READBACK - 1 steps late; those steps run and are dropped."""


def target_generate(target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                    sampler: Sampler) -> DecodeResult:
    """The target alone, one token per forward with the same KV cache: the speed baseline."""
    t0 = time.perf_counter()
    target.reset(len(prompt) + max_new_tokens)
    logits, _, _ = target.forward(prompt)
    check_logits(logits[-1], "the prompt's prefill")
    if sampler.greedy:
        tokens = greedy_readback(target, logits[-1].argmax().reshape(1), max_new_tokens, eos)
    else:
        tokens, done = cut_at_end([sampler.pick(logits[-1])], eos, max_new_tokens)
        while not done:
            logits, _, _ = target.forward([tokens[-1]])
            tokens, done = cut_at_end(tokens + [sampler.pick(logits[-1])], eos, max_new_tokens)
    sync(target.device)
    elapsed = time.perf_counter() - t0
    # the prompt's prefill gave the first token; every later one took a step, and so did a dropped one
    dropped = len(target) - len(prompt) - (len(tokens) - 1)
    return DecodeResult(tokens, dropped_steps=dropped, total_s=elapsed, target_s=elapsed)


def greedy_readback(target: TargetRunner, first: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy tokens after the prefill's pick `first` ([1], on the device), read back as
    GREEDY_READBACK says. Never more than max_new_tokens picks in all."""
    tokens: list[int] = []
    last, picks = first, 1  # the newest pick [1] (device) and the picks made so far
    pending = [first]  # picks not yet sent to the host
    sent: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()  # (host copy, its event)
    while True:
        if pending and (len(pending) == GREEDY_READBACK or picks >= max_new_tokens):
            sent.append(copy_to_host(torch.cat(pending)))
            pending = []
        while sent and (len(sent) > 1 or picks >= max_new_tokens):  # the oldest chunk, once a newer one is sent
            host, copied = sent.popleft()
            if copied is not None:
                copied.synchronize()
            tokens, done = cut_at_end(tokens + host.tolist(), eos, max_new_tokens)
            if done:  # (at max_new_tokens picks at the latest)
                return tokens
        logits, _, _ = target.forward([], tail=last)
        last = logits[-1].argmax().reshape(1)  # queued before the next step rewrites logits
        pending.append(last)
        picks += 1


def copy_to_host(picks: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """picks [n] on their way to the host: a copy into pinned memory and the event after it (on a
    GPU), or the tensor itself (elsewhere)."""
    if picks.device.type != "cuda":
        return picks, None
    host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
    host.copy_(picks, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(picks.device))  # the copy's stream, whichever device is current
    return host, copied
