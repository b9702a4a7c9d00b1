"""The target over a static KV cache of one sequence, its decode steps replayed as CUDA graphs.

Every family's decoder verifies with a TargetRunner: `forward(ids)` reads T tokens after the
committed ones and returns their logits, aux features and (if asked) final states; `crop(n)`
keeps the first n (a rejected draft is forgotten by moving the length: decoding/cache.py). One
step body serves every path:

    offset[c]   = c - start                       for each cache column c (start: columns committed)
    allowed[t,c] = offset[c] < 0                  the committed text
                 | 0 <= offset[c] < T and pattern[t, offset[c]]   the step's own tokens
    kv_pos[c]   = c where committed, positions[offset[c]] where written by this step

`pattern` [T, T] is causal for a prompt or a chain, a tree's ancestor mask for a tree verify;
Target.attention_masks turns `allowed` into the model's ready 4D mask(s), windowed for sliding
layers by (query position - kv_pos). Grouped-query layers attend over the cache as stored
(decoding/attention.py).

On a GPU (one device, no tensor parallelism or device map) the body runs as the decoding
core's captured steps (decoding/steps.py): a step of T tokens after the prompt is one key, its
inputs (ids, positions, start, pattern) staged from pinned memory, one graph launch, no
synchronisation. Its outputs are the graph's buffers, valid until the next step of the same T;
callers read them before then (the decoders take what they keep by indexing, which copies). A
prompt of at most PROMPT_GRAPH_MAX tokens is prefilled by a captured step too, padded to its
bucket (steps.prompt_bucket): its pad rows sit after the prompt, which the causal pattern hides
from the prompt's rows, write cache columns past the committed length, which no later step sees,
and their logits are dropped; eagerly, a prefill's some 1,500 kernel launches for a 30-layer
target cost more host time than the rest of a short answer's decode. `compiled` runs the steps
after the prompt through torch.compile: a small target's captured step is host-bound (its graph
launch, some 45 kernels a layer, takes longer on the host than the kernels on the device), and
inductor fuses the norms', the rotary's and the MLP's elementwise pieces. A longer prompt, a step
that wants the final states, and everything off a GPU run the same body eagerly: a CPU test runs
exactly the code a GPU replays.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specfoundry.common.target import Target
from specfoundry.decoding.attention import folded_attention
from specfoundry.decoding.cache import StaticKVCache, visible
from specfoundry.decoding.steps import PROMPT_GRAPH_MAX, CapturedSteps, Step, prompt_bucket, prompt_buckets
from specfoundry.kernels.tree_attention import raise_config, recompile_limit_hit

FOLD_QUERIES: int | None = None
"""The most queries a row the target runner's steps attend with the fold (decoding/attention.py
FOLDS; None: every step), more through transformers' sdpa path (repeat_kv). A token step folds
either way; benchmarks/decode_step.py measures the verify and tree steps both ways."""

COMPILED_SHAPES = 64
"""Step shapes torch.compile may meet (`compiled`): one per token count, cache capacity and tap, over
every compiled runner of the process. dynamo's default of 8 is too few: a tree verify's width
varies with the pending tokens, one shape per depth. Past it a step fails in one line."""

COLUMN_ROUND = 256
"""Capacities are rounded up to a multiple of this, so nearby lengths share a cache and its graphs."""


def causal(tokens: int) -> torch.Tensor:
    """[T, T] bool: each token sees itself and the tokens before it."""
    return torch.ones(tokens, tokens, dtype=torch.bool).tril()


def graphs_possible(target: Target) -> bool:
    """Whether the target's decode steps can run as CUDA graphs: on one CUDA device, unsharded."""
    return (target.input_device.type == "cuda" and not target.distributed and not target.placement.device_map)


class TargetRunner:
    """The target (common/target.Target) with a static KV cache for one sequence; its tap gives the
    aux layers' outputs of each step. `graphs`: capture decode steps as CUDA graphs (default: where
    graphs_possible). `fold_queries`: the most queries a row attended with the fold (FOLD_QUERIES).
    `compiled`: the captured steps after the prompt run the body through torch.compile; `dynamic`:
    compiled once for one token and once for all wider steps together, not once per width
    (compiled_step)."""

    def __init__(self, target: Target, aux_layers: list[int], *, graphs: bool | None = None,
                 fold_queries: int | None = FOLD_QUERIES, compiled: bool = False, dynamic: bool = False):
        self.target = target
        self.model = target.model
        self.tap = target.tap(aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.device = target.input_device
        self.graphs = graphs_possible(target) if graphs is None else graphs
        self.fold_queries = fold_queries
        # eager attention adds its mask to the scores; sdpa takes a boolean one
        self.additive = target.config._attn_implementation == "eager"
        self.cache: StaticKVCache | None = None
        self.length = 0  # committed columns
        self.compiled = compiled
        if compiled:
            config = torch._dynamo.config
            raise_config(config, ("recompile_limit", "cache_size_limit"), COMPILED_SHAPES)
            raise_config(config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4 * COMPILED_SHAPES)
        # steps after the prompt, by token count; prompt reads by bucket (prompt_bucket), never compiled
        self.steps = CapturedSteps(self.device, self.step, graphs=self.graphs, compiled=compiled, dynamic=dynamic)
        self.prefills = CapturedSteps(self.device, self.step, graphs=self.graphs)

    def remove_hooks(self) -> None:
        self.tap.remove()

    def reset(self, reserve: int = 0) -> None:
        """Start a new sequence of at most `reserve` tokens (prompt, answer and one round's drafts;
        the cache grows if a sequence outruns it). Nothing is reallocated when it fits."""
        self.length = 0
        self.reserve(reserve)

    def reserve(self, tokens: int) -> None:
        capacity = -(-max(tokens, 1) // COLUMN_ROUND) * COLUMN_ROUND
        if self.cache is not None and capacity <= self.cache.capacity:
            return
        self.cache = StaticKVCache(capacity) if self.cache is None else self.cache.grown(capacity)
        self.kv_index = torch.arange(capacity, device=self.device)  # [C]
        self.steps.drop()  # their graphs read the old cache
        self.prefills.drop()

    def __len__(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Keep the first `length` committed tokens (a rejected draft's columns are overwritten later)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @torch.inference_mode()
    def forward(self, ids: list[int], want_hidden: bool = False, positions: list[int] | None = None,
                mask: torch.Tensor | None = None, tail: torch.Tensor | None = None):
        """Read `ids` (then `tail`, ids [n] on the device: proposals the host has not read) after the
        committed tokens. Returns logits [T, V] (fp32), aux [T, K*H] and, if asked, the final normed
        state [T, H]. By default the tokens follow causally at the next positions; a token tree
        passes its own `positions` and `mask` ([T, start + T] bool, True = may attend), whose
        committed part must be all True (every node sees the committed text)."""
        start, count = self.length, len(ids) + (0 if tail is None else tail.shape[0])
        positions = list(range(start, start + count)) if positions is None else list(positions)
        if mask is None:
            pattern = causal(count)
        else:
            assert tuple(mask.shape) == (count, start + count) and bool(mask[:, :start].all()), \
                "a step sees every committed token"
            pattern = mask[:, start:].cpu()
        self.reserve(start + count)
        if self.graphs and start > 0 and not want_hidden:
            try:
                out = self.steps(count, ids=(ids, tail), positions=positions, start=start, pattern=pattern)
            except recompile_limit_hit() as e:
                raise RuntimeError(f"the compiled target steps met more than {COMPILED_SHAPES} step shapes in this "
                                   "process (COMPILED_SHAPES); run without --compile-target") from e
        elif (self.graphs and start == 0 and not want_hidden and tail is None and mask is None
              and count <= PROMPT_GRAPH_MAX and prompt_bucket(count) <= self.cache.capacity):
            bucket = prompt_bucket(count)  # (a prefill never grows the cache for its pad)
            pad = bucket - count  # rows after the prompt's: token 0 at the next positions, causal
            logits, aux, _ = self.prefills(bucket, ids=ids + [0] * pad, positions=positions + list(range(count, bucket)),
                                           start=0, pattern=causal(bucket))
            out = logits[:count], aux[:count], None  # (views of the graph's buffers, as a step's are)
        else:
            head = torch.tensor(ids, dtype=torch.long, device=self.device)
            x = SimpleNamespace(ids=head if tail is None else torch.cat([head, tail.to(self.device)]),
                                positions=torch.tensor(positions, device=self.device),
                                start=torch.tensor(start, device=self.device), pattern=pattern.to(self.device))
            out = self.body(x, want_hidden)
        self.length = start + count
        return out

    def step(self, tokens: int) -> Step:
        """The captured step of `tokens` tokens (decoding/steps.py): ids, positions [T] int64, start []
        int64, pattern [T, T] bool, initially a causal read at the first positions."""
        inputs = dict(ids=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens),
                      start=torch.tensor(0), pattern=causal(tokens))
        return Step(lambda x: self.body(x, want_hidden=False), inputs)

    def warm(self, tokens: list[int] = (), prompts: list[int] = ()) -> None:
        """Capture (and compile) now the steps of these token counts and the prompt reads of these
        prompt lengths (their buckets), so that none is captured inside a timed decode."""
        self.steps.warm(tokens)
        self.prefills.warm(prompt_buckets(prompts))

    def body(self, x: SimpleNamespace, want_hidden: bool):
        """One step over the static cache (the module docstring's mask), as eager code or under capture."""
        count = x.ids.shape[0]
        allowed = visible(self.kv_index, x.start, x.pattern)  # [T, C]
        offset = self.kv_index - x.start  # [C]
        kv_pos = torch.where(offset < 0, self.kv_index, x.positions[offset.clamp(0, count - 1)])  # [C]
        masks = self.target.attention_masks(allowed[None], x.positions[None], kv_pos[None], additive=self.additive)
        self.cache.columns = x.start + self.kv_index[:count]  # [T]
        with folded_attention(self.target.config, self.fold_queries):
            step = self.target.forward(x.ids[None], positions=x.positions[None], mask=masks, cache=self.cache,
                                       hidden=want_hidden)
        aux = self.tap.take()[0]  # [T, K*H]
        return step.logits[0], aux, (step.final[0] if want_hidden else None)
