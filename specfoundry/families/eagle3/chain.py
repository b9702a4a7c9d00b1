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

from collections.abc import Callable

import torch

from specfoundry.decoding.accept import accept
from specfoundry.decoding.cache import StaticKVCache, visible
from specfoundry.decoding.graphs import CapturedCall, PinnedStaging, compiled_step
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import COLUMN_ROUND, TargetRunner
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.vocab import draft_ids_from_d2t

EXTEND_GRAPH_MAX = 16
"""The most tokens a captured commit (DraftRunner.extend after the prompt) reads: a round commits
a + 1 <= k + 1 of them, so one graph per count up to k + 1. A longer one (the prompt) runs eagerly."""


class ExtendStep:
    """DraftRunner.extend of T tokens after committed text, captured: static ids | start (staged from
    pinned memory), aux rows [T, K*H] (copied on the device), the causal pattern. Idempotent, as a
    captured call must be (graphs.py): it writes columns start..start+T-1 and sets `base` to
    start + T from its inputs, never by adding to what is there."""

    def __init__(self, runner: DraftRunner, tokens: int, aux: torch.Tensor):
        device = runner.device
        self.tokens = tokens
        self.staging = PinnedStaging(device)
        self.host = self.staging.buffer(tokens + 1, dtype=torch.int64)  # ids | start
        self.staged = torch.zeros(tokens + 1, dtype=torch.int64, device=device)
        # [T, K*H] in the draft's dtype: the copy in converts as the eager extend's .to(dtype) does
        self.aux = torch.zeros(tokens, aux.shape[-1], dtype=runner.draft.fc.weight.dtype, device=device)
        self.pattern = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()  # [T, T]
        self.offsets = torch.arange(tokens, device=device)  # [T]
        self.call = CapturedCall(lambda: self.body(runner), device)

    def body(self, runner: DraftRunner) -> torch.Tensor:
        ids, start = self.staged[: self.tokens], self.staged[self.tokens]
        hidden = runner.draft.project(self.aux[None])  # [1, T, H]
        at = start + self.offsets  # [T] columns and positions
        pre, logits = runner.forward_at(ids[None], hidden, at[None], at, start, self.pattern)
        runner.base.copy_(start + self.tokens)
        runner.keep_newest(pre, logits)
        return logits

    def __call__(self, tokens: list[int], start: int, aux: torch.Tensor) -> torch.Tensor:
        self.staging.wait()  # the last copy from the host buffer has run
        self.host[: self.tokens] = torch.tensor(tokens)
        self.host[self.tokens] = start
        self.staged.copy_(self.host, non_blocking=True)
        self.staging.sent()
        self.aux.copy_(aux)
        return self.call()


class DraftRunner:
    """The draft with its own static KV cache (decoding/cache.py), following the invariants in the
    module docstring. Columns 0..length-1 hold the committed entries; a proposal's entries are
    written after them (`written`) and forgotten by moving the lengths back, never reallocated.

    A greedy chain's k steps run as one body with no host synchronisation inside (each proposal is
    the argmax of the last step's logits, read on the device by the next step); on a GPU that body
    is captured once per k as a CUDA graph and replayed. Sampling picks each proposal on the host
    from the seeded generator, step by step, over the same cache.

    `compiled`: the captured chain's body runs through torch.compile (fullgraph, one shape per k),
    as TargetRunner's `compiled` steps do: a small draft's chain is hundreds of tiny kernels (the
    norms', the rotary's and the gated MLP's elementwise pieces, k-1 times), which inductor fuses.
    The tree expansion and the commit stay captured as they are."""

    def __init__(self, draft: Eagle3Draft, *, graphs: bool | None = None, compiled: bool = False):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.draft_to_target = draft_ids_from_d2t(draft.d2t)  # [Vd]
        self.target_ids: list[int] = self.draft_to_target.tolist()  # the same on the host: no sync per lookup
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.compiled = compiled
        self.compiled_chain = compiled_step(self.greedy_chain) if compiled else None  # (chain_body)
        self.cache: StaticKVCache | None = None
        self.length = 0  # committed columns
        self.written = 0  # columns holding entries (committed, then this round's proposals)
        self.chains: dict[int, CapturedCall] = {}  # k -> the captured greedy chain
        self.extends: dict[int, ExtendStep] = {}  # token count -> the captured commit (extend)
        # branching -> the tree expansion's body (tree.py), captured on a GPU
        self.trees: dict[tuple[int, ...], Callable[[], torch.Tensor]] = {}
        h = draft.cfg.hidden_size
        self.pre = torch.zeros(1, 1, h, dtype=draft.fc.weight.dtype, device=self.device)  # next-step state
        self.logits = torch.zeros(draft.cfg.draft_vocab_size, device=self.device)  # [Vd] at the newest position
        self.base = torch.zeros((), dtype=torch.long, device=self.device)  # `length` on the device
        self.reset()

    def reset(self, reserve: int = 0) -> None:
        """A new sequence of at most `reserve` entries (the cache grows past it, dropping its graphs)."""
        self.length = self.written = 0
        capacity = -(-max(reserve, 1) // COLUMN_ROUND) * COLUMN_ROUND
        if self.cache is None or capacity > self.cache.capacity:
            self.cache = StaticKVCache(capacity) if self.cache is None else self.cache.grown(capacity)
            self.kv_index = torch.arange(capacity, device=self.device)  # [C]
            self.chains.clear()
            self.trees.clear()
            self.extends.clear()

    def __len__(self) -> int:
        return self.length

    @torch.inference_mode()
    def run(self, ids: list[int], hidden: torch.Tensor, positions: list[int], pattern: torch.Tensor | None = None):
        """Read tokens `ids` with hidden inputs [1, T, H] at `positions`, their entries written after
        every entry so far. They see the committed entries and, of this round's entries from the
        committed length on (W of them, theirs last), what pattern [T, W] says (default: all earlier
        ones, and causally among themselves)."""
        count = len(ids)
        if self.written + count > self.cache.capacity:
            self.reset_capacity(self.written + count)
        width = self.written + count - self.length
        if pattern is None:
            pattern = torch.ones(count, width, dtype=torch.bool).tril(width - count)
        out = self.forward_at(torch.tensor([ids], device=self.device), hidden,
                              torch.tensor([positions], device=self.device),
                              torch.arange(self.written, self.written + count, device=self.device),
                              torch.tensor(self.length, device=self.device), pattern.to(self.device))
        self.written += count
        return out

    def forward_at(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
                   start: torch.Tensor, pattern: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ids [1, T] with hidden inputs [1, T, H] at positions [1, T], its entries
        written at cache columns [T]; they see the columns before `start` (a 0-d device tensor) and,
        of the W from it on, what pattern [T, W] says. Returns (pre [1, T, H], logits [T, Vd])."""
        allowed = visible(self.kv_index, start, pattern)  # [T, C]
        self.cache.columns = columns
        pre, normed = self.draft.decode_forward(ids, hidden, positions, self.cache, allowed[None, None])
        return pre, self.draft.lm_head(normed)[0].float()

    def keep_newest(self, pre: torch.Tensor, logits: torch.Tensor) -> None:
        """The newest committed position's next-step state and logits, which the next proposal reads."""
        self.pre.copy_(pre[:, -1:])
        self.logits.copy_(logits[-1])

    def reset_capacity(self, tokens: int) -> None:
        length, written = self.length, self.written
        self.reset(tokens)
        self.length, self.written = length, written

    @torch.inference_mode()
    def extend(self, tokens: list[int], aux: torch.Tensor) -> torch.Tensor:
        """Read (token t_{i+1}, aux a_i) for the next len(tokens) positions and commit them. Returns
        all their logits [T, Vd] (the last row predicts the next token). After committed text, at
        most EXTEND_GRAPH_MAX tokens run as a captured step (ExtendStep) on a GPU: a round's commit,
        whose eager launches took longer than the chain of proposals."""
        self.forget_proposals()
        count = len(tokens)
        if self.graphs and self.length > 0 and 0 < count <= EXTEND_GRAPH_MAX:
            if self.length + count > self.cache.capacity:
                self.reset_capacity(self.length + count)
            step = self.extends.get(count)
            if step is None:
                step = self.extends[count] = ExtendStep(self, count, aux)
            logits = step(tokens, self.length, aux)
            self.length = self.written = self.length + count
            return logits
        dtype = self.draft.fc.weight.dtype
        hidden = self.draft.project(aux.to(dtype)[None])  # [1, T, H]
        pre, logits = self.run(tokens, hidden, list(range(self.length, self.length + len(tokens))))
        self.length = self.written
        self.base.fill_(self.length)
        self.keep_newest(pre, logits)
        return logits

    @torch.inference_mode()
    def warm_commits(self, most: int) -> None:
        """Capture the commit (ExtendStep) of every count 1..most now, each after the same one-entry
        scratch sequence (its columns 1..count), which the next reset forgets. A count is first met
        when a round accepts count - 1 drafts, which one decode need not reach."""
        if not self.graphs:
            return
        aux = torch.zeros(most, self.draft.fc.in_features, device=self.device)  # [most, K*H] any features
        self.reset()
        self.extend([0], aux[:1])  # the scratch entry (eager: a commit after committed text is captured)
        for count in range(1, min(most, EXTEND_GRAPH_MAX) + 1):
            self.crop(1)
            self.extend([0] * count, aux[:count])
        self.reset()

    @torch.inference_mode()
    def propose(self, k: int, pick, greedy: bool = False):
        """k tokens (target ids) chained on the draft's own states, and each one's draft logits [Vd];
        the committed entries are left as they were. `greedy`: pick is the argmax, taken on the device:
        the tokens come back as a tensor [k] there (the host reads them with the acceptance decision)
        and the logits as [k, Vd]; else a list and a list of [Vd]."""
        if greedy:
            if self.length + k > self.cache.capacity:
                self.reset_capacity(self.length + k)
            if self.graphs and k not in self.chains:
                self.chains[k] = CapturedCall(lambda: self.chain_body(k), self.device,
                                              check_host_reads=not self.compiled)  # (graphs.py: compiled code)
            return self.chains[k]() if self.graphs else self.greedy_chain(k)  # [k] on the device, [k, Vd]
        base = self.length
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
        self.forget_proposals()
        return tokens, all_logits

    def chain_body(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured chain's body: greedy_chain as it is, or through torch.compile (`compiled`:
        decoding/graphs.py compiled_step, one compile per k)."""
        return self.compiled_chain(k) if self.compiled else self.greedy_chain(k)

    def greedy_chain(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k greedy proposals (target ids [k]) and their logits [k, Vd] from the committed state
        (self.pre, self.logits, self.base), on the device alone: step j writes column base + j at
        position base + j (training's step j+1) and sees every column up to it."""
        logits, pre = self.logits, self.pre
        tokens, rows = [], []
        for j in range(k):
            # [1] target id: index_select, not t[0-d tensor] (which Python turns into an int: a host read)
            token = self.draft_to_target.index_select(0, logits.argmax(-1).view(1))
            tokens.append(token)
            rows.append(logits)
            if j + 1 < k:
                at = self.base + j  # [] column and position of this step's entry
                self.cache.columns = at.view(1)
                mask = (self.kv_index <= at)[None, None, None, :]  # [1, 1, 1, C]
                pre, normed = self.draft.decode_forward(token.view(1, 1), pre, at.view(1, 1), self.cache, mask)
                logits = self.draft.lm_head(normed)[0, -1].float()
        return torch.cat(tokens), torch.stack(rows)

    def forget_proposals(self) -> None:
        """This round's entries are no longer read (their columns are overwritten later)."""
        self.written = self.length

    def crop(self, length: int) -> None:
        self.length = self.written = length
        self.base.fill_(length)


def speculative_generate(target: TargetRunner, draft: DraftRunner, prompt: list[int], *, k: int,
                         max_new_tokens: int, eos: set[int], sampler: Sampler) -> DecodeResult:
    draft.reset(len(prompt) + max_new_tokens + k)
    return decode_rounds(
        target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
        start=lambda first, aux: draft.extend(prompt[1:] + first, aux),
        propose=lambda last: draft.propose(k, sampler.pick, greedy=sampler.greedy),
        verify=lambda drafts, draft_logits, logits: accept(drafts, draft_logits, logits, draft.draft_to_target,
                                                           sampler),
        commit=draft.extend)
