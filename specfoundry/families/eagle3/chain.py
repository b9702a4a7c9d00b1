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
from specfoundry.decoding.cache import StaticKVCache, visible
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.steps import CapturedSteps, Step, prompt_keys, read_rows
from specfoundry.decoding.target import COLUMN_ROUND, TargetRunner
from specfoundry.decoding.tree import EngineTree
from specfoundry.families.eagle3.engine_tree import expand_body as engine_expand_body
from specfoundry.families.eagle3.expansion import TreeShape, expand_body
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.vocab import draft_ids_from_d2t

EXTEND_GRAPH_MAX = 16
"""The most tokens a captured commit (DraftRunner.extend after committed text) reads: a round commits
a + 1 <= k + 1 of them, one key per count. The prompt's read is captured in its bucket
(decoding/steps.py prompt_bucket); anything else runs eagerly."""


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
        self.cache: StaticKVCache | None = None
        self.length = 0  # committed columns
        self.written = 0  # columns holding entries (committed, then this round's proposals)
        self.chains = CapturedSteps(self.device, self.chain_step, graphs=self.graphs, compiled=compiled)  # by k
        self.extends = CapturedSteps(self.device, self.extend_step, graphs=self.graphs)  # by token count
        self.trees = CapturedSteps(self.device, self.tree_step, graphs=self.graphs)  # by branching (tree.py)
        self.engine_trees = CapturedSteps(self.device, self.engine_tree_step, graphs=self.graphs)  # by EngineTree
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
            for steps in (self.chains, self.extends, self.trees, self.engine_trees):
                steps.drop()  # they read the old cache

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
        their logits [T, Vd] (the last row predicts the next token). A round's commit (at most EXTEND_GRAPH_MAX tokens after
        committed text) is a captured step, and so is the prompt's read on a GPU, in its bucket: its
        eager launches, and a new shape per prompt, cost more than the target's prefill."""
        self.forget_proposals()
        count = len(tokens)
        key = read_rows(self.length, count, EXTEND_GRAPH_MAX, self.graphs)
        if key is not None:
            if self.length + key > self.cache.capacity:
                self.reset_capacity(self.length + key)
            logits = self.extends(key, ids=tokens, start=self.length, rows=count, aux=aux)
            self.length = self.written = self.length + count
            return logits if key == count else logits[:count]  # (a bucket's pad rows dropped)
        dtype = self.draft.fc.weight.dtype
        hidden = self.draft.project(aux.to(dtype)[None])  # [1, T, H]
        pre, logits = self.run(tokens, hidden, list(range(self.length, self.length + len(tokens))))
        self.length = self.written
        self.base.fill_(self.length)
        self.keep_newest(pre, logits)
        return logits

    def extend_step(self, tokens: int) -> Step:
        """extend of T tokens after `start` committed ones, of which the first `rows` are real (a
        prompt's bucket: the rest are pad rows after them, which causal attention hides from them):
        ids [T], start [], rows [] int64, aux [T, K*H] in the draft's dtype (a copy in converts as the
        eager extend's .to(dtype) does). Idempotent, as a captured body must be: it writes columns
        start..start+T-1 and sets `base` to start + rows from its inputs, never by adding."""
        pattern = torch.ones(tokens, tokens, dtype=torch.bool, device=self.device).tril()  # [T, T]
        offsets = torch.arange(tokens, device=self.device)  # [T]
        dtype = self.draft.fc.weight.dtype

        def body(x):
            hidden = self.draft.project(x.aux[None])  # [1, T, H]
            at = x.start + offsets  # [T] columns and positions
            pre, logits = self.forward_at(x.ids[None], hidden, at[None], at, x.start, pattern)
            self.base.copy_(x.start + x.rows)
            newest = (x.rows - 1).view(1)  # [1] the last real row
            self.keep_newest(pre.index_select(1, newest), logits.index_select(0, newest))
            return logits

        inputs = dict(ids=torch.zeros(tokens, dtype=torch.long), start=torch.tensor(0), rows=torch.tensor(tokens),
                      aux=torch.zeros(tokens, self.draft.fc.in_features, dtype=dtype))
        return Step(body, inputs)

    def step_keys(self, most_accepted: int, prompts: list[int]) -> list[tuple[CapturedSteps, object]]:
        """The commits of 1..most_accepted + 1 tokens and the prompt reads of these prompt lengths."""
        commits = [(self.extends, n) for n in range(1, min(most_accepted + 1, EXTEND_GRAPH_MAX) + 1)]
        return commits + prompt_keys(self.extends, prompts)

    @torch.inference_mode()
    def propose(self, k: int, pick, greedy: bool = False):
        """k tokens (target ids) chained on the draft's own states, and each one's draft logits [Vd];
        the committed entries are left as they were. `greedy`: pick is the argmax, taken on the device:
        the tokens come back as a tensor [k] there (the host reads them with the acceptance decision)
        and the logits as [k, Vd]; else a list and a list of [Vd]."""
        if greedy:
            if self.length + k > self.cache.capacity:
                self.reset_capacity(self.length + k)
            return self.chains(k)  # [k] on the device, [k, Vd]
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

    def chain_step(self, k: int) -> Step:
        """The greedy chain of k proposals (greedy_chain), from the runner's committed state alone."""
        return Step(lambda x: self.greedy_chain(k))

    def engine_tree_step(self, shape: EngineTree) -> Step:
        """The engines' tree of `shape` (engine_tree.py expand_body)."""
        body = engine_expand_body(self, shape)
        return Step(lambda x: body())

    def tree_step(self, branching: tuple[int, ...]) -> Step:
        """The expansion of the tree of `branching` (expansion.py expand_body)."""
        body = expand_body(self, TreeShape.of(branching, self.logits.shape[-1]))
        return Step(lambda x: body())

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
