"""P-EAGLE in sf-eval: one draft forward proposes the round's k tokens (a chain), verified by the
target in one forward through decoding/rounds.py decode_rounds; as vLLM's parallel drafting.

Invariants at the start of a round (EAGLE-3's, families/eagle3/chain.py): the committed text is
t_0..t_{m-1}; the draft's per-layer caches hold rows 0..j-1 (row i: token t_{i+1}, fc(a_i)) and the
rows j..m-2 are pending (read at the next forward: the newest after the draft's start, which reads
the prompt's other rows in one forward, and the a+1 committed tokens after a round). A round:
    1. propose  one forward over [pending rows, M x (k-1)] at positions j..m-2, m-1..m+k-3 (M: the mask
                token with fc(mask_hidden)); the last pending row's logits give d_1 (depth 0), the mask
                slots' give d_2..d_k (depths 1..k-1); then the caches drop the mask slots.
    2. verify   the target reads [t_{m-1}, d_1..d_k] (accept(): greedy prefix, or the rejection rule:
                each d_j is drawn from its own slot's distribution, which is what it is conditioned on)
    3. commit   the a + 1 new tokens and their target features become the pending rows.
Greedy output equals the target's own. The decoder's first round equals the training forward of the
rollout anchored at the last row (decode_matches_training).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specfoundry.common.settings import MAX_DRAFT
from specfoundry.decoding.accept import accept
from specfoundry.decoding.cache import StaticKVCache, visible
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.steps import CapturedSteps, Step, prompt_keys, read_rows
from specfoundry.decoding.target import COLUMN_ROUND, TargetRunner
from specfoundry.families.interface import Decoder
from specfoundry.families.peagle.config import PEagleConfig
from specfoundry.families.peagle.loss import pack_batch, pack_row, packed_states
from specfoundry.families.peagle.model import PEagleDraft
from specfoundry.families.vocab import draft_ids_from_d2t


class PEagleRunner:
    """The draft with its static KV cache (decoding/cache.py: every layer's keys, column i the row
    of position i) and its pending rows (see the module docstring). A round's forward reads the
    pending rows and k-1 mask slots, whose columns stay scratch: the committed length moves past the
    pending rows only. A round's forward (n pending rows, k proposals) is one captured step per (n, k)
    (decoding/steps.py), and so is the start's read of the prompt on a GPU, in its bucket (k = 1)."""

    def __init__(self, draft: PEagleDraft, *, graphs: bool | None = None):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.draft_to_target = draft_ids_from_d2t(draft.d2t)  # [Vd]
        self.target_ids: list[int] = self.draft_to_target.tolist()
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.cache = StaticKVCache(COLUMN_ROUND)
        self.kv_index = torch.arange(COLUMN_ROUND, device=self.device)
        self.rounds = CapturedSteps(self.device, self.round_step, graphs=self.graphs)  # by (rows, k)
        self.reset()

    def reset(self, reserve: int = 0) -> None:
        self.length = 0  # committed columns
        self.tokens: list[int] = []  # pending rows' tokens
        self.aux: list[torch.Tensor] = []  # pending rows' features [n, 3*Ht]
        self.reserve(reserve)

    def reserve(self, tokens: int) -> None:
        if tokens <= self.cache.capacity:
            return
        capacity = -(-tokens // COLUMN_ROUND) * COLUMN_ROUND
        self.cache = self.cache.grown(capacity)
        self.kv_index = torch.arange(capacity, device=self.device)
        self.rounds.drop()  # they read the old cache

    def step_keys(self, k: int, prompts: list[int]) -> list[tuple[CapturedSteps, object]]:
        """The round of every pending-row count n = 1..k+1 (a round reads the a + 1 tokens the last one
        committed) with k proposals, and the start's read of these prompt lengths (all rows but the
        newest: a prompt of n tokens and the first token give n rows, n - 1 read), in their buckets."""
        keys = [(self.rounds, (n, k)) for n in range(1, min(k + 1, MAX_DRAFT + 1) + 1)]
        return keys + prompt_keys(self.rounds, prompts, lambda bucket: (bucket, 1))

    def read(self, tokens: list[int], aux: torch.Tensor) -> None:
        """Rows (token t_{i+1}, feature a_i) to read at the next forward."""
        assert len(tokens) == aux.shape[0], (len(tokens), aux.shape)
        self.tokens += tokens
        self.aux.append(aux)

    @torch.inference_mode()
    def start(self, tokens: list[int], aux: torch.Tensor) -> None:
        """A decode's first rows (the prompt's, then the first token; aux [T, 3*Ht]): all but the newest
        through one eager forward now (k = 1: no mask slot, its logits unread), the newest left
        pending. The first round then reads one row, as a round after a one-token commit does, and the
        prompt's forward is the start's work, not the first round's. Causal attention gives each row
        the same cache entry as reading them all in the first round."""
        if len(tokens) > 1:
            self.read(tokens[:-1], aux[:-1])
            self.round(1)
        self.read(tokens[-1:], aux[-1:])

    def forward(self, k: int) -> torch.Tensor:
        """One forward over the pending rows and k-1 mask slots: logits [k, Vd] of depths 0..k-1."""
        return self.round(k)[0]

    @torch.inference_mode()
    def round(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits [k, Vd] and their greedy proposals [k] (target ids), both on the device."""
        n = len(self.tokens)
        assert n >= 1, "a round needs the newest committed token"
        # the start's read of the prompt (k = 1) in its bucket: pad rows after the real ones
        rows = read_rows(self.length, n, MAX_DRAFT + 1, self.graphs and k == 1)
        key = None if rows is None else (rows, k)
        self.reserve(self.length + (key[0] if key else n) + k - 1)
        ids = self.tokens + [self.draft.cfg.mask_token_id] * (k - 1)
        if key is not None:
            out = self.rounds(key, ids=ids, start=self.length, aux=tuple(self.aux))
        else:
            x = SimpleNamespace(ids=torch.tensor(ids, device=self.device), aux=torch.cat(self.aux),  # aux [n, 3*Ht]
                                start=torch.tensor(self.length, device=self.device))
            out = self.body(x, n, k)
        self.length += n  # the mask slots' columns are this round's only
        self.tokens, self.aux = [], []
        return out

    def round_step(self, key: tuple[int, int]) -> Step:
        """The round of n rows and k proposals (body): ids [n+k-1] (the rows' tokens, then k-1 mask
        tokens), start [] int64, aux [n, 3*Ht] in the draft's dtype; a prompt's bucket holds fewer real
        rows than n (k = 1: its logits are not read; its pad rows' ids and features are what the
        inputs held)."""
        n, k = key
        inputs = dict(ids=torch.zeros(n + k - 1, dtype=torch.long), start=torch.tensor(0),
                      aux=torch.zeros(n, self.draft.fc.in_features, dtype=self.draft.fc.weight.dtype))
        return Step(lambda x: self.body(x, n, k), inputs)

    def body(self, x, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's forward on the device alone, at columns and positions start..start+n+k-2: the
        logits [k, Vd] and their argmax as target ids [k] (in the captured round, so that a greedy
        round launches nothing after it)."""
        draft = self.draft
        dtype = draft.fc.weight.dtype
        count = n + k - 1
        hidden = torch.cat([draft.project(x.aux.to(dtype)), draft.mask_state().expand(k - 1, -1)])[None]
        columns = x.start + self.kv_index[:count]  # [T]
        self.cache.columns = columns
        mask = visible(self.kv_index, x.start, torch.ones(count, count, dtype=torch.bool, device=self.device).tril())
        normed = draft.decode_forward(x.ids[None], hidden, columns[None], self.cache, mask[None, None])
        logits = draft.lm_head(normed[0, n - 1:]).float()  # [k, Vd]
        return logits, self.draft_to_target[logits.argmax(-1)]

    def propose(self, k: int, pick, greedy: bool = False):
        """k proposals (target ids) from one forward, and each one's draft logits [Vd]. `greedy`: the
        argmax's, a tensor [k] on the device (read with the acceptance decision)."""
        logits, proposals = self.round(k)
        if greedy:
            return proposals, logits
        return [self.target_ids[int(pick(row))] for row in logits], list(logits)


@dataclass
class PEagleDecoder(Decoder):
    """k proposals per round from one draft forward."""

    runner: PEagleRunner
    k: int

    def generate(self, target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                 sampler: Sampler) -> DecodeResult:
        runner = self.runner
        runner.reset(len(prompt) + max_new_tokens + self.k)
        return decode_rounds(
            target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
            start=lambda first, aux: runner.start(prompt[1:] + first, aux),
            propose=lambda last: runner.propose(self.k, sampler.pick, greedy=sampler.greedy),
            verify=lambda drafts, logits_d, logits: accept(drafts, logits_d, logits, runner.draft_to_target, sampler),
            commit=runner.read)

    def reserve(self, tokens: int) -> None:
        # a round reads its n <= k + 1 pending rows and writes k - 1 mask slots past the text
        self.runner.reset(tokens + 2 * self.k)

    def step_keys(self, target: TargetRunner, prompts: list[int]) -> list:
        """The draft's rounds and prompt reads (PEagleRunner.step_keys), and the target's verify of k + 1."""
        return self.runner.step_keys(self.k, prompts) + [(target.steps, self.k + 1)]


def decode_settings(cfg: PEagleConfig, *, k: int, tree, k_given: bool, source: str):
    """(k, no tree, None): the trained depths K by default; -k up to K (a mask slot past the trained
    depths would be untrained)."""
    if tree:
        raise ValueError(f"--tree drafts EAGLE-3 token trees; {source} is a P-EAGLE draft, which proposes a chain of "
                         f"up to {cfg.num_depths} tokens in one forward")
    if not k_given:
        return cfg.num_depths, None, None
    if not 1 <= k <= cfg.num_depths:
        raise ValueError(f"-k {k}: P-EAGLE draft {source} was trained for {cfg.num_depths} depths; pass -k from 1 "
                         f"to {cfg.num_depths}")
    return k, None, None


@torch.inference_mode()
def training_logits(draft: PEagleDraft, ids: torch.Tensor, aux: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """The training forward's logits [k, Vd] of the rollout anchored at `anchor`, depths 0..k-1 (the
    context: every row 0..len(ids)-2 at depth 0)."""
    device = draft.fc.weight.device
    kept = [torch.tensor([anchor])] * (k - 1)
    a, d, real = pack_batch([pack_row(len(ids), kept)], device)
    states = packed_states(draft, ids[None].to(device), aux[None].to(device), a, d, real, "sdpa")[0]
    rows = torch.cat([torch.tensor([anchor]), len(ids) - 1 + torch.arange(k - 1)]).to(device)
    return draft.lm_head(states[rows]).float()


def decode_matches_training(draft: PEagleDraft, ids: torch.Tensor, aux: torch.Tensor, k: int | None = None):
    """(the decoder's first round after the sequence ids (its rows 0..T-2 read by the decoder's
    start), the training forward of the rollout anchored at T-2), [k, Vd] each, k = the trained
    depths by default."""
    k = k or draft.cfg.num_depths
    runner = PEagleRunner(draft)
    runner.start(ids[1:].tolist(), aux[:-1])
    return runner.forward(k), training_logits(draft, ids, aux, len(ids) - 2, k)
