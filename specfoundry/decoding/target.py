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

On a GPU (one device, no tensor parallelism or device map) a step of T tokens after the prompt
is captured once as a CUDA graph over static buffers (its ids, positions, start and pattern) and
replayed: one small host-to-device copy of those inputs from pinned memory (the pattern only when
it changed), one graph launch, no synchronisation. Its outputs are the graph's buffers, valid
until the next step of the same T; callers read them before then (the decoders take what they
keep by indexing, which copies). A prompt of at most PREFILL_GRAPH_MAX tokens is prefilled by a
captured step too, padded to the next power of two (prefill_bucket): its pad rows sit after the
prompt, which the causal pattern hides from the prompt's rows, write cache columns past the
committed length, which no later step sees, and their logits are dropped. Eagerly, a prefill's
host work (some 1,500 kernel launches for a 30-layer target) cost more than the rest of a short
answer's decode (benchmarks/RESULTS.md, "Decoding"). A longer prompt, a step that wants the final
states, and everything on a CPU run the same body eagerly: a CPU test runs exactly the code a GPU
replays.
"""

from __future__ import annotations

import torch

from specfoundry.common.target import Target
from specfoundry.decoding.attention import folded_attention
from specfoundry.decoding.cache import StaticKVCache, visible
from specfoundry.decoding.graphs import CapturedCall, PinnedStaging, compiled_step
from specfoundry.kernels.tree_attention import raise_config, recompile_limit_hit

FOLD_QUERIES: int | None = None
"""The most queries a row the target runner's steps attend with the fold (decoding/attention.py
FOLDS; None: every step), more through transformers' sdpa path (repeat_kv). A token step folds
either way; benchmarks/decode_step.py measures the verify and tree steps both ways."""

COMPILED_SHAPES = 64
"""Step shapes torch.compile may meet (`compiled`): one per token count, cache capacity and tap, over
every compiled runner of the process. dynamo's default of 8 is too few: a tree verify's width
varies with the pending tokens, one shape per depth. Past it a step fails in one line."""

PREFILL_GRAPH_MAX = 512
"""The longest prompt prefilled by a captured step (padded to its bucket, the module docstring); a
longer one runs eagerly, where its kernels' time outweighs their launches. Each bucket's graph
keeps its own pool, fp32 logits of all its rows included: 1,008 rows over the six buckets, about
0.5 GB at a vocabulary of 128k."""

PREFILL_MIN_BUCKET = 16
"""The smallest prefill bucket: buckets are the powers of two from it to PREFILL_GRAPH_MAX (6 graphs
at most, each captured at its first use, without torch.compile even in a compiled runner)."""


def prefill_bucket(tokens: int) -> int:
    """The padded length of a captured prefill of `tokens` (<= PREFILL_GRAPH_MAX): a power of two."""
    return max(PREFILL_MIN_BUCKET, 1 << (max(tokens, 1) - 1).bit_length())


COLUMN_ROUND = 256
"""Capacities are rounded up to a multiple of this, so nearby lengths share a cache and its graphs."""


def graphs_possible(target: Target) -> bool:
    """Whether the target's decode steps can run as CUDA graphs: on one CUDA device, unsharded."""
    return (target.input_device.type == "cuda" and not target.distributed and not target.placement.device_map)


class StepInputs:
    """A step's inputs as the body reads them: ids, positions [T] int64, start [] int64, pattern [T, T] bool."""

    def __init__(self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, pattern: torch.Tensor):
        self.ids, self.positions, self.start, self.pattern = ids, positions, start, pattern


class GraphStep:
    """One captured step of T tokens: static inputs (device), their pinned host staging, the graph and its
    outputs. `compiled`: its body runs through the runner's torch.compile (captured_body)."""

    def __init__(self, runner: TargetRunner, tokens: int, compiled: bool):
        device = runner.device
        self.tokens = tokens
        self.staging = PinnedStaging(device)
        self.host = self.staging.buffer(2 * tokens + 1, dtype=torch.int64)  # ids | positions | start
        self.staged = torch.zeros(2 * tokens + 1, dtype=torch.int64, device=device)
        self.host_pattern = self.staging.buffer(tokens, tokens, dtype=torch.bool)
        self.pattern = torch.zeros(tokens, tokens, dtype=torch.bool, device=device)
        self.inputs = StepInputs(self.staged[:tokens], self.staged[tokens: 2 * tokens], self.staged[2 * tokens],
                                 self.pattern)
        self.call = CapturedCall(lambda: runner.captured_body(self.inputs, compiled), device,
                                 check_host_reads=not compiled)  # (graphs.py: compiled code on a CPU)

    def load(self, ids: list[int], positions: list[int], start: int, pattern: torch.Tensor,
             tail: torch.Tensor | None = None) -> None:
        """Copy the step's inputs in: one asynchronous copy from pinned memory (two when the pattern
        changed), and `tail`, the last ids, from the device (a copy on the device, after it). The host
        buffers are rewritten only once the last copy from them has run."""
        self.staging.wait()
        self.host[: len(ids)] = torch.tensor(ids)
        self.host[self.tokens: 2 * self.tokens] = torch.tensor(positions)
        self.host[2 * self.tokens] = start
        self.staged.copy_(self.host, non_blocking=True)
        if tail is not None:
            self.staged[len(ids): self.tokens].copy_(tail)
        if not torch.equal(self.host_pattern, pattern):
            self.host_pattern.copy_(pattern)
            self.pattern.copy_(self.host_pattern, non_blocking=True)
        self.staging.sent()

class TargetRunner:
    """The target (common/target.Target) with a static KV cache for one sequence; its tap gives the
    aux layers' outputs of each step. `graphs`: capture decode steps as CUDA graphs (default: where
    graphs_possible). `fold_queries`: the most queries a row attended with the fold (FOLD_QUERIES).
    `compiled`: the captured steps run the body through torch.compile (captured_body)."""

    def __init__(self, target: Target, aux_layers: list[int], *, graphs: bool | None = None,
                 fold_queries: int | None = FOLD_QUERIES, compiled: bool = False):
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
        self.steps: dict[int, GraphStep] = {}  # by token count
        self.prefills: dict[int, GraphStep] = {}  # by bucket (prefill_bucket), never compiled
        self.compiled = compiled
        self.compiled_body = None  # the body through torch.compile, for the captured steps (captured_body)
        if compiled:
            config = torch._dynamo.config
            raise_config(config, ("recompile_limit", "cache_size_limit"), COMPILED_SHAPES)
            raise_config(config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4 * COMPILED_SHAPES)
            self.compiled_body = compiled_step(lambda inputs: self.body(inputs, want_hidden=False))

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
        self.steps.clear()  # their graphs read the old cache
        self.prefills.clear()

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
            pattern = torch.ones(count, count, dtype=torch.bool).tril()
        else:
            assert tuple(mask.shape) == (count, start + count) and bool(mask[:, :start].all()), \
                "a step sees every committed token"
            pattern = mask[:, start:].cpu()
        self.reserve(start + count)
        bucket = prefill_bucket(count) if count <= PREFILL_GRAPH_MAX else 0
        if self.graphs and start > 0 and not want_hidden:
            step = self.steps.get(count)
            if step is None:
                step = self.steps[count] = GraphStep(self, count, self.compiled)
            step.load(ids, positions, start, pattern, tail)
            out = step.call()
        elif (self.graphs and start == 0 and not want_hidden and tail is None and mask is None and bucket
              and bucket <= self.cache.capacity):  # (a prefill never grows the cache for its pad)
            step = self.prefills.get(bucket)
            if step is None:
                step = self.prefills[bucket] = GraphStep(self, bucket, compiled=False)
            pad = bucket - count  # rows after the prompt's: token 0 at the next positions, causal
            step.load(ids + [0] * pad, positions + list(range(count, bucket)), 0,
                      torch.ones(bucket, bucket, dtype=torch.bool).tril())
            logits, aux, _ = step.call()
            out = logits[:count], aux[:count], None  # (views of the graph's buffers, as a step's are)
        else:
            head = torch.tensor(ids, dtype=torch.long, device=self.device)
            inputs = StepInputs(head if tail is None else torch.cat([head, tail.to(self.device)]),
                                torch.tensor(positions, device=self.device),
                                torch.tensor(start, device=self.device), pattern.to(self.device))
            out = self.body(inputs, want_hidden)
        self.length = start + count
        return out

    def captured_body(self, x: StepInputs, compiled: bool):
        """The body of a captured step (GraphStep): as it is, or `compiled` (self.compiled's steps). A captured step of a
        small target is host-bound: its graph launch (some 45 kernels a layer, mostly the
        elementwise pieces of the norms, the rotary embedding and the gated MLP) takes longer on the
        host than its kernels on the device (benchmarks/RESULTS.md, "Decoding"); inductor fuses
        those pieces, and the launch shrinks with the node count. Compiled once per step shape
        (tokens, cache capacity; COMPILED_SHAPES) by decoding/graphs.py compiled_step."""
        if not compiled:
            return self.body(x, want_hidden=False)
        try:
            return self.compiled_body(x)
        except recompile_limit_hit() as e:
            raise RuntimeError(f"the compiled target steps met more than {COMPILED_SHAPES} step shapes in this "
                               "process (COMPILED_SHAPES); run without --compile-target") from e

    def body(self, x: StepInputs, want_hidden: bool):
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
