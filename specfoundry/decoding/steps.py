"""CapturedSteps: a decoder's eager step bodies, run at graph speed by the decoding core.

A family writes each decode step as plain eager math over device tensors, keyed by the shape it
runs at (a token count, a chain's k, a tree's branching, a prompt's bucket), and hands it here:

    steps = CapturedSteps(device, make, graphs=..., compiled=...)
    out = steps(key, ids=[...], start=5, aux=rows_on_the_device)

`make(key)` returns the key's Step: its body and its inputs' initial values (host tensors, which
fix each input's shape and dtype). Per key the kit keeps the inputs as static device tensors and
refills them at every call:
    - values from the host (ints, lists, CPU tensors) go through one pinned host buffer per dtype
      and one asynchronous copy each; a dtype whose values are all equal to what it holds (a
      tree's mask, met again) is not copied;
    - values already on the device are copied there, after the host's copies;
    - a value may be pieces, concatenated along its first dimension (ids from the host, then
      proposals the host has not read: `ids=(host_ids, device_tail)`), and may be shorter than
      its input (its first rows: a padded bucket), the rest holding what it held.
Every call gives every input. On a GPU (graphs=True) the first call of a key warms the body on a
side stream and captures it as a CUDA graph, and every call replays it (decoding/graphs.py
CapturedCall); its outputs are the graph's buffers, valid until the key's next call. `compiled`
runs the body through torch.compile (decoding/graphs.py compiled_step) inside the capture, with
symbolic shapes where `dynamic` (one compile for many keys of one body).

What the kit guarantees the decoders:
    - `drop()` forgets every key (buffers and graphs): the caller says so when state the bodies
      read was reallocated (a cache grew); the next call of a key captures it again;
    - `warm(keys)` captures the keys now, on the inputs they hold (their initial values, or the
      last call's): sf-eval warms every key a decode will meet before the first timed one, so
      that no capture or compile falls inside a timed decode;
    - a body that is not idempotent (`idempotent=False`: the slot engine's step advances its own
      state) is never run more than once a call: a key's first call runs it eagerly (its kernels'
      first-call work outside any graph), the second captures it with no warm-up.
Elsewhere (graphs=False) the body runs eagerly over the same staged inputs; graphs=True off a GPU
runs CapturedCall's CPU stand-in (host reads forbidden, warm-up repeats, outputs in fixed
buffers), so a CPU test checks what a capture needs. Nothing outside decoding/ imports graphs.py:
the kit is how a family's steps get captured.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from specfoundry.decoding.graphs import CapturedCall, compiled_step

PROMPT_GRAPH_MAX = 512
"""The longest prompt read by a captured step (the target's prefill, a draft's read of the prompt's
features), padded to its bucket (prompt_bucket); a longer one runs eagerly, where its kernels'
time outweighs their launches."""

PROMPT_MIN_BUCKET = 16
"""The smallest prompt bucket: buckets are the powers of two from it to PROMPT_GRAPH_MAX (6 keys)."""


def prompt_bucket(tokens: int) -> int:
    """The padded length of a captured prompt read of `tokens` (<= PROMPT_GRAPH_MAX): a power of two.
    Pad rows come after the prompt's, where a causal read hides them from the prompt's rows; they
    write cache columns past the committed length, which no later step sees."""
    return max(PROMPT_MIN_BUCKET, 1 << (max(tokens, 1) - 1).bit_length())


def prompt_buckets(lengths: Iterable[int]) -> list[int]:
    """The buckets the prompt reads of these lengths meet (the longer ones run eagerly)."""
    return sorted({prompt_bucket(n) for n in lengths if n <= PROMPT_GRAPH_MAX})


def read_rows(committed: int, count: int, most: int, bucketed: bool) -> int | None:
    """The rows of the captured step that reads `count` rows after `committed` ones: `count` for a
    round's commit after committed text (at most `most`), the prompt's bucket for a first read where
    `bucketed` (at most PROMPT_GRAPH_MAX), else None: the read runs eagerly."""
    if committed > 0 and 0 < count <= most:
        return count
    if bucketed and committed == 0 and 0 < count <= PROMPT_GRAPH_MAX:
        return prompt_bucket(count)
    return None


def prompt_keys(steps: CapturedSteps, lengths: Iterable[int], key=lambda bucket: bucket) -> list:
    """[(steps, key(bucket))] of the prompt reads of these lengths, where `steps` is captured."""
    return [(steps, key(b)) for b in prompt_buckets(lengths)] if steps.graphs else []


@dataclass
class Step:
    """One key's body and its inputs: `body(x)` reads x.<name> (static device tensors, refilled at
    every call) and returns its outputs; `inputs` {name: initial host value}."""

    body: Callable[[SimpleNamespace], object]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def pieces(value: tuple) -> list:
    """A tuple value's pieces, concatenated along the first dimension: each a tensor, a list of
    numbers, or None (nothing)."""
    return [v for v in value if v is not None]


class _Group:
    """The inputs of one dtype: views of one flat device tensor, staged from one host buffer."""

    def __init__(self, dtype: torch.dtype, size: int, device: torch.device, pinned: bool):
        self.host = torch.zeros(max(size, 1), dtype=dtype, pin_memory=pinned)
        self.device = torch.zeros(max(size, 1), dtype=dtype, device=device)
        self.stale = False  # a value copied on the device made `device` differ from `host`


class _Input:
    """One input: its group, its shape, its views there (on the device, on the host and, where
    numpy has the dtype, the host's numpy view: a host value written through numpy costs no torch
    dispatch, which is most of a small step's host time)."""

    def __init__(self, group: _Group, span: slice, shape: tuple[int, ...]):
        self.group, self.shape = group, shape
        self.length = shape[0] if shape else 1
        self.device = group.device[span].view(shape)
        self.host = group.host[span].view(shape)
        self.numpy = self.host.numpy() if group.host.dtype in NUMPY_DTYPES else None

    def rows(self, t, start: int, count: int):
        """Rows start..start+count of t (a view of this input); the whole input when it has no rows."""
        if not self.shape or (start == 0 and count == self.length):
            return t
        return t[start: start + count]


NUMPY_DTYPES = (torch.int64, torch.int32, torch.bool, torch.float32)


class Staged:
    """A key's static inputs and how a call refills them (the module docstring)."""

    def __init__(self, inputs: dict[str, torch.Tensor], device: torch.device):
        self.device = device
        self.on_gpu = device.type != "cpu"
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # after the last host-to-device copy
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, value in inputs.items():
            value = torch.as_tensor(value)
            by_dtype.setdefault(value.dtype, []).append((name, value))
        self.groups: list[_Group] = []
        self.inputs: dict[str, _Input] = {}
        for dtype, named in by_dtype.items():
            group = _Group(dtype, sum(v.numel() for _, v in named), device, self.copied is not None)
            offset = 0
            for name, value in named:
                self.inputs[name] = _Input(group, slice(offset, offset + value.numel()), tuple(value.shape))
                self.inputs[name].host.copy_(value)
                offset += value.numel()
            group.device.copy_(group.host)
            self.groups.append(group)
        self.x = SimpleNamespace(**{name: i.device for name, i in self.inputs.items()})

    def load(self, values: dict) -> None:
        if values.keys() != self.inputs.keys():
            raise TypeError(f"a step takes exactly the inputs {sorted(self.inputs)}, got {sorted(values)}")
        if self.copied is not None:
            self.copied.synchronize()  # the last copy from the host buffers has run: they may be rewritten
        changed: set[_Group] = set()  # groups whose host buffer this call rewrote
        unchanged: set[_Group] = set()  # groups given host values equal to what they held
        on_device = []  # (input, its rows, a device tensor) copied after the host's copies
        for name, value in values.items():
            put = self.inputs[name]
            row = 0
            for piece in (pieces(value) if type(value) is tuple else (value,)):
                row += self.place(name, put, piece, row, changed, unchanged, on_device)
        for group in changed | {g for g in unchanged if g.stale}:
            group.device.copy_(group.host, non_blocking=self.copied is not None)
            group.stale = False
        if (changed or unchanged) and self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device))
        for put, into, piece in on_device:
            into.copy_(piece if piece.shape == into.shape else piece.reshape(into.shape))
            put.group.stale = True

    def place(self, name: str, put: _Input, piece, row: int, changed: set, unchanged: set, on_device: list) -> int:
        """Write one piece of input `name` from its row `row`; returns its row count. Numbers and lists
        are written without a comparison (ids, positions, lengths change every call); a host tensor
        only where it differs from what the buffer holds (a tree's mask, met again)."""
        if isinstance(piece, torch.Tensor):
            count = piece.shape[0] if put.shape and piece.dim() else 1
        else:
            count = len(piece) if isinstance(piece, list) else 1
        if row + count > put.length:
            raise ValueError(f"input {name}: {row + count} rows given, it holds {put.length}")
        if isinstance(piece, torch.Tensor):
            if piece.device.type != "cpu" and self.on_gpu:
                on_device.append((put, put.rows(put.device, row, count), piece))
                return count
            into = put.rows(put.host, row, count)
            piece = piece.reshape(into.shape)
            if torch.equal(into, piece if piece.dtype == into.dtype else piece.to(into.dtype)):
                unchanged.add(put.group)
            else:
                into.copy_(piece)
                changed.add(put.group)
        elif put.numpy is not None:  # numbers through numpy: no torch dispatch
            if put.shape:
                put.numpy[row: row + count] = piece
            else:
                put.numpy[()] = piece
            changed.add(put.group)
        else:
            put.rows(put.host, row, count).copy_(torch.tensor(piece, dtype=put.host.dtype).reshape(
                put.rows(put.host, row, count).shape))
            changed.add(put.group)
        return count


class CapturedSteps:
    """The keys of one step (the module docstring): `make(key)` gives a key's Step; a call stages the
    values and runs the key's body, captured where `graphs`; `compiled`: through torch.compile."""

    def __init__(self, device: torch.device, make: Callable[[Hashable], Step], *, graphs: bool,
                 compiled: bool = False, dynamic: bool = False, idempotent: bool = True):
        assert idempotent or not compiled, "a compiled body is warmed up, so it must be idempotent"
        self.device = torch.device(device)
        self.make = make
        self.graphs = graphs
        self.compiled = compiled
        self.dynamic = dynamic  # compiled with symbolic shapes (graphs.compiled_step)
        self.idempotent = idempotent
        self.keys: dict[Hashable, tuple[Staged, Callable[[], object], CapturedCall | None]] = {}
        self.eager_once: set[Hashable] = set()  # keys of a non-idempotent body that ran eagerly once

    def __call__(self, key: Hashable, **values):
        staged, run, call = self.entry(key)
        staged.load(values)
        if call is None:
            return run()
        if not self.idempotent and key not in self.eager_once:
            self.eager_once.add(key)  # its first call outside a graph; the next one captures
            return run()
        return call()

    def entry(self, key: Hashable):
        if key not in self.keys:
            step = self.make(key)
            staged = Staged(step.inputs, self.device)
            body = compiled_step(step.body, self.device, self.dynamic) if self.compiled else step.body

            def run(body=body, x=staged.x):
                return body(x)

            call = (CapturedCall(run, self.device, warmup=2 if self.idempotent else 0,
                                 check_host_reads=not self.compiled)  # (graphs.py: compiled code on a CPU)
                    if self.graphs else None)
            self.keys[key] = (staged, run, call)
        return self.keys[key]

    def warm(self, keys: Iterable[Hashable]) -> None:
        """Capture (and compile) each key now, over the inputs it holds, its outputs dropped: a key's
        capture then never falls in a later call. Not for a body that is not idempotent."""
        assert self.idempotent, "a body that is not idempotent is warmed by running it (its first call)"
        for key in keys:
            _, run, call = self.entry(key)
            if call is not None and not call.ready:
                call()

    def drop(self) -> None:
        """Forget every key: the state their bodies read was reallocated (a cache grew)."""
        self.keys.clear()
        self.eager_once.clear()

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def captured(self) -> list[Hashable]:
        """The keys whose capture is made (on a CPU: whose stand-in ran)."""
        return [key for key, (_, _, call) in self.keys.items() if call is not None and call.ready]


def warm_steps(keys: Iterable[tuple[CapturedSteps, Hashable]]) -> None:
    """Capture each (steps, key) now (CapturedSteps.warm): what a decoder's step_keys declares."""
    for steps, key in keys:
        steps.warm([key])
