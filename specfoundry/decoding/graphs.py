"""A call captured once as a CUDA graph and replayed: how the decoding core's steps run on a GPU.

`fn` reads and writes only tensors that live as long as the CapturedCall (static inputs its
caller refills in place, a static KV cache) and returns its outputs; the first call warms it up
on a side stream (the allocator's first blocks and the kernels' first-call work stay out of the
graph), captures it, and every call replays it and returns the same output tensors, refilled.
The warm-up runs `fn` for real: a step whose writes are idempotent (a cache column written from
the same inputs) is unaffected.

Every graph has its own memory pool. A shared pool is safe only for graphs replayed in the order
they were captured (a later capture reuses an earlier graph's freed intermediates, so replaying
the earlier one overwrites the later one's outputs), and the decoders replay steps in whatever
order the text asks for; a pool whose graphs were all dropped (a cache regrown) cannot be captured
into again either (torch asserts). A step's intermediates are a few of its T rows, so the memory
this costs is small.

On a CPU there are no graphs, and a CapturedCall does eagerly what a replay does, so that a CPU
test of a runner built with graphs=True checks what a capture needs: `fn` runs under
forbid_host_sync (any read of a device value by the host fails a capture: `t[0-d tensor]`,
`.item()`, `nonzero`, a data-dependent shape; and so does a copy of host data to the device: a
tensor made from Python values in the body, `torch.tensor(...)` or the value of `t[index] = True`,
given to an op that copies it, HOST_DATA_COPIES, or not as a 0-d scalar operand), the first call
runs it warmup + 1 times (the warm-up runs and the replay), and its outputs are copied into the
first call's tensors (a replay refills the same buffers, so a caller that keeps an output past the
next call sees it change).
A torch.compile'd `fn` cannot run under a dispatch mode (dynamo refuses to trace there): built with
check_host_reads=False, the CPU stand-in skips forbid_host_sync and checks the rest; the same body
uncompiled is what checks the host reads (TargetRunner's eager-body tests).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {
    "item", "_local_scalar_dense",  # .item(), int(t), bool(t), t[0-d tensor], a tensor in a Python `if`
    "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal",
    "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "repeat_interleave",  # (the Tensor overload: its output size is read from the device)
    "bincount", "histc", "_assert_async",
}
"""aten ops whose result the host must wait for: none of them may run inside a CUDA-graph capture."""


HOST_DATA_COPIES = {
    "index_put_", "index_put", "_index_put_impl_", "copy_", "_to_copy", "_copy_from",
    "index_copy_", "index_copy", "scatter_", "scatter", "scatter_add_", "scatter_add", "index_add_", "index_add",
    "masked_scatter_", "masked_scatter", "put_", "put", "cat", "stack",
}
"""aten ops that copy a host tensor given to them onto the device (a CUDA-graph capture refuses the
copy: `t[index] = True` is index_put_ of a host 0-d tensor). A host 0-d tensor given to any other op
is a scalar operand, read once when the graph is captured (the kernels of pointwise ops and fill_
take a CPU 0-d tensor as a number): allowed, as it is on a GPU."""


class HostReadError(RuntimeError):
    pass


class _ForbidHostReads(TorchDispatchMode):
    """HOST_READS fail; so does host data reaching the device: the outputs of lift_fresh (a tensor made
    from Python values: `torch.tensor(...)`, the value of `t[index] = value`) are the body's host
    tensors, and one given to an op of HOST_DATA_COPIES, or given with a dimension, fails (on a CPU
    every tensor is a host tensor, so only the ones the body made from Python values can be told)."""

    def __init__(self):
        super().__init__()
        self.made_on_host: dict[int, weakref.ref] = {}  # id -> the tensor (a WeakSet compares tensors with ==)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_READS and not (name == "repeat_interleave" and "output_size" in (kwargs or {})):
            raise HostReadError(f"{name}: a read of a device value by the host, which a CUDA-graph capture cannot "
                                f"hold (this code runs captured on a GPU)")
        if self.made_on_host:
            for value in tree_flatten((args, kwargs))[0]:
                made = isinstance(value, torch.Tensor) and self.made_on_host.get(id(value), lambda: None)() is value
                if made and (name in HOST_DATA_COPIES or value.dim() > 0):
                    raise HostReadError(f"{name}: a tensor made from Python values in the body, copied to the "
                                        f"device, which a CUDA-graph capture cannot hold (make it once outside "
                                        f"the body, on the device)")
        out = func(*args, **(kwargs or {}))
        if name == "lift_fresh":
            self.made_on_host[id(out)] = weakref.ref(out)
        return out


def forbid_host_sync() -> TorchDispatchMode:
    """A context in which any op that makes the host wait for a device value (HOST_READS) fails, and
    any copy of host data the body made to the device (HOST_DATA_COPIES) does too."""
    return _ForbidHostReads()


def compiled_step(fn, dynamic: bool = False):
    """fn through torch.compile, for a captured step's body: fullgraph (a graph break is an error, not
    a silently slower step), static shapes (one compile per shape, at its first call) or, `dynamic`,
    symbolic ones (one compile for a size of 1, which dynamo specialises, and one for every other
    size: a target compiles in a minute or more a shape on a GPU host, so a run meeting many step
    widths, sf-eval sweep's, pays that once instead of per width), called outside inference mode (dynamo cannot trace writes into inference tensors, and a step writes
    its static cache, whose tensors decoding/cache.py keeps ordinary) under no_grad, with dynamo's
    allow_rnn (it traces an nn.GRU/LSTM only when asked: Domino's prefix GRU, one step a proposal).
    Build its CapturedCall with check_host_reads=False (the module docstring)."""
    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)

    def call(*args):
        with torch.inference_mode(False), torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
            return compiled(*args)

    return call


class CapturedCall:
    def __init__(self, fn, device: torch.device, warmup: int = 2, check_host_reads: bool = True):
        self.fn, self.device, self.warmup = fn, torch.device(device), warmup
        self.check_host_reads = check_host_reads  # (the CPU stand-in: the module docstring)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.ready = False  # captured (on a CPU: called once)

    def __call__(self):
        if self.device.type != "cuda":
            return self.checked_call()
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.outputs

    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.fn()
        self.ready = True

    def checked_call(self):
        """The CPU's stand-in for capture and replay (the module docstring)."""
        first = not self.ready
        with forbid_host_sync() if self.check_host_reads else nullcontext():
            for _ in range(self.warmup if first else 0):
                self.fn()
            out = self.fn()
        if first:
            self.outputs, self.ready = out, True
        else:
            for mine, new in zip(tree_flatten(self.outputs)[0], tree_flatten(out)[0], strict=True):
                if isinstance(mine, torch.Tensor) and mine is not new:
                    mine.copy_(new)
        return self.outputs
