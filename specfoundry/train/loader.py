"""Disk-backed, length-grouped, rank-split, resumable batches over a feature set.

Samples are read by background DataLoader workers straight from the shards (never the whole
set in memory). Per epoch, a seeded shuffle is batched one of two ways:
- pad_multiple 1 (the dense attention paths): windows of 64 batches, sorted by length inside and
  packed up to a token budget, for the least padding at any (rows, width);
- pad_multiple > 1 (compiled FlexAttention, which compiles anew for every input shape, each
  compilation costing many training steps' time): widths rounded up to the multiple and
  max_tokens // width rows in every batch, so there is one shape per width bucket, compiled once.
The batch order is shuffled again, and rank r takes batches r, r+W, ... (the tail that does
not divide evenly is dropped so every rank steps together). The state (epoch, batches
consumed) resumes exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from specfoundry.families.interface import DraftFamily
from specfoundry.featureset.batch import Batch
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.featureset.store import FeatureSet, is_finite


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A fixed held-out part of the samples for evaluation (never trained on)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = int(round(n * eval_fraction)) if n > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def padded_width(length: int, multiple: int) -> int:
    """length rounded up to a multiple of `multiple` (1: unchanged)."""
    return -(-length // multiple) * multiple


def rows_for_width(width: int, max_tokens: int) -> int:
    """Rows of a full batch of this padded width (at least one, for samples over the budget)."""
    return max(1, max_tokens // width)


def plan_batches(lengths: dict[int, int], indices: list[int], max_tokens: int, epoch: int, seed: int,
                 rank: int, world: int, max_length: int | None = None, pad_multiple: int = 1) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(indices)
    rng.shuffle(order)
    if pad_multiple > 1:
        batches = fixed_shape_batches(order, lengths, max_tokens, max_length, pad_multiple)
    else:
        batches = length_sorted_batches(order, lengths, max_tokens, max_length)
    rng.shuffle(batches)
    usable = len(batches) // world * world
    return batches[:usable][rank::world]


def length_sorted_batches(order: list[int], lengths: dict[int, int], max_tokens: int,
                          max_length: int | None) -> list[list[int]]:
    """Windows of ~64 batches of the shuffled order, sorted by length inside, packed greedily
    up to the token budget: the least padding, any (rows, width)."""
    window = max(1, 64 * max(1, max_tokens // max(1, int(sum(lengths[i] for i in order) / max(1, len(order))))))
    batches = []
    for start in range(0, len(order), window):
        part = sorted(order[start : start + window], key=lambda i: (lengths[i], i))
        current, width = [], 0
        for i in part:
            w = min(lengths[i], max_length) if max_length else lengths[i]
            if current and max(width, w) * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, w)
        if current:
            batches.append(current)
    return batches


def fixed_shape_batches(order: list[int], lengths: dict[int, int], max_tokens: int, max_length: int | None,
                        multiple: int) -> list[list[int]]:
    """Every batch of padded width w has rows_for_width(w) rows, so there is one batch shape per
    width bucket (compiled kernels compile each once): samples fall, in the shuffled order,
    into the bucket of their width rounded up to `multiple`, and a bucket that fills becomes a
    batch. Only the last, partial batch of each bucket is short; BatchDataset fills it up with
    dummy rows. Padding stays under `multiple` tokens per row."""
    batches, pending = [], {}
    for i in order:
        w = padded_width(min(lengths[i], max_length) if max_length else lengths[i], multiple)
        bucket = pending.setdefault(w, [])
        bucket.append(i)
        if len(bucket) == rows_for_width(w, max_tokens):
            batches.append(bucket)
            pending[w] = []
    batches.extend(bucket for _, bucket in sorted(pending.items()) if bucket)
    return batches


class BatchDataset(Dataset):
    """Item k is batch k of a plan: reads and pads its samples (runs in loader workers)."""

    def __init__(self, featureset: FeatureSet, batches: list[list[int]], max_length: int | None,
                 pad_multiple: int = 1, max_tokens: int | None = None, layers: list[int] | None = None,
                 final: bool = True, epoch: int = 0):
        """layers: the positions, in the set's stored layer list, of the layers handed out (in that
        order; None: all); final: whether the final state is read and handed out."""
        self.fs, self.batches, self.max_length, self.pad_multiple = featureset, batches, max_length, pad_multiple
        self.max_tokens, self.layers, self.final, self.epoch = max_tokens, layers, final, epoch

    def select(self, aux: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, L*H] stored layers (and float8's [T, L] scales) -> [T, K*H] (and [T, K]) the chosen
        ones; views when they are all of them."""
        if self.layers is None:
            return aux, scale
        stored = len(self.fs.manifest["aux_layer_ids"])
        if self.layers == list(range(stored)):
            return aux, scale
        t, width = aux.shape
        chosen = aux.view(t, stored, width // stored)[:, self.layers].reshape(t, -1)
        return chosen, None if scale is None else scale[:, self.layers]

    def __len__(self) -> int:
        return len(self.batches)

    def read(self, k: int) -> list:
        """The samples of batch k, states as stored, the chosen layers only; refuses a non-finite one."""
        samples = [self.fs.read(i, self.final, decode=False) for i in self.batches[k]]
        for i, s in zip(self.batches[k], samples, strict=True):
            s.aux_hidden, s.aux_scale = self.select(s.aux_hidden, s.aux_scale)
            # a NaN or Inf would spread through the whole draft in one optimizer step
            if not (is_finite(s.aux_hidden, s.aux_scale, self.fs.dtype)
                    and (not self.final or s.final_hidden is None or is_finite(s.final_hidden, s.final_scale,
                                                                               self.fs.final_dtype))
                    and (s.teacher_probs is None or is_finite(s.teacher_probs, None))):
                raise FeatureSetError(f"{self.fs.where(i)} holds non-finite hidden states (NaN or Inf); "
                                      "recapture it (sf-capture verify lists every such sample)")
        return samples

    def __getitem__(self, k: int) -> Batch:
        samples = self.read(k)
        cut = self.max_length or max(len(s.input_ids) for s in samples)
        lengths = [min(len(s.input_ids), cut) for s in samples]
        width = padded_width(max(lengths), self.pad_multiple)  # the rows past `lengths` are padding
        if self.pad_multiple > 1 and self.max_tokens:
            # a bucket's last, short batch gets dummy rows up to its bucket's shape: one real-looking
            # token each (an empty row would give NaN attention) with nothing to learn
            dummies = rows_for_width(width, self.max_tokens) - len(samples)
            lengths += [1] * dummies
        b = len(lengths)
        ids = torch.zeros(b, width, dtype=torch.int64)
        mask = torch.zeros(b, width, dtype=torch.bool)
        for r, (s, n) in enumerate(zip(samples, lengths[: len(samples)], strict=True)):
            ids[r, :n], mask[r, :n] = s.input_ids[:n], s.loss_mask[:n]
        states = {"final_hidden": None}
        teacher = ("teacher_ids", "teacher_probs") if self.fs.teacher_k else ("final_hidden", "final_scale")
        for name in ("aux_hidden", "aux_scale") + (teacher if self.final else ()):
            states[name] = padded([getattr(s, name) for s in samples], lengths, width)
        return Batch(ids, mask, lengths=lengths, indices=list(self.batches[k]), epoch=self.epoch,
                     aux_storage=self.fs.dtype, final_storage=self.fs.final_dtype, **states)


def padded(rows: list[torch.Tensor | None], lengths: list[int], width: int) -> torch.Tensor | None:
    """Per sample [T, D] (None: an array the set does not store) -> [len(lengths), width, D], the
    first lengths[r] rows of each; zeros elsewhere (a scaled zero with scale 0 decodes to 0)."""
    if rows[0] is None:
        return None
    out = torch.zeros(len(lengths), width, rows[0].shape[-1], dtype=rows[0].dtype)
    for r, (x, n) in enumerate(zip(rows, lengths[: len(rows)], strict=True)):
        out[r, :n] = x[:n]
    return out


@dataclass
class LoaderState:
    epoch: int = 0
    position: int = 0  # batches of this epoch already consumed by this rank


class FeatureLoader:
    def __init__(self, featureset: FeatureSet, indices: list[int], *, max_tokens: int, seed: int, rank: int = 0,
                 world: int = 1, num_workers: int = 2, max_length: int | None = None, pad_multiple: int = 1,
                 pin_memory: bool = False, layers: list[int] | None = None, final: bool = True):
        """pin_memory: hand out batches in pinned host memory (for a GPU: fast, asynchronous copies).
        layers, final: which stored features a batch holds (BatchDataset's)."""
        self.fs, self.indices = featureset, indices
        self.pin_memory, self.layers, self.final = pin_memory, layers, final
        self.lengths = {i: featureset.lengths[i] for i in indices}
        self.max_tokens, self.seed, self.rank, self.world = max_tokens, seed, rank, world
        self.num_workers, self.max_length, self.pad_multiple = num_workers, max_length, pad_multiple
        self.state = LoaderState()

    def batches_per_epoch(self) -> int:
        return len(self.plan(0))

    def describe(self) -> str:
        """What the split makes: its samples, its batches in all, the ranks that share them."""
        every = plan_batches(self.lengths, self.indices, self.max_tokens, 0, self.seed, 0, 1, self.max_length,
                             self.pad_multiple)
        return (f"{len(self.indices)} samples make {len(every)} batches of at most {self.max_tokens} tokens, "
                f"shared by {self.world} rank{'s' if self.world > 1 else ''} taking whole batches")

    def plan(self, epoch: int) -> list[list[int]]:
        return plan_batches(self.lengths, self.indices, self.max_tokens, epoch, self.seed, self.rank, self.world,
                            self.max_length, self.pad_multiple)

    def __iter__(self):
        """Yields batches forever, epoch after epoch, from the saved position on; refuses at once
        a split that gives this rank no batch (it would loop over empty epochs forever)."""
        while True:
            plan = self.plan(self.state.epoch)
            if not plan:
                raise ValueError(f"no batch for rank {self.rank}: {self.describe()}")
            remaining = plan[self.state.position :]
            dataset = BatchDataset(self.fs, remaining, self.max_length, self.pad_multiple, self.max_tokens,
                                   self.layers, self.final, self.state.epoch)
            loader = DataLoader(dataset, batch_size=None, shuffle=False,
                                num_workers=self.num_workers if remaining else 0,
                                prefetch_factor=4 if self.num_workers and remaining else None,
                                persistent_workers=False, pin_memory=self.pin_memory)
            for batch in loader:
                self.state.position += 1
                yield batch
            self.state = LoaderState(self.state.epoch + 1, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, d: dict) -> None:
        self.state = LoaderState(int(d["epoch"]), int(d["position"]))


def select_layers(manifest: dict, family: DraftFamily, options, explicit: tuple[int, ...] | None,
                  num_target_layers: int, source: str) -> list[int]:
    """The stored layers a family reads: `explicit` (--layers) if given; else every stored layer when
    the set holds exactly as many as the family reads; else the family's default for the target.
    Refuses a layer the set lacks, naming it and what the set holds."""
    held = list(manifest["aux_layer_ids"])
    count = family.layer_count(options)
    if explicit:
        wanted = list(explicit)
        how = "--layers"
    elif count is None or len(held) == count:
        wanted = held
        how = ""
    else:
        wanted = family.default_layers(num_target_layers, options)
        how = f"the {family.name} default for a {num_target_layers}-layer target"
    if wanted != sorted(set(wanted)):  # engines concatenate the tapped layers in layer order
        raise FeatureSetError(f"layers {wanted} ({how or source}) must be ascending and distinct (engines "
                              "concatenate the tapped layers in layer order)" + ("" if explicit else "; pass --layers"))
    if count is not None and len(wanted) != count and not (explicit and family.any_layer_count):
        raise FeatureSetError(f"the {family.name} draft reads {count} layers; {how or source} gives {wanted}")
    missing = [i for i in wanted if i not in held]
    if missing:
        raise FeatureSetError(f"{source} lacks layer{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} that the {family.name} draft reads ({how}: {wanted}); "
                              f"it holds {held}: recapture with sf-capture --aux-layers, or pick --layers from those")
    return wanted
