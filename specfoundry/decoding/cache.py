"""A static KV cache for one sequence: committing or rejecting drafts moves a length, never reallocates.

Every layer keeps keys and values [1, kv_heads, capacity, head_dim], allocated at its first write
on that layer's device (under tensor parallelism: that rank's KV heads). A forward writes its T new
keys and values at the columns `columns` [T] (a device tensor set before the forward) and every
layer attends over all `capacity` columns; the forward's mask (TargetRunner) decides which count:
the committed ones before the write, and the new ones as the step's pattern says. A column past
the committed length holds a rejected draft's keys until a later write overwrites it; no mask
ever lets a query see it. Fixed shapes and fixed addresses are what lets a step be captured as a
CUDA graph and replayed.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """What the attention layers call in place of a transformers Cache (update, get_seq_length)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.columns: torch.Tensor | None = None  # [T] columns this forward writes

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store key / value [1, kv_heads, T, head_dim] at `columns`; return the layer's whole cache."""
        if layer_idx not in self.keys:
            # ordinary tensors, not inference tensors: a compiled step (TargetRunner `compiled`)
            # writes into them, and torch.compile cannot trace a write into an inference tensor
            with torch.inference_mode(False):
                self.keys[layer_idx] = key.new_zeros(key.shape[:2] + (self.capacity, key.shape[3]))
                self.values[layer_idx] = value.new_zeros(value.shape[:2] + (self.capacity, value.shape[3]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        columns = self.columns if self.columns.device == key.device else self.columns.to(key.device)  # a device map
        keys.index_copy_(2, columns, key)
        values.index_copy_(2, columns, value)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def grown(self, capacity: int) -> StaticKVCache:
        """A cache of `capacity` columns holding what this one holds."""
        bigger = StaticKVCache(capacity)
        for mine, theirs in ((self.keys, bigger.keys), (self.values, bigger.values)):
            for layer, t in mine.items():
                with torch.inference_mode(False):  # (as in update)
                    theirs[layer] = torch.cat([t, t.new_zeros(t.shape[:2] + (capacity - t.shape[2], t.shape[3]))], dim=2)
        return bigger


def visible(kv_index: torch.Tensor, start: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """allowed [T, C] of a step over a static cache: every column before `start` (the committed
    entries), and of the W columns start..start+W-1 what pattern [T, W] says (the step's own
    entries, and where a step reads earlier uncommitted ones, a tree's ancestors, those too).
    kv_index: arange(C) on the device; start: a 0-d device tensor (so a captured step reads it)."""
    width = pattern.shape[1]
    offset = kv_index - start  # [C]
    inside = (offset >= 0) & (offset < width)
    return (offset < 0)[None, :] | (inside[None, :] & pattern[:, offset.clamp(0, width - 1)])
