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
test of a runner built with graphs=True checks what a capture needs: the first call, the warm-up
and capture, runs `fn` warmup + 1 times under forbid_host_sync (any read of a device value by the
host fails a capture: `t[0-d tensor]`, `.item()`, `nonzero`, a data-dependent shape; and so does a
copy of host data to the device: a tensor made from Python values in the body, `torch.tensor(...)`
or the value of `t[index] = True`, given to an op that copies it, HOST_DATA_COPIES, or not as a
0-d scalar operand); later calls, replays, which run no Python on a GPU, run `fn` once without the
check (it made a CPU step about 3x slower); and the outputs are copied into the first call's
tensors (a replay refills the same buffers, so a caller that keeps an output past the next call
sees it change).
A torch.compile'd `fn` cannot run under a dispatch mode (dynamo refuses to trace there): built with
check_host_reads=False, the CPU stand-in skips forbid_host_sync and checks the rest; the same body
uncompiled is what checks the host reads (TargetRunner's eager-body tests).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode
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
    "index_put_", "index_put", "_index_put_impl_", "copy_", "_copy_from", "where",
    "index_copy_", "index_copy", "scatter_", "scatter", "scatter_add_", "scatter_add", "index_add_", "index_add",
    "masked_scatter_", "masked_scatter", "put_", "put", "cat", "stack",
}
"""aten ops that copy a host tensor given to them onto the device, which a CUDA-graph capture refuses
(`t[index] = True` is index_put_ of a host 0-d tensor; where copies a host 0-d operand): with a
host tensor among device ones, these fail, and so does any op given a host tensor of a dimension or
more, and `_to_copy` to a device. Allowed, as a GPU's capture allows them: a host 0-d tensor as the
operand of a pointwise op or fill_ (its kernel takes it as a number, read once at capture), and
`t[bool mask] = value` (index_put_ of one boolean index, which runs as masked_fill_ of the number)."""


class HostReadError(RuntimeError):
    pass


def _masked_fill(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether index_put_(self, indices, values, accumulate) runs as masked_fill_ of a number: one
    boolean index, values 0-d, no accumulation (ATen's canDispatchToMaskedFill)."""
    if name not in ("index_put_", "index_put", "_index_put_impl_"):
        return False
    indices = [i for i in args[1] if i is not None]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return (len(indices) == 1 and indices[0].dtype in (torch.bool, torch.uint8) and args[2].dim() == 0
            and not accumulate)


class _ForbidHostReads(TorchDispatchMode):
    """HOST_READS fail; so does host data reaching the device. The body's host tensors are the outputs
    of lift_fresh (a tensor made from Python values: `torch.tensor(...)`, the value of `t[index] =
    value`) and of any op whose tensor inputs are all host tensors (`torch.tensor(2.0) * 3`, a view, a
    cast); one given beside device tensors fails as HOST_DATA_COPIES says (on a CPU every tensor is a
    host tensor, so only the ones the body made from Python values can be told)."""

    def __init__(self):
        super().__init__()
        self.made_on_host: dict[int, weakref.ref] = {}  # id -> the tensor (a WeakSet compares tensors with ==)

    def on_host(self, value) -> bool:
        made = self.made_on_host.get(id(value))
        return made is not None and made() is value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func._schema.name.split("::")[-1], kwargs or {}
        if name in HOST_READS and not (name == "repeat_interleave" and "output_size" in kwargs):
            raise HostReadError(f"{name}: a read of a device value by the host, which a CUDA-graph capture cannot "
                                f"hold (this code runs captured on a GPU)")
        derived = False  # every tensor input a host tensor: the outputs are host tensors too
        if self.made_on_host:  # (every op of a body pays for this mode: nothing more until the body made one)
            tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
            host = [v for v in tensors if self.on_host(v)]
            to_device = name == "_to_copy" and kwargs.get("device") is not None
            if host and (to_device or (len(host) < len(tensors) and copies(name, args, kwargs, host))):
                raise HostReadError(f"{name}: a tensor made from Python values in the body, copied to the device, "
                                    f"which a CUDA-graph capture cannot hold (make it once outside the body, on "
                                    f"the device)")
            derived = bool(tensors) and len(host) == len(tensors) and not to_device
        out = func(*args, **kwargs)
        if name == "lift_fresh" or derived:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.made_on_host[id(t)] = weakref.ref(t)
        return out


def copies(name: str, args: tuple, kwargs: dict, host: list[torch.Tensor]) -> bool:
    """Whether the op `name`, given the host tensors `host` beside device ones, copies them to the
    device (HOST_DATA_COPIES)."""
    return not _masked_fill(name, args, kwargs) and (name in HOST_DATA_COPIES or any(v.dim() > 0 for v in host))


MAKERS = frozenset({torch.tensor, torch.as_tensor, torch.Tensor.new_tensor})
"""torch's functions that make a tensor from Python values, on a device where one is named."""


class _ForbidDataToDevice(TorchFunctionMode):
    """Python values made into a tensor on a device inside the body (`torch.tensor(v, device=...)`,
    `torch.as_tensor(v, device=...)`, `t.new_tensor(v)`, which makes it on t's device) fail: the copy
    happens before any dispatched op, where _ForbidHostReads could see it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in MAKERS:  # (every torch call of a body pays for this mode: the common case first)
            return func(*args, **kwargs)
        if func is torch.Tensor.new_tensor or (kwargs.get("device") is not None and not isinstance(
                args[0] if args else kwargs.get("data"), torch.Tensor)):
            raise HostReadError(f"{getattr(func, '__name__', func)}: Python values copied to the device in the body, "
                                f"which a CUDA-graph capture cannot hold (make the tensor once outside the body)")
        return func(*args, **kwargs)


@contextmanager
def forbid_host_sync():
    """A context in which any op that makes the host wait for a device value (HOST_READS) fails, and
    any copy to the device of host data the body made (HOST_DATA_COPIES) does too."""
    with _ForbidDataToDevice(), _ForbidHostReads():
        yield


def compiled_step(fn, device: torch.device, dynamic: bool = False):
    """fn through torch.compile, for a captured step's body: fullgraph (a graph break is an error, not
    a silently slower step), called outside inference mode (dynamo cannot trace writes into inference
    tensors, and a step writes its static cache, whose tensors decoding/cache.py keeps ordinary)
    under no_grad, with dynamo's allow_rnn (it traces an nn.GRU/LSTM only when asked: Domino's prefix
    GRU, one step a proposal). Shapes are static (one compile per shape, at its first call) or, where
    `dynamic`, symbolic: one compile for a size of 1, which dynamo specialises, and one shared by all
    larger sizes (one more where the first larger size equals another dimension of the step, which
    dynamo then ties to it). A target compiles for a minute or more a shape on a GPU host, so a run
    meeting many step widths, sf-eval sweep's, pays that once instead of per width. Build its
    CapturedCall with check_host_reads=False (the module docstring).

    The backend is inductor on a GPU. Off a GPU (sf-eval refuses --compile-* there, so only the tests
    compile a step on a CPU) it is aot_eager: dynamo traces the same graph, with the same guards,
    shapes and recompiles, and AOT autograd functionalises it, but inductor's C++ code generation is
    left out. With a cold compile cache, a CI run's, that generation was most of the compiled tests'
    time, for code no user runs; the GPU tests run inductor."""
    backend = "inductor" if torch.device(device).type == "cuda" else "aot_eager"
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)

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
        with forbid_host_sync() if first and self.check_host_reads else nullcontext():
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
