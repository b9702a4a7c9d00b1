"""Disk-backed, length-grouped, rank-split, resumable batches over a feature set.

Samples are read by background DataLoader workers straight from the shards (never the whole
set in memory). Per epoch, a seeded shuffle is cut into windows of 64 batches; inside a window
samples are sorted by length and packed up to a token budget (little padding); a batch's width is
rounded up to a multiple of `pad_multiple`, so compiled kernels (FlexAttention under
torch.compile specialises on every shape) see a few widths instead of one per sample length; the
padded width is what counts against the budget. The batch order is shuffled again, and rank r takes batches r, r+W, ... (the tail that does not divide evenly is
dropped so every rank steps together). The state (epoch, batches consumed) resumes exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from specfoundry.featureset.store import FeatureSet
from specfoundry.train.ttt import Batch


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A fixed held-out part of the samples for evaluation (never trained on)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = int(round(n * eval_fraction)) if n > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def padded_width(length: int, multiple: int) -> int:
    """length rounded up to a multiple of `multiple` (1: unchanged)."""
    return -(-length // multiple) * multiple


def plan_batches(lengths: dict[int, int], indices: list[int], max_tokens: int, epoch: int, seed: int,
                 rank: int, world: int, max_length: int | None = None, pad_multiple: int = 1) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(indices)
    rng.shuffle(order)
    window = max(1, 64 * max(1, max_tokens // max(1, int(sum(lengths[i] for i in order) / max(1, len(order))))))
    batches = []
    for start in range(0, len(order), window):
        part = sorted(order[start : start + window], key=lambda i: (lengths[i], i))
        current, width = [], 0
        for i in part:
            w = padded_width(min(lengths[i], max_length) if max_length else lengths[i], pad_multiple)
            if current and max(width, w) * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, w)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    usable = len(batches) // world * world
    return batches[:usable][rank::world]


class BatchDataset(Dataset):
    """Item k is batch k of a plan: reads and pads its samples (runs in loader workers)."""

    def __init__(self, featureset: FeatureSet, batches: list[list[int]], max_length: int | None,
                 pad_multiple: int = 1):
        self.fs, self.batches, self.max_length, self.pad_multiple = featureset, batches, max_length, pad_multiple

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> Batch:
        samples = [self.fs[i] for i in self.batches[k]]
        cut = self.max_length or max(len(s.input_ids) for s in samples)
        lengths = [min(len(s.input_ids), cut) for s in samples]
        width = padded_width(max(lengths), self.pad_multiple)  # the rows past `lengths` are padding
        b, h3, h = len(samples), samples[0].aux_hidden.shape[-1], samples[0].final_hidden.shape[-1]
        dtype = samples[0].aux_hidden.dtype
        ids = torch.zeros(b, width, dtype=torch.int64)
        mask = torch.zeros(b, width, dtype=torch.bool)
        aux = torch.zeros(b, width, h3, dtype=dtype)
        final = torch.zeros(b, width, h, dtype=dtype)
        for r, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            ids[r, :n], mask[r, :n] = s.input_ids[:n], s.loss_mask[:n]
            aux[r, :n], final[r, :n] = s.aux_hidden[:n], s.final_hidden[:n]
        return Batch(ids, mask, aux, final, lengths)


@dataclass
class LoaderState:
    epoch: int = 0
    position: int = 0  # batches of this epoch already consumed by this rank


class FeatureLoader:
    def __init__(self, featureset: FeatureSet, indices: list[int], *, max_tokens: int, seed: int, rank: int = 0,
                 world: int = 1, num_workers: int = 2, max_length: int | None = None, pad_multiple: int = 1):
        self.fs, self.indices = featureset, indices
        self.lengths = {i: featureset.lengths[i] for i in indices}
        self.max_tokens, self.seed, self.rank, self.world = max_tokens, seed, rank, world
        self.num_workers, self.max_length, self.pad_multiple = num_workers, max_length, pad_multiple
        self.state = LoaderState()

    def batches_per_epoch(self) -> int:
        return len(self.plan(0))

    def plan(self, epoch: int) -> list[list[int]]:
        return plan_batches(self.lengths, self.indices, self.max_tokens, epoch, self.seed, self.rank, self.world,
                            self.max_length, self.pad_multiple)

    def __iter__(self):
        """Yields batches forever, epoch after epoch, from the saved position on."""
        while True:
            remaining = self.plan(self.state.epoch)[self.state.position :]
            loader = DataLoader(BatchDataset(self.fs, remaining, self.max_length, self.pad_multiple), batch_size=None,
                                shuffle=False,
                                num_workers=self.num_workers if remaining else 0,
                                prefetch_factor=4 if self.num_workers and remaining else None,
                                persistent_workers=False)
            for batch in loader:
                self.state.position += 1
                yield batch
            self.state = LoaderState(self.state.epoch + 1, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, d: dict) -> None:
        self.state = LoaderState(int(d["epoch"]), int(d["position"]))
