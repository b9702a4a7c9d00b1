"""Continuous batching over a per-slot KV cache: the hf backend's fast path.

The engine keeps `slots` sequences in one pre-allocated KV cache, [slots, kv_heads, capacity,
head_dim] per layer. A slot holds one request: its prompt, left-padded within the group it was
admitted with, then the tokens it generates, one column each. A decode step moves every slot one
token on; every `sync_every` steps the host looks at which slots finished, hands their tokens back
(the caller may answer with follow-up requests: the next turn of a conversation), and refills the
free slots with the longest waiting prompts, one prefill forward per group.

What this removes against `model.generate` over static batches: slots that idle once their
sequence ended (a static batch runs until its longest answer), the dynamic cache's copies (one
`torch.cat` per layer and step), a host sync every step (between looks the host only queues
kernels, so launches run ahead of the device), and batch boundaries between turns (every request
of a shard streams through one engine).

The model runs through its own forward (Target.forward) with a `SlotCache` in place of
transformers' Cache and an explicit 4D mask (transformers passes a 4D mask through untouched),
so any decoder whose layers are full or sliding-window attention over sdpa or eager works
(`supported`), wherever the target is placed: each layer's cache lives on that layer's device,
and under tensor parallelism holds that rank's KV heads.

A decode step of an sdpa target attends over the stored keys and values as they are, never
expanded to the query heads. Given an explicit mask, transformers' sdpa attention (5.17, as the
device image has it; 5.24 folds a single query itself, as below) does not use SDPA's `enable_gqa`
(on CUDA a masked GQA call falls back to the math kernel) but `repeat_kv`: a copy of every layer's
attended cache, keys and values, at G = heads / kv_heads times its size, at every step, the
largest kernel of the profiled decode step (docs/LOG.md). The engine's
forward runs the layers with `folded_sdpa_attention` instead (registered with transformers as
SLOT_ATTENTION and selected for the engine's forward only: `slot_attention`): with one query per
row, the G query heads that share a KV head become G query rows against that head's keys, which
gives each (head, query) the same softmax over the same keys (the math at the function).
Prefill, eager targets and what the fold does not cover run transformers' own path.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from specfoundry.common.target import Target, mask_layout
from specfoundry.decoding.attention import ONE_QUERY_FOLDED_ATTENTION, folded_attention
from specfoundry.decoding.steps import CapturedSteps, Step
from specfoundry.decoding.target import graphs_possible
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.backends.sampling import next_tokens

COLUMN_ROUND = 64  # attended columns are rounded up to a multiple of this: few distinct shapes
PREFILL_TOKENS = 32768  # padded prompt tokens in one prefill forward, at most


class EngineMemoryError(RuntimeError):
    """The KV cache the settings ask for does not fit on the device."""


def supported(model) -> bool:
    """Whether the engine can drive the model: sdpa or eager attention (its masks are ready 4D
    tensors) over a layout common/target.py's mask_layout describes."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "_attn_implementation", "eager") in ("sdpa", "eager") and mask_layout(config) is not None


SLOT_ATTENTION = ONE_QUERY_FOLDED_ATTENTION  # transformers' name of the engine's folded attention (one query a row)


def slot_attention(config, use: bool = True):
    """The engine's forward with the fold for one query a row (decoding/attention.py): a decode
    step folds; prefill (several queries a row) goes to transformers' sdpa path."""
    return folded_attention(config, max_queries=1, use=use)


class SlotCache:
    """What the attention layers call in place of a transformers Cache.

    Prefill (`rows` set): a layer's keys and values [n, kv_heads, W, head_dim] are the whole prompts
    of the slots `rows`; they are stored in those slots' first W columns and attended as they are.
    Decode (`rows` None): keys and values [slots, kv_heads, 1, head_dim] are stored at each slot's
    column `columns[b]`, and the layer attends over the first `window` columns of every slot."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [slots, kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.rows: torch.Tensor | None = None  # [n] slot of each prefill row
        self.columns: torch.Tensor | None = None  # [slots] column each slot writes in decode
        self.window = 0
        self.slot_ids: dict[torch.device, torch.Tensor] = {}  # per device: 0..slots-1

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """rows, columns or slot_ids on `device` (a device map puts the layers on several)."""
        if name == "slot_ids":
            if device not in self.slot_ids:
                self.slot_ids[device] = torch.arange(self.slots, device=device)
            return self.slot_ids[device]
        t = getattr(self, name)
        return t if t.device == device else t.to(device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            shape = (self.slots, key.shape[1], self.capacity, key.shape[3])
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape[:3] + (value.shape[3],))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is not None:
            width = key.shape[2]
            rows = self.on("rows", key.device)
            keys[rows, :, :width] = key
            values[rows, :, :width] = value
            return key, value
        slot_ids, columns = self.on("slot_ids", key.device), self.on("columns", key.device)
        keys[slot_ids, :, columns] = key[:, :, 0]  # [slots, kv_heads, head_dim]
        values[slot_ids, :, columns] = value[:, :, 0]
        return keys[:, :, : self.window], values[:, :, : self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def grow(self, capacity: int) -> None:
        """More columns per slot, keeping what is stored."""
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = torch.cat([t, t.new_zeros(t.shape[:2] + (capacity - t.shape[2], t.shape[3]))], dim=2)
        self.capacity = capacity


@dataclass(order=True)
class Waiting:
    """A request in the queue; the longest prompt first, then first come."""

    sort_key: tuple[int, int]
    ids: list[int] = field(compare=False)
    seed: int = field(compare=False)
    tag: object = field(compare=False)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def kv_bytes_per_token(model) -> int | None:
    """Bytes of keys and values per token of context over all layers, from the config."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return 2 * c.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
    except (AttributeError, TypeError):
        return None


class SlotEngine:
    """Generates token-id requests with continuous batching (see the module docstring).

    run(first, on_done): `first` is a list of (ids, seed, tag); `on_done(tag, new_ids)` is called
    as each request finishes (new_ids: its generated tokens, the stop token included when it
    stopped) and returns follow-up requests of the same shape, which join the queue."""

    def __init__(self, target: Target, *, slots: int, stop_ids: list[int], sampling: SamplingConfig,
                 sync_every: int | None = None, graphs: bool | None = None):
        """`graphs`: run each decode step as a CUDA graph, one per attended window (default: where
        decoding/target.py graphs_possible)."""
        self.target, self.model, self.slots, self.sampling = target, target.model, slots, sampling
        self.graphs = graphs_possible(target) if graphs is None else graphs
        self.max_new = sampling.max_new_tokens
        self.device = target.input_device
        self.decode_steps: CapturedSteps | None = None  # made with the state they read (allocate)
        assert supported(self.model), "the slot engine cannot drive this model (see supported())"
        config = target.config
        self.additive = config._attn_implementation == "eager"  # eager adds its mask to the scores
        # on a GPU the host looks every few steps, so launches run ahead; on a CPU nothing runs
        # ahead and a finished slot would only idle
        self.sync_every = sync_every or (8 if self.device.type == "cuda" else 1)
        self.refill_at = max(1, slots // 8)  # free slots worth one prefill forward
        self.stop = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        self.fold = config._attn_implementation == "sdpa"  # attend over the unexpanded cache (slot_attention)

    # ---- device state ---------------------------------------------------------------------

    def allocate(self, capacity: int) -> None:
        self.check_memory(self.slots, capacity)
        # by attended window; a step advances the slots' state, so it is captured at its second call
        self.decode_steps = CapturedSteps(self.device, lambda window: Step(lambda x: self.decode_step(window)),
                                          graphs=self.graphs, idempotent=False)
        self.cache = SlotCache(self.slots, capacity)
        s, dev = self.slots, self.device
        self.start = torch.zeros(s, dtype=torch.long, device=dev)  # first column of the slot's prompt
        self.end = torch.zeros(s, dtype=torch.long, device=dev)  # column the next token's keys go to
        self.count = torch.zeros(s, dtype=torch.long, device=dev)  # tokens generated
        self.seeds = torch.zeros(s, dtype=torch.long, device=dev)
        self.last = torch.zeros(s, dtype=torch.long, device=dev)  # token fed at the next step
        self.live = torch.zeros(s, dtype=torch.bool, device=dev)  # holds a request that is not finished
        self.out = torch.zeros((s, self.max_new), dtype=torch.long, device=dev)  # [slots, max_new]
        self.tags: list[object | None] = [None] * s  # host: the request each slot holds
        self.admitted: list[tuple[int, int]] = [(0, 0)] * s  # host: (prompt width, step) at admission
        self.steps = 0
        self.horizon = 0  # host: an upper bound of every held slot's `end`

    def check_memory(self, slots: int, capacity: int) -> None:
        per_token = kv_bytes_per_token(self.model)
        if self.device.type != "cuda" or per_token is None or self.target.placement.device_map:
            return  # (a device map spreads the cache over the layers' devices)
        need = slots * capacity * per_token // self.target.placement.copy_size  # a rank holds 1/N of the KV heads
        # the driver's free memory plus the blocks torch's caching allocator holds unused, which it
        # releases before it gives up: after a model.generate batch those can be most of the card
        free = (torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
                - torch.cuda.memory_allocated(self.device))
        if need > 0.9 * free:
            raise EngineMemoryError(
                f"the KV cache for --batch-size {slots} at {capacity} tokens per sequence needs "
                f"{need / 2**30:.1f} GiB, the device has {free / 2**30:.1f} GiB free: lower --batch-size")

    def ensure_capacity(self, prompt_len: int) -> None:
        need = round_up(prompt_len + self.max_new, COLUMN_ROUND)
        if need > self.cache.capacity:
            self.check_memory(self.slots, need)
            self.cache.grow(need)
            self.decode_steps.drop()  # they read the old cache

    # ---- masks ----------------------------------------------------------------------------

    def mask(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, kv_valid: torch.Tensor):
        """The 4D mask(s) [B, 1, q, kv] the model takes: q_pos [B, q], kv_pos / kv_valid [B, kv]."""
        seen = kv_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])  # [B, q, kv]
        return self.target.attention_masks(seen, q_pos, kv_pos, additive=self.additive)

    def forward(self, input_ids: torch.Tensor, mask, positions: torch.Tensor) -> torch.Tensor:
        """[B, V] fp32 logits of each row's last position."""
        with slot_attention(self.target.config, self.fold):
            step = self.target.forward(input_ids, positions=positions, mask=mask, cache=self.cache, logits_to_keep=1)
        return step.logits[:, -1]

    # ---- admission, steps, collection -----------------------------------------------------

    def admit(self, group: list[Waiting], free: list[int]) -> None:
        """Prefill `group` into the slots `free[:len(group)]` and sample each one's first token."""
        width = max(len(w.ids) for w in group)
        self.ensure_capacity(width)
        slots = free[: len(group)]
        pad = [width - len(w.ids) for w in group]
        ids = torch.tensor([[0] * p + w.ids for p, w in zip(pad, group, strict=True)])  # [n, W] left-padded
        pos = torch.arange(width)[None, :] - torch.tensor(pad)[:, None]  # [n, W], < 0 on padding
        ids, pos = ids.to(self.device), pos.to(self.device)
        rows = torch.tensor(slots, device=self.device)
        # a padding row (q_pos < 0) sees no key; it attends to itself, so no softmax row is empty
        padding = torch.eye(width, dtype=torch.bool, device=self.device)[None] & (pos < 0)[:, :, None]
        mask = self.with_diagonal(self.mask(pos, pos, pos >= 0), padding)
        self.cache.rows = rows
        logits = self.forward(ids, mask, pos.clamp(min=0))
        self.cache.rows = None
        seeds = torch.tensor([w.seed for w in group], device=self.device)
        first = next_tokens(logits, self.sampling, seeds, torch.zeros_like(seeds))  # [n]
        self.start[rows] = torch.tensor(pad, device=self.device)
        self.end[rows] = width
        self.count[rows] = 1
        self.seeds[rows] = seeds
        self.last[rows] = first
        self.out[rows, 0] = first
        self.live[rows] = ~torch.isin(first, self.stop) & (self.max_new > 1)
        for slot, w in zip(slots, group, strict=True):
            self.tags[slot] = w
            self.admitted[slot] = (width, self.steps)
        self.horizon = max(self.horizon, width)

    def with_diagonal(self, mask, diagonal: torch.Tensor):
        if isinstance(mask, dict):
            return {k: self.with_diagonal(m, diagonal) for k, m in mask.items()}
        if self.additive:
            return mask.masked_fill(diagonal[:, None], 0)
        return mask | diagonal[:, None]

    def step(self) -> None:
        """Every slot one token on (free and finished slots compute too, and change nothing). The
        slots attend over the first `window` columns, the held slots' furthest end rounded up: on a
        GPU one captured graph per window replays the step (decode_step), no host work but the launch."""
        window = min(self.cache.capacity, round_up(self.horizon + 1, COLUMN_ROUND))
        self.decode_steps(window)
        self.steps += 1
        self.horizon += 1

    def decode_step(self, window: int) -> None:
        """One decode step over the device state alone, every update in place (the state tensors of
        allocate keep their addresses, which a captured graph reads and writes)."""
        cols = torch.arange(window, device=self.device)[None, :]  # [1, window]
        q_pos = (self.end - self.start)[:, None]  # [slots, 1]
        kv_pos = cols - self.start[:, None]  # [slots, window]
        mask = self.mask(q_pos, kv_pos, (kv_pos >= 0) & (cols <= self.end[:, None]))
        self.cache.columns, self.cache.window = self.end, window
        logits = self.forward(self.last[:, None], mask, q_pos)
        token = next_tokens(logits, self.sampling, self.seeds, self.count)  # [slots]
        live = self.live.clone()
        at = self.count.clamp(max=self.max_new - 1)[:, None]  # [slots, 1]
        self.out.scatter_(1, at, torch.where(live[:, None], token[:, None], self.out.gather(1, at)))
        self.count += live
        self.last.copy_(torch.where(live, token, self.last))
        self.end += live
        self.live.copy_(live & ~torch.isin(token, self.stop) & (self.count < self.max_new))

    def collect(self) -> list[tuple[Waiting, list[int]]]:
        """The requests that finished since the last look, with their tokens; their slots freed."""
        held = [b for b, t in enumerate(self.tags) if t is not None]
        live = self.live.tolist()
        done = [b for b in held if not live[b]]
        if not done:
            return []
        rows = torch.tensor(done, device=self.device)
        counts = self.count[rows].tolist()
        tokens = self.out[rows].tolist()
        finished = [(self.tags[b], tokens[i][: counts[i]]) for i, b in enumerate(done)]
        for b in done:
            self.tags[b] = None
        # a slot's end moved at most one column per step since its admission
        self.horizon = max((width + self.steps - at for (width, at), t in zip(self.admitted, self.tags, strict=True)
                            if t is not None), default=0)
        return finished

    @torch.inference_mode()
    def run(self, first: Iterable[tuple[list[int], int, object]],
            on_done: Callable[[object, list[int]], Iterable[tuple[list[int], int, object]]]) -> None:
        queue: list[Waiting] = []
        arrivals = 0

        def enqueue(items):
            nonlocal arrivals
            for ids, seed, tag in items:
                heapq.heappush(queue, Waiting((-len(ids), arrivals), list(ids), seed, tag))
                arrivals += 1

        enqueue(first)
        if not queue:
            return
        self.allocate(round_up(len(queue[0].ids) + self.max_new, COLUMN_ROUND))
        try:
            while queue or any(t is not None for t in self.tags):
                free = [b for b, t in enumerate(self.tags) if t is None]
                if queue and (len(free) >= self.refill_at or len(free) == self.slots):
                    self.refill(queue, free)
                for _ in range(self.sync_every):
                    self.step()
                for waiting, tokens in self.collect():
                    enqueue(on_done(waiting.tag, tokens) or ())
        finally:
            self.release()

    def release(self) -> None:
        """Frees the KV cache and the captured steps now. A captured step's closure refers back to
        the engine, a reference cycle that only Python's cycle collector breaks, whenever it happens
        to run: sf-regen makes an engine per group of shards, and the stale caches of earlier groups
        filled a GPU at the SmolLM2 recipe's 2,048 slots (docs/LOG.md)."""
        self.decode_steps = None
        self.cache = None

    def refill(self, queue: list[Waiting], free: list[int]) -> None:
        """Admit the longest waiting prompts into the free slots, in groups of bounded padded size."""
        taken = [heapq.heappop(queue) for _ in range(min(len(free), len(queue)))]
        while taken:
            n = 1
            while n < len(taken) and (n + 1) * len(taken[0].ids) <= PREFILL_TOKENS:
                n += 1
            self.admit(taken[:n], free)
            free, taken = free[n:], taken[n:]
