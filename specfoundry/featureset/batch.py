"""The Batch that carries a feature set's rows to the training device: the loader yields it, every
family's loss reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfoundry.featureset.store import decode_state


@dataclass
class Batch:
    """One micro-batch as the loader yields it: right-padded rows of whole samples. Scaled states
    (float8, packed codes) stay as stored, beside their scales, until `to` puts them on the training
    device and decodes them there: the host-to-device copy carries their bytes, not bf16's."""

    input_ids: torch.Tensor  # [B, T] int64, right-padded
    loss_mask: torch.Tensor  # [B, T] bool
    aux_hidden: torch.Tensor  # [B, T, K*H]: the K layers the family reads, in its order
    final_hidden: torch.Tensor | None  # [B, T, H]; None when the family reads no final state
    lengths: list[int]
    indices: list[int] = field(default_factory=list)  # the rows' sample indices in the feature set
    epoch: int = 0  # the loader's epoch (a family's per-sample randomness is seeded by it and the index)
    aux_scale: torch.Tensor | None = None  # [B, T, K] float32 where aux_hidden is scaled (padding: 0)
    final_scale: torch.Tensor | None = None  # [B, T, 1] float32 where final_hidden is scaled
    aux_storage: str | None = None  # the storage dtype of scaled aux states (packed codes decode by it)
    final_storage: str | None = None
    teacher_ids: torch.Tensor | None = None  # [B, T, k] int32: a top-k teacher, where final_hidden is None
    teacher_probs: torch.Tensor | None = None  # [B, T, k] float16 (padding: 0)

    def to(self, device, dtype=None) -> Batch:
        """On `device` with the hidden states in `dtype` (None: as stored, float8 as bfloat16);
        asynchronous when the batch is in pinned memory (see pin_memory). Float8 states cross as
        float8 and are dequantised on `device`: the trainer gets the tensors a bf16 set gives."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        def state(values, scale, storage):
            if values is None or scale is None:  # a float dtype: moved and cast in one step, as always
                return None if values is None else values.to(device, dtype, non_blocking=True)
            return decode_state(move(values), move(scale), dtype, storage)

        return Batch(move(self.input_ids), move(self.loss_mask), state(self.aux_hidden, self.aux_scale, self.aux_storage),
                     state(self.final_hidden, self.final_scale, self.final_storage), self.lengths, self.indices,
                     self.epoch, teacher_ids=move(self.teacher_ids), teacher_probs=move(self.teacher_probs))

    def pin_memory(self) -> Batch:
        """The DataLoader's pin_memory hook: a copy to the GPU from pinned memory is asynchronous
        and runs at full bus speed; from pageable memory it is a synchronous staged copy."""
        def pin(t):
            return None if t is None else t.pin_memory()

        return Batch(pin(self.input_ids), pin(self.loss_mask), pin(self.aux_hidden), pin(self.final_hidden),
                     self.lengths, self.indices, self.epoch, pin(self.aux_scale), pin(self.final_scale),
                     self.aux_storage, self.final_storage, pin(self.teacher_ids), pin(self.teacher_probs))
