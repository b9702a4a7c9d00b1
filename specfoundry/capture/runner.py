"""The capture runner: the target's prefill (Target.prefill) with its tap on the chosen layers.

Only the base model runs, so the full-vocabulary logits are never computed; its output is the
final normed hidden state (the lm_head input). Forward hooks keep the K aux layers' outputs as
they are produced, so all layers' hidden states are never held at once. Wherever the target is
placed, the features arrive on its input device, where they are encoded and copied out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch

from specfoundry.common.target import Target
from specfoundry.featureset import fp8
from specfoundry.featureset.store import encode_state, stored_states
from specfoundry.featureset.teacher import topk_teacher


class NonFiniteFeatures(ValueError):
    """A captured row (one token's output of one layer) whose absmax is NaN or Inf: float8 has no
    scale for it. `batch` counts capture_all's batches, `row` the samples of that batch."""

    def __init__(self, batch: int, row: int, token: int, layer: str, absmax: float):
        super().__init__(f"batch {batch} sample {row}: token {token}, {layer}: absmax {absmax} is not finite")
        self.batch, self.row, self.token, self.layer, self.absmax = batch, row, token, layer, absmax


class PendingCapture:
    """One submitted batch: its features are on their way to a host buffer of their own.

    `arrays` are the batch's stored arrays, every sample's rows back to back ([sum(T), ...] each:
    aux_hidden, final_hidden and, for float8, aux_scale / final_scale), as views into one host
    buffer, so each sample's rows are views too and result() copies nothing: a per-sample clone
    would cost the main thread a copy of every byte."""

    def __init__(self, lengths: list[int], arrays: dict[str, torch.Tensor], done, index: int, layers: list[str]):
        self.lengths = lengths
        self.arrays = arrays  # name -> [sum(T), ...] in host memory (pinned on GPU)
        self.done = done  # the copy's CUDA event on GPU, else None
        self.index = index  # which batch of capture_all this is, for messages
        self.layers = layers  # what column k of aux_scale is, for messages

    def result(self) -> list[dict[str, torch.Tensor]]:
        """Per sample {array name: its rows}: views that keep the batch's buffer alive until the
        last of them is dropped. Raises NonFiniteFeatures for a float8 row without a finite scale."""
        if self.done is not None:
            self.done.synchronize()
        self.check_scales()
        out, start = [], 0
        for t in self.lengths:
            out.append({name: a[start : start + t] for name, a in self.arrays.items()})
            start += t
        return out

    def check_scales(self) -> None:
        for name, layers in (("aux_scale", self.layers), ("final_scale", ["the final state"])):
            scale = self.arrays.get(name)  # [sum(T), K] or [sum(T), 1]
            bad = None if scale is None else fp8.find_nonfinite(scale)
            if bad is not None:
                n, k = bad
                ends = torch.tensor(self.lengths).cumsum(0)
                row = int((ends <= n).sum())  # the sample whose tokens hold token n of the batch
                token = n - int(ends[row - 1]) if row else n
                raise NonFiniteFeatures(self.index, row, token, layers[k], scale[n, k].item() * fp8.E4M3_MAX)


def pack(pieces: dict[str, list[torch.Tensor]]) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict]]:
    """Per array, its per-sample pieces on the device -> (one flat uint8 tensor of all their bytes,
    a function of a host copy of it giving each array, its pieces back to back, as a view into
    the copy). Widest dtypes first, so that every view is aligned."""
    order = sorted(pieces, key=lambda name: -pieces[name][0].element_size())
    flat = torch.cat([p.reshape(-1).view(torch.uint8) for name in order for p in pieces[name]])

    def views(host: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name in order:
            first = pieces[name][0]
            rows = sum(p.shape[0] for p in pieces[name])
            stop = start + rows * math.prod(first.shape[1:]) * first.element_size()
            out[name] = host[start:stop].view(first.dtype).view(rows, *first.shape[1:])
            start = stop
        return out

    return flat, views


class HFCaptureRunner:
    """Prefill batches and hand back the captured features.

    On a GPU the device-to-host copy of batch i runs on a side stream into pinned memory while
    batch i+1 computes (`capture_all` keeps one batch in flight), so the prefill does not wait
    for the copy. Each batch gets its own pinned buffer from torch's caching host allocator,
    which hands a freed buffer out again once its copy has finished: buffers are recycled as
    the writer drops finished shards, and a result can be kept as long as the caller likes.

    With `storage` the features are encoded into the stored dtypes on the device, before the copy:
    float8 (one byte per value and a float32 scale per row) halves what the copy, host memory
    and the writers carry.
    """

    def __init__(self, target: Target, aux_layers: list[int], storage: tuple[str, str] | None = None,
                 keep: bool = True, teacher_k: int | None = None):
        """storage: the (aux, final) storage dtypes (featureset STORAGE_DTYPES); None hands the
        features out in the model's dtype, unencoded. keep=False: run the prefill and hand back
        nothing (a tensor-parallel rank beside its group's writer: its part of the collectives,
        none of the encoding and copying). teacher_k: hand out the teacher's top K (teacher_ids,
        teacher_probs: featureset/teacher.py) in the final state's place."""
        self.target = target
        self.keep = keep
        self.teacher_k = teacher_k
        self.head = target.lm_head() if teacher_k is not None and keep else None  # [V, H], for the top K
        self.tap = target.tap(aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.storage = storage
        self.device = target.input_device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def close(self) -> None:
        """Remove the tap's hooks from the target (which may run on for another stage)."""
        self.tap.remove()

    def encode(self, aux: torch.Tensor, final: torch.Tensor) -> dict[str, torch.Tensor]:
        """aux [B, T, K*H], final [B, T, H] -> the stored arrays of the batch ([B, T, ...] each), on
        the device."""
        arrays = {}
        if self.teacher_k is not None:  # the teacher's top K in the final state's place, on the device
            b, t, h = final.shape
            ids, probs = topk_teacher(final.reshape(b * t, h), self.head, self.teacher_k)
            arrays = {"teacher_ids": ids.view(b, t, -1), "teacher_probs": probs.view(b, t, -1)}
        if self.storage is None:
            return {"aux_hidden": aux, **({"final_hidden": final} if self.teacher_k is None else arrays)}
        for state, x, layers, dtype in stored_states((("aux", aux, len(self.aux_layers), self.storage[0]),
                                                      ("final", final, 1, self.storage[1])), self.teacher_k is not None):
            arrays[f"{state}_hidden"], scale = encode_state(x, dtype, layers)
            if scale is not None:
                arrays[f"{state}_scale"] = scale  # [B, T, layers] float32
        return arrays

    @torch.inference_mode()
    def submit(self, batch: list[list[int]], index: int = 0) -> PendingCapture:
        """Start the prefill of a batch of token lists. The batch is right-padded and no
        attention mask is passed: under causal attention no real token sees the padding after
        it, and positions count from 0 as without padding, so padded rows' real tokens get the
        features they would get alone (and the fused causal attention kernels stay usable)."""
        lengths = [len(x) for x in batch]
        width = max(lengths)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for r, x in enumerate(batch):
            ids[r, : len(x)] = torch.tensor(x)
        aux, final = self.target.prefill(ids, self.tap)  # [B, T, K*H] the aux layers, ascending; [B, T, H] normed
        layers = [f"layer {i}" for i in self.aux_layers]
        if not self.keep:
            return PendingCapture(lengths, {}, None, index, layers)
        # the padded batch is encoded (padding too), then only the real rows are gathered, all arrays
        # in one copy: a gather before encoding would copy the features once more
        arrays = self.encode(aux, final)
        pieces = {name: [a[r, :n] for r, n in enumerate(lengths)] for name, a in arrays.items()}
        if not self.cuda:  # already in host memory: every sample's rows back to back, [sum(T), ...]
            return PendingCapture(lengths, {name: torch.cat(p) for name, p in pieces.items()}, None, index, layers)
        packed, views = pack(pieces)  # [bytes of every array]: one copy for the whole batch
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        packed.record_stream(self.copy_stream)  # the allocator must not reuse it before the copy ends
        return PendingCapture(lengths, views(host), done, index, layers)

    def capture_all(self, batches: Iterable[list[list[int]]]) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Results of each batch in order, with the next batch already computing on the GPU
        while one is copied out."""
        pending = None
        for index, batch in enumerate(batches):
            following = self.submit(batch, index)
            if pending is not None:
                yield pending.result()
            pending = following
        if pending is not None:
            yield pending.result()

    def __call__(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Prefill one batch and wait for it: per sample {aux_hidden [T, K*H], final_hidden [T, H]}
        (and aux_scale [T, K], final_scale [T, 1] where stored as float8) on CPU."""
        return self.submit(batch).result()
