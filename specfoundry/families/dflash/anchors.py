"""DFlash's anchored blocks: where a sample's blocks start (sample_anchors, per sample and epoch,
independent of its batch, rank or a resume), the block inputs [x_a, MASK, ..., MASK] at positions
a..a+B-1, and which of a block's slots are scored. The rules are in loss.py's docstring."""

from __future__ import annotations

import torch

from specfoundry.featureset.batch import Batch

MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One splitmix64 step: a bijective 64-bit mix whose outputs of nearby inputs look unrelated."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """The anchor-sampling seed of one sample in one epoch: a function of the three numbers only,
    so a sample's anchors do not depend on its batch, its row, the rank or a resume."""
    z = 0
    for v in (seed, epoch, sample_index):
        z = _splitmix64(z ^ (int(v) & MASK64))
    return z >> 1  # 63 bits: any torch.Generator seed


def sample_anchors(loss_mask: torch.Tensor, length: int, block_size: int, num_anchors: int,
                   seed: int) -> torch.Tensor:
    """Up to num_anchors distinct anchors, sorted, drawn without replacement (torch.Generator seeded
    with `seed`: the global RNG is untouched) from the positions a with

        a + 1 < length  and  loss_mask[a]  and  loss_mask[a + 1]

    loss_mask: [T] bool (T >= length). Returns a LongTensor [n], n = min(num_anchors, candidates).

    This is SpecForge's newer rule (spec §5.2): the anchor's first prediction x_{a+1} is supervised
    (a block that teaches nothing at slot 1 wastes an anchor), and the anchor token itself is
    supervised, because at serving time the anchor is always the bonus token, one the target
    generated (an anchor on a prompt or template token is a block SGLang never drafts). A block
    may run past the end of the sample (the classic rule's a <= n - B would never train the last
    B - 1 positions' blocks, where every response ends); its slots past the end get no loss, so
    block_size does not limit the candidates."""
    del block_size  # see above: blocks past the end are masked, not excluded
    m = loss_mask[:length].to(torch.bool).cpu()
    candidates = torch.nonzero(m[:-1] & m[1:]).flatten()  # a in [0, length - 2]
    n = min(num_anchors, candidates.numel())
    g = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(candidates.numel(), generator=g)[:n]
    return candidates[pick].sort().values


def batch_anchors(batch: Batch, num_anchors: int, block_size: int, seed: int):
    """anchors [Bsz, N] int64 and keep [Bsz, N] bool on the batch's device, N = min(num_anchors, T):
    a function of the padded width only, so compiled attention sees one shape per width bucket.
    Unused slots (fewer candidates, dummy rows without a sample index) are anchor 0, keep False."""
    bsz, width = batch.input_ids.shape
    n = max(1, min(num_anchors, width))
    anchors = torch.zeros(bsz, n, dtype=torch.int64)
    keep = torch.zeros(bsz, n, dtype=torch.bool)
    loss_mask = batch.loss_mask.cpu()  # one copy to the host for the whole batch
    for r, index in enumerate(batch.indices[:bsz]):
        a = sample_anchors(loss_mask[r], batch.lengths[r], block_size, num_anchors,
                           anchor_seed(seed, batch.epoch, index))
        anchors[r, : len(a)] = a
        keep[r, : len(a)] = True
    device = batch.input_ids.device
    return anchors.to(device, non_blocking=True), keep.to(device, non_blocking=True)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """ids and positions [Bsz, N*B] of every block: [x_a, MASK...] at a..a+B-1."""
    bsz, n = anchors.shape
    ids = torch.full((bsz, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [Bsz, N, B]
    return ids.view(bsz, n * block_size), positions.view(bsz, n * block_size)


def valid_slots(batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Bsz, N, B-1] bool: slot k = 1..B-1 of each block is scored (inside its row, supervised)."""
    width = batch.input_ids.shape[1]
    target = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [Bsz, N, B-1]
    lengths = torch.as_tensor(batch.lengths, device=anchors.device)
    inside = target < lengths[:, None, None]
    supervised = batch.loss_mask.gather(1, target.clamp(max=width - 1).flatten(1)).view_as(target)
    return keep[:, :, None] & inside & supervised
