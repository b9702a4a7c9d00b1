"""The hf capture runner: target prefill with forward hooks on the chosen decoder layers.

Only the base model runs (`model.model`), so the full-vocabulary logits are never computed;
its output is the final normed hidden state (the lm_head input). Forward hooks copy the K
aux layers' outputs as they are produced, so all layers' hidden states are never held at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from specfoundry.common.taps import AuxLayerTap, decoder_layers


class PendingCapture:
    """One submitted batch: its features are on their way to a host buffer of their own.

    The buffer holds the batch's aux rows of every sample, then its final rows:
    [sum(T) * K*H | sum(T) * H], so each sample's aux and final are contiguous views into it and
    result() copies nothing: a per-sample clone would cost the main thread a copy of every byte."""

    def __init__(self, lengths: list[int], host: torch.Tensor, done, hidden: int, layers: int):
        self.lengths = lengths
        self.host = host  # [sum(T) * (K+1)H] flat, in pinned memory on GPU
        self.done = done  # the copy's CUDA event on GPU, else None
        self.hidden = hidden
        self.layers = layers  # K

    def result(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample (aux [T, K*H], final [T, H]): views that keep the batch's buffer alive
        until the last of them is dropped."""
        if self.done is not None:
            self.done.synchronize()
        n = sum(self.lengths)
        width = self.layers * self.hidden
        aux = self.host[: n * width].view(n, width)  # [sum(T), K*H]
        final = self.host[n * width :].view(n, self.hidden)  # [sum(T), H]
        out, start = [], 0
        for t in self.lengths:
            out.append((aux[start : start + t], final[start : start + t]))
            start += t
        return out


class HFCaptureRunner:
    """Prefill batches and hand back the captured features.

    On a GPU the device-to-host copy of batch i runs on a side stream into pinned memory while
    batch i+1 computes (`capture_all` keeps one batch in flight), so the prefill does not wait
    for the copy. Each batch gets its own pinned buffer from torch's caching host allocator,
    which hands a freed buffer out again once its copy has finished: buffers are recycled as
    the writer drops finished shards, and a result can be kept as long as the caller likes.
    """

    def __init__(self, model, aux_layers: list[int]):
        self.model = model
        self.base, _ = decoder_layers(model)
        self.tap = AuxLayerTap(model, aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.device = next(model.parameters()).device
        self.hidden = model.config.hidden_size
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    @torch.inference_mode()
    def submit(self, batch: list[list[int]]) -> PendingCapture:
        """Start the prefill of a batch of token lists. The batch is right-padded and no
        attention mask is passed: under causal attention no real token sees the padding after
        it, and positions count from 0 as without padding, so padded rows' real tokens get the
        features they would get alone (and the fused causal attention kernels stay usable)."""
        lengths = [len(x) for x in batch]
        width = max(lengths)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for r, x in enumerate(batch):
            ids[r, : len(x)] = torch.tensor(x)
        self.tap.clear()
        out = self.base(input_ids=ids.to(self.device, non_blocking=True), use_cache=False)
        aux = self.tap.take()  # [B, T, K*H]: the aux layers, ascending
        final = out.last_hidden_state  # [B, T, H]: final normed
        # [sum(T) * K*H | sum(T) * H]: every sample's aux rows, then every sample's final rows
        packed = torch.cat([aux[r, :n].reshape(-1) for r, n in enumerate(lengths)]
                           + [final[r, :n].reshape(-1) for r, n in enumerate(lengths)])
        if not self.cuda:
            return PendingCapture(lengths, packed, None, self.hidden, len(self.aux_layers))  # already in host memory
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        packed.record_stream(self.copy_stream)  # the allocator must not reuse it before the copy ends
        return PendingCapture(lengths, host, done, self.hidden, len(self.aux_layers))

    def capture_all(self, batches: Iterable[list[list[int]]]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Results of each batch in order, with the next batch already computing on the GPU
        while one is copied out."""
        pending = None
        for batch in batches:
            following = self.submit(batch)
            if pending is not None:
                yield pending.result()
            pending = following
        if pending is not None:
            yield pending.result()

    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prefill one batch and wait for it: per sample (aux [T, K*H], final [T, H]) on CPU."""
        return self.submit(batch).result()
