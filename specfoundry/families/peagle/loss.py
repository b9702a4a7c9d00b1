"""P-EAGLE training from the offline feature set: COD sampling, the packed row, the per-depth loss.

With target tokens x_0..x_{n-1}, aux features a_i and final states f_i (f_i predicts x_{i+1}), the
element (i, d) of a row is the d-th draft slot of the rollout anchored at i (EAGLE-3's convention
for depth 0, TTT step 0):
    token      x_{i+1} at d = 0; the mask token at d >= 1
    hidden     fc(a_i) at d = 0; fc(mask_hidden) at d >= 1
    position   i + d
    teacher    softmax(f_{i+1+d} W^T) over the draft vocabulary (it predicts x_{i+2+d})
    valid      i + 2 + d < n, x_{i+2+d} supervised, the teacher's argmax in the draft vocabulary
Depth 0 holds every i in 0..n-2 (the context). COD sampling (Conditional-On-Distribution, the
P-EAGLE paper's; SpecForge's generate_cod_sample_indices in our indexing): depth d >= 1 keeps
    size_d = int(max(0, s - d) * max(r^d, r_min))        s: the sample's supervised positions
anchors drawn without replacement from those kept at depth d-1 (every anchor for d = 1) whose depth-d
target is supervised, all of them when fewer; sampling stops at the first size_d = 0. So a rollout
is a prefix of depths, deeper depths train on fewer anchors, and a sample's draw is a function of
(seed, epoch, sample index) alone (DFlash's anchor_seed). The row packs depth 0 then each depth's
anchors in order; mask.py gives its attention.
loss = sum_d w_d loss_d, loss_d the mean soft-target CE over depth d's counted elements, through the
in-place soft-target loss kernel; w_d = n_d / sum n (weights "element": every counted element weighs
the same, SpecForge's compute_peagle_metrics at a6b6b023) or 1/K (weights "depth": every depth weighs
the same, speculators' P-EAGLE).
"""

from __future__ import annotations

import torch

from specfoundry.families.dflash.anchors import anchor_seed
from specfoundry.families.peagle.mask import peagle_mask
from specfoundry.families.peagle.model import PEagleDraft
from specfoundry.families.peagle.options import LOSS_WEIGHTS as WEIGHTS
from specfoundry.families.teacher import batch_teacher
from specfoundry.families.vocab import draft_ids_from_d2t
from specfoundry.featureset.batch import Batch
from specfoundry.kernels.lk_loss import TokenLoss


def cod_sizes(supervised: int, num_depths: int, ratio: float, ratio_min: float) -> list[int]:
    """size_d for d = 1..K-1 (up to the first 0, excluded)."""
    sizes = []
    for d in range(1, num_depths):
        size = int(max(0, supervised - d) * max(ratio ** d, ratio_min))
        if size <= 0:
            break
        sizes.append(size)
    return sizes


def cod_sample(loss_mask: torch.Tensor, length: int, num_depths: int, ratio: float, ratio_min: float,
               seed: int) -> list[torch.Tensor]:
    """The anchors kept at depths 1..K-1 (sorted LongTensors, one per depth, possibly fewer than K-1)."""
    m = loss_mask[:length].to(torch.bool).cpu()
    return rollouts(m, length, cod_sizes(int(m.sum()), num_depths, ratio, ratio_min),
                    torch.Generator().manual_seed(int(seed)))


def every_rollout(loss_mask: torch.Tensor, length: int, num_depths: int) -> list[torch.Tensor]:
    """Every anchor at every depth its targets are supervised to (no sampling: the gate's fit check)."""
    return rollouts(loss_mask[:length].to(torch.bool).cpu(), length, [length] * (num_depths - 1), None)


def rollouts(m: torch.Tensor, length: int, sizes: list[int], g: torch.Generator | None) -> list[torch.Tensor]:
    """Depth d keeps sizes[d-1] of the anchors kept at d-1 (all at d = 1) whose depth-d target is
    supervised, drawn with `g` (all of them when there are no more)."""

    def supervised(anchors: torch.Tensor, d: int) -> torch.Tensor:
        t = anchors + 2 + d
        return anchors[(t < length) & m[t.clamp(max=max(length - 1, 0))]]

    candidates = supervised(torch.arange(max(length - 1, 0)), 1)
    kept = []
    for d, size in enumerate(sizes, start=1):
        if candidates.numel() > size:
            candidates = candidates[torch.randperm(candidates.numel(), generator=g)[:size]].sort().values
        kept.append(candidates)
        candidates = supervised(candidates, d + 1)
    return kept


def pack_row(length: int, kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, depth) [P] of one row: the context 0..n-2 at depth 0, then depth d's anchors."""
    anchors = [torch.arange(max(length - 1, 0))] + [a.to(torch.int64) for a in kept]
    depth = torch.cat([torch.full((len(a),), d, dtype=torch.int64) for d, a in enumerate(anchors)])
    return torch.cat(anchors), depth


def pack_batch(rows: list[tuple[torch.Tensor, torch.Tensor]], device) -> tuple[torch.Tensor, ...]:
    """anchor, depth [B, P] int64 and real [B, P] bool, rows right-padded (anchor 0, depth 0)."""
    p = max(1, max(len(a) for a, _ in rows))
    anchor = torch.zeros(len(rows), p, dtype=torch.int64)
    depth = torch.zeros(len(rows), p, dtype=torch.int64)
    real = torch.zeros(len(rows), p, dtype=torch.bool)
    for r, (a, d) in enumerate(rows):
        anchor[r, : len(a)], depth[r, : len(a)], real[r, : len(a)] = a, d, True
    return anchor.to(device), depth.to(device), real.to(device)


def packed_states(draft: PEagleDraft, input_ids: torch.Tensor, aux: torch.Tensor, anchor: torch.Tensor,
                  depth: torch.Tensor, real: torch.Tensor, attention: str = "auto") -> torch.Tensor:
    """The training forward of packed rows: normed states [B, P, H]. input_ids [B, T], aux [B, T, 3*Ht]."""
    width = input_ids.shape[1]
    ctx = depth == 0
    tokens = input_ids.gather(1, (anchor + 1).clamp(max=width - 1))
    ids = torch.where(ctx & real, tokens, torch.full_like(tokens, draft.cfg.mask_token_id))
    projected = draft.project(aux.to(draft.fc.weight.dtype))  # [B, T, H]
    ctx_hidden = projected.gather(1, anchor[..., None].expand(-1, -1, projected.shape[-1]))
    hidden = torch.where(ctx[..., None], ctx_hidden, draft.mask_state().to(projected.dtype))
    return draft.train_forward(ids, hidden, anchor + depth, peagle_mask(attention, anchor, depth, real))


def peagle_loss(draft: PEagleDraft, batch: Batch, lm_head: torch.Tensor, *, num_depths: int, ratio: float,
                ratio_min: float, seed: int, attention: str = "auto", loss_kernel: str = "auto",
                teacher_chunk: int | None = None, loss_scale: float = 1.0, kept: list | None = None,
                weights: str = "element", token_loss: TokenLoss = TokenLoss()):
    """(total loss, per-depth metrics [{loss, hits, valid}] for d = 0..K-1). kept: each row's COD
    anchors (cod_sample's lists), drawn here from the seed unless given; weights: WEIGHTS."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown P-EAGLE loss weights {weights!r}: choose {' or '.join(WEIGHTS)}")
    bsz, width = batch.input_ids.shape
    device = batch.input_ids.device
    if kept is None:
        mask_cpu = batch.loss_mask.cpu()
        kept = [cod_sample(mask_cpu[r], batch.lengths[r], num_depths, ratio, ratio_min,
                           anchor_seed(seed, batch.epoch, index)) for r, index in enumerate(batch.indices[:bsz])]
        kept += [[] for _ in range(bsz - len(kept))]
    rows = [pack_row(batch.lengths[r], kept[r]) for r in range(bsz)]
    anchor, depth, real = pack_batch(rows, device)
    states = packed_states(draft, batch.input_ids, batch.aux_hidden, anchor, depth, real, attention)
    p_all, ok_all, tgt_all = batch_teacher(batch, lm_head, draft_ids_from_d2t(draft.d2t), draft.t2d,
                                           chunk=teacher_chunk, renormalise=token_loss.renormalised_teacher)
    label = anchor + 2 + depth  # the position of the token each element predicts
    lengths = torch.tensor(batch.lengths, device=device)[:, None]
    inside = real & (label < lengths)
    teacher_row = (torch.arange(bsz, device=device)[:, None] * width + (label - 1).clamp(max=width - 1))  # [B, P]
    valid = inside & batch.loss_mask.gather(1, label.clamp(max=width - 1)) & ok_all[teacher_row]
    total = torch.zeros((), device=device, dtype=torch.float32)
    metrics = []
    counted = [int(valid[real & (depth == d)].sum()) for d in range(num_depths)]  # n_d on the host: the weights
    for d in range(num_depths):
        sel = real & (depth == d)
        if not bool(sel.any()):  # COD sampling kept no anchor this deep (short samples): nothing to score
            zero = torch.zeros((), device=device, dtype=torch.int64)
            metrics.append({"loss": torch.zeros((), device=device), "hits": zero, "valid": zero})
            continue
        rows_d = teacher_row[sel]
        valid_d = valid[sel]
        logits = draft.lm_head(states[sel])  # [R_d, Vd], consumed by the loss
        n_valid = valid_d.sum()
        with torch.no_grad():
            hits = ((logits.argmax(-1) == tgt_all[rows_d]) & valid_d).sum()
        weight = 1.0 / num_depths if weights == "depth" else counted[d] / max(1, sum(counted))
        # a depth of weight 0 (nothing counted) teaches nothing: its loss is a metric only
        with torch.set_grad_enabled(torch.is_grad_enabled() and weight > 0):
            loss_d = token_loss(logits, p_all[rows_d], valid_d, normaliser=n_valid.clamp(min=1).float(),
                                impl=loss_kernel, grad_scale=weight * loss_scale)
        total = total + weight * loss_d
        metrics.append({"loss": loss_d.detach(), "hits": hits, "valid": n_valid})
    return total, metrics


class PEagleModule(torch.nn.Module):
    """The whole packed forward as one module call (DDP/FSDP see every parameter use in it); the
    teacher head is a frozen buffer. On a GPU the elementwise chains run compiled."""

    def __init__(self, draft: PEagleDraft, lm_head: torch.Tensor, *, num_depths: int, ratio: float = 0.7,
                 ratio_min: float = 0.2, seed: int = 0, weights: str = "element", compile_elementwise: bool = True,
                 token_loss: TokenLoss = TokenLoss()):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.num_depths, self.ratio, self.ratio_min, self.seed = num_depths, ratio, ratio_min, seed
        self.weights, self.token_loss = weights, token_loss

    def forward(self, batch: Batch, **kw):
        return peagle_loss(self.draft, batch, self.lm_head, num_depths=self.num_depths, ratio=self.ratio,
                           ratio_min=self.ratio_min, seed=self.seed, weights=self.weights,
                           token_loss=self.token_loss, **kw)
