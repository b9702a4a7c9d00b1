"""Real speculative decoding with an EAGLE-3 draft against a transformers target (one sequence).

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

import time
from dataclasses import dataclass, field

import torch

from specfoundry.common.target import Target
from specfoundry.train.eagle3.model import Eagle3Draft, KVCache
from specfoundry.train.vocab import draft_ids_from_d2t


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetRunner:
    """The target (common/target.Target) with a KV cache for one sequence; its tap keeps the aux
    layers' outputs of each call."""

    def __init__(self, target: Target, aux_layers: list[int]):
        from transformers import DynamicCache

        self.target = target
        self.model = target.model
        self.tap = target.tap(aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.device = target.input_device
        self.cache_cls = DynamicCache
        self.cache = None

    def remove_hooks(self) -> None:
        self.tap.remove()

    def reset(self) -> None:
        # A cache of full length in every layer, also the sliding-window ones (Gemma-3, Mistral):
        # the model still masks each sliding layer to its window, and a rejected draft can be
        # cropped away anywhere (transformers' windowed layers cannot roll back past the window).
        self.cache = self.cache_cls()

    def __len__(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], want_hidden: bool = False, positions: list[int] | None = None,
                mask: torch.Tensor | None = None):
        """Read `ids` after the cache. Returns logits [T, V] (fp32), aux [T, 3H] and, if asked,
        the final normed hidden state [T, H]. By default the tokens follow the cache causally;
        a token tree passes its own `positions` and `mask` ([T, cache + T] bool, True = may
        attend), which goes to the model as a ready 4D additive mask."""
        if self.cache is None:
            self.reset()
        start = len(self)
        x = torch.tensor([ids], device=self.device)
        if positions is None:
            positions = list(range(start, start + len(ids)))
        custom = self.custom_masks(mask, start, positions) if mask is not None else None
        step = self.target.forward(x, positions=torch.tensor([positions], device=self.device), mask=custom,
                                   cache=self.cache, hidden=want_hidden)
        self.cache = step.cache
        aux = self.tap.take()[0]  # [T, 3H]
        final = step.final[0] if want_hidden else None
        return step.logits[0], aux, final

    def custom_masks(self, mask: torch.Tensor, start: int, positions: list[int]):
        """`mask` [T, start + T] as the model takes a ready mask: one additive [1, 1, T, start + T]
        tensor, and where sliding-window layers exist, that mask cut to each query's window too
        (a key at most window - 1 positions back, transformers' rule): a dict per layer type
        where the model mixes types (Gemma-3), the windowed tensor where every layer slides
        (Mistral). The cache holds the committed text at positions 0..start-1."""
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        types = set(getattr(config, "layer_types", None) or ())
        dtype = self.model.dtype

        def additive(m):
            return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)[None, None].to(self.device)

        windowed = None
        if window:
            keys = torch.cat([torch.arange(start), torch.tensor(positions)])  # [start + T] key positions
            windowed = mask & (torch.tensor(positions)[:, None] - keys[None, :] < window)
        if "sliding_attention" in types and len(types) > 1:
            return {"full_attention": additive(mask), "sliding_attention": additive(windowed)}
        if windowed is not None and (not types or types == {"sliding_attention"}):
            return additive(windowed)
        return additive(mask)

    def crop(self, length: int) -> None:
        # A negative argument removes that many tokens in every transformers version we support
        # (a positive one means an absolute length in some and is refused in others).
        remove = len(self) - length
        if remove:
            self.cache.crop(-remove)


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


@dataclass
class Sampler:
    """Greedy when temperature == 0, else sampling at that temperature from a seeded generator."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.greedy else self.sample(self.probs(logits))


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


def accept(drafts: list[int], draft_logits: list[torch.Tensor], target_logits: torch.Tensor,
           draft_to_target: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Verify k drafts against target_logits [k+1, V]. Returns (accepted count a, the target's
    own token after them)."""
    if sampler.greedy:
        target_choice = target_logits.argmax(-1).tolist()  # [k+1]
        a = 0
        while a < len(drafts) and drafts[a] == target_choice[a]:
            a += 1
        return a, target_choice[a]
    for j, d in enumerate(drafts):
        p = sampler.probs(target_logits[j])  # [V]
        q = torch.zeros_like(p)
        q[draft_to_target] = sampler.probs(draft_logits[j])  # the draft's distribution over target ids
        u = torch.rand((), generator=sampler.generator, device=p.device)
        if u * q[d] < p[d]:  # accept with probability min(1, p/q)
            continue
        residual = (p - q).clamp(min=0)
        return j, sampler.sample(residual / residual.sum())
    return len(drafts), sampler.sample(sampler.probs(target_logits[-1]))


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
    target.reset()
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
    target.reset()
    logits, _, _ = target.forward(prompt)
    tokens = [sampler.pick(logits[-1])]
    tokens, done = finish(tokens, eos, max_new_tokens)
    while not done:
        logits, _, _ = target.forward([tokens[-1]])
        tokens, done = finish(tokens + [sampler.pick(logits[-1])], eos, max_new_tokens)
    sync(target.device)
    return DecodeResult(tokens, total_s=time.perf_counter() - t0, target_s=time.perf_counter() - t0)
