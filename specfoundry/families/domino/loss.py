"""Domino training: DFlash's sampled anchors and blocks (families/dflash/loss.py), shifted labels,
and the base-anchored curriculum.

Per sample of tokens x_0..x_{n-1} and loss mask m, anchors a are drawn as DFlash draws them
(sample_anchors: m[a] and m[a+1]); the block of anchor a is [x_a, M, ..., M] at a..a+B-1 and its
slot j (0 <= j < B) predicts y = x_{a+j+1} (model.py). Slot j counts iff a+j+1 < n and m[a+j+1].
With w_j = exp(-j / gamma) (gamma <= 0: 1), final_j and base_j the logits of model.py (the GRU
reading the sample's own x_a..x_{a+j}: teacher forcing) and
    CE_f = sum_{valid} w_j ce(final_j, y) / sum_{valid} w_j,   CE_b the same with base_j,
    loss = (1 - lambda) CE_f + lambda CE_b,
    lambda(step) = start + (end - start) * min(1, step / max(1, round(fraction * total_steps)))
(--base-weight-start/-end, --base-decay-fraction; step: optimizer steps done). lambda = 1 trains
the DFlash backbone alone, then the correction takes over. The Trainer announces the step through
DominoModule.set_progress before each optimizer step. The logits are taken chunk by chunk and no
[rows, V] tensor is kept for the backward: by default each chunk's gradient with respect to the
rows, the correction's features and P2 is taken at once in the forward (manual_chunk, as DFlash's
loss takes its own), so the backward only scales it; the reference path goes through autograd
with each chunk recomputed in the backward (activation checkpointing), twice the [rows, V]
products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specfoundry.families.dflash.anchors import batch_anchors, block_inputs
from specfoundry.families.dflash.loss import HARD_CE_ROWS, attach_gradients, check_announced, hard_ce_rows
from specfoundry.families.domino.config import PURE_DRAFT_PREFIX_LEN
from specfoundry.families.domino.model import DominoDraft, correction_parameters
from specfoundry.families.layers import compiled_on_cuda, compiles_elementwise
from specfoundry.families.teacher import logit_rows
from specfoundry.featureset.batch import Batch


def base_weight_at(step: int, total_steps: int, start: float, end: float, fraction: float) -> float:
    """lambda after `step` optimizer steps of `total_steps` (module docstring)."""
    span = max(1, round(fraction * total_steps))
    return start + (end - start) * min(1.0, step / span)


def shifted_slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_j = exp(-j / gamma) for j = 0..B-1 (gamma <= 0: uniform)."""
    return torch.tensor([math.exp(-j / gamma) if gamma > 0 else 1.0 for j in range(block_size)])


def shifted_targets(batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int):
    """(labels [Bsz, N, B], valid [Bsz, N, B], tokens [Bsz, N, B]): slot j's label x_{a+j+1}, whether
    it counts, and the block's tokens x_{a+j} (the GRU's inputs), clamped to the padded width."""
    width = batch.input_ids.shape[1]
    j = torch.arange(block_size, device=anchors.device)
    target = anchors[:, :, None] + 1 + j  # [Bsz, N, B]
    lengths = torch.as_tensor(batch.lengths, device=anchors.device)
    flat = target.clamp(max=width - 1).flatten(1)
    labels = batch.input_ids.gather(1, flat).view_as(target)
    supervised = batch.loss_mask.gather(1, flat).view_as(target).to(torch.bool)
    valid = keep[:, :, None] & (target < lengths[:, None, None]) & supervised
    tokens = batch.input_ids.gather(1, (target - 1).clamp(max=width - 1).flatten(1)).view_as(target)
    return labels, valid, tokens


def chunk_losses(draft: DominoDraft, rows, head, slots, prefix, labels):
    """ce of the final and of the base logits [c] fp32, and the final logits' hits [c]."""
    final, base = draft.corrected_logits(rows, head, slots, prefix)
    final, base = final.float(), base.float()
    return (F.cross_entropy(final, labels, reduction="none"), F.cross_entropy(base, labels, reduction="none"),
            final.detach().argmax(-1) == labels)


def domino_grads(final: torch.Tensor, base: torch.Tensor, labels: torch.Tensor, lse_f: torch.Tensor,
                 lse_b: torch.Tensor, coef_f: torch.Tensor, coef_b: torch.Tensor, on: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dbase, dcorrection) [c, V] in `dtype` from the final and base logits [c, V] (any float
    dtype), their logsumexps [c], the rows' coefficients coef_f = coef (1 - lambda), coef_b =
    coef lambda [c] and on [c] (slot >= PURE_DRAFT_PREFIX_LEN):
        dfinal = coef_f (softmax(final) - onehot(y)),  dbase = coef_b (softmax(base) - onehot(y)) + dfinal,
        dcorrection = on dfinal
    the softmaxes in fp32 as exp(z - lse). Compiled, one pass reading both logits and writing both
    results; eager, the operations of the in-place chain it replaced, in its order."""
    onehot = (torch.arange(final.shape[1], device=final.device)[None, :] == labels[:, None]).float()  # [c, V]
    dfinal = (torch.exp(final.float() - lse_f[:, None]) - onehot) * coef_f[:, None]
    dbase = (torch.exp(base.float() - lse_b[:, None]) - onehot) * coef_b[:, None] + dfinal
    return dbase.to(dtype), (dfinal * on[:, None]).to(dtype)


DOMINO_GRADS = compiled_on_cuda(domino_grads)


@torch.no_grad()
def manual_chunk(draft: DominoDraft, rows, head, slots, features, labels, coef, base_weight: float, want_grad: bool,
                 compiled: bool = False):
    """One chunk's final and base ce [c] fp32 and the final logits' hits [c], with, for want_grad,
    the gradient of L = sum_rows coef ((1 - lambda) ce(final) + lambda ce(base)) taken at once:
    (dL/drows [c, H], dL/dfeatures [c, E], dL/dP2 [V, E]) for rows [c, H], features = silu(P1 [z; g])
    [c, E] and P2 = embed_proj.2 [V, E]. With base = rows W^T, final = base + on P2 features,
    on = slot >= PURE_DRAFT_PREFIX_LEN:
        dfinal = coef (1 - lambda) (softmax(final) - onehot(y))
        dbase  = coef lambda (softmax(base) - onehot(y)) + dfinal
        dL/drows = dbase W,   dL/dfeatures = (on dfinal) P2,   dL/dP2 = (on dfinal)^T features
    (hard_ce_rows for each logits' ce, domino_grads for the [c, V] gradients; `compiled`: each
    through torch.compile on a GPU, one pass over the logits)."""
    rows_fn, grads_fn = (HARD_CE_ROWS, DOMINO_GRADS) if compiled else (hard_ce_rows, domino_grads)
    base = draft.base_logits(rows, head)
    final = draft.corrected(base, features, slots)  # [c, V]
    ce_f, hits, lse_f = rows_fn(final, labels)
    ce_b, _, lse_b = rows_fn(base, labels)
    if not want_grad:
        return ce_f, ce_b, hits, None
    dbase, dcorrection = grads_fn(final, base, labels, lse_f, lse_b, coef * (1.0 - base_weight), coef * base_weight,
                                  slots >= PURE_DRAFT_PREFIX_LEN, head.dtype)
    p2 = draft.embed_proj[2].weight
    return ce_f, ce_b, hits, (dbase @ head, dcorrection @ p2.to(head.dtype), dcorrection.T @ features.to(head.dtype))


def domino_loss(draft: DominoDraft, batch: Batch, lm_head: torch.Tensor, *, base_weight: float,
                num_anchors: int = 512, gamma: float = 7.0, seed: int = 0, attention: str = "auto",
                label_chunk: int | None = None, gradient: str = "manual",
                loss_scale: float = 1.0):
    """(total loss, per-slot metrics [{loss, hits, valid}] for j = 0..B-1: loss the mean final ce of
    slot j's valid rows, hits argmax(final) == x_{a+j+1}). gradient: "manual", each chunk's
    gradient taken at once (manual_chunk; loss_scale, the upstream gradient the Trainer will send,
    announced so that it is written at its scale), or "autograd", each chunk through autograd with
    its logits recomputed in the backward (the reference). The correction's features
    silu(P1 [z; g]), which have no [rows, V] part, go through autograd either way, and so into P1,
    the GRU and the rows."""
    if gradient not in ("manual", "autograd"):
        raise ValueError(f"unknown Domino gradient {gradient!r}: choose manual or autograd")
    b = draft.cfg.block_size
    anchors, keep = batch_anchors(batch, num_anchors, b, seed)
    ids, positions = block_inputs(batch.input_ids, anchors, b, draft.cfg.mask_token_id)
    context = draft.project_context(batch.aux_hidden)  # [Bsz, T, H]
    states = draft.train_forward(context, ids, positions, anchors, keep, batch.lengths, attention)  # [Bsz, N*B, H]
    labels, valid, tokens = shifted_targets(batch, anchors, keep, b)
    bsz, n = anchors.shape
    prefix = draft.prefix_states(tokens.view(bsz * n, b)).view(bsz, n, b, -1)  # teacher-forced GRU states
    j_idx, b_idx, n_idx = torch.nonzero(valid.permute(2, 0, 1), as_tuple=True)  # sorted by slot j
    rows = states.view(bsz, n, b, -1)[b_idx, n_idx, j_idx]  # [M, H]
    g = prefix[b_idx, n_idx, j_idx]  # [M, G]
    y = labels[b_idx, n_idx, j_idx]
    head = lm_head.to(rows.dtype)
    w = shifted_slot_weights(b, gamma).to(rows.device)[j_idx]  # [M]
    norm = w.sum().clamp(min=1e-6)
    chunk = label_chunk or logit_rows(head.shape[0])
    # 0 that reaches every parameter: a micro-batch with nothing to learn still gives (zero) gradients
    total = 0.0 * (states.sum() + sum(p.sum() for p in correction_parameters(draft))).float()
    ce_sums = torch.zeros(b, dtype=torch.float32, device=rows.device)
    hits = torch.zeros(b, dtype=torch.int64, device=rows.device)
    if gradient == "autograd":
        for s in range(0, len(rows), chunk):
            e = min(s + chunk, len(rows))
            ce_f, ce_b, hit = checkpoint(chunk_losses, draft, rows[s:e], head, j_idx[s:e], g[s:e], y[s:e],
                                         use_reentrant=False)
            total = total + (w[s:e] * ((1.0 - base_weight) * ce_f + base_weight * ce_b)).sum()
            ce_sums.index_add_(0, j_idx[s:e], ce_f.detach())
            hits.index_add_(0, j_idx[s:e], hit.long())
        return total / norm, slot_metrics(ce_sums, hits, j_idx, b)
    value = manual_loss(draft, rows, head, j_idx, g, y, w / norm, chunk, base_weight, loss_scale, ce_sums, hits)
    return total + value, slot_metrics(ce_sums, hits, j_idx, b)


def manual_loss(draft: DominoDraft, rows, head, j_idx, g, y, w, chunk: int, base_weight: float, loss_scale: float,
                ce_sums: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """domino_loss's loss by manual_chunk, chunk by chunk (w [M]: the rows' weights, normalised;
    g [M, G]: their GRU states), its gradients attached to the rows, the correction's features and
    P2. Adds the per-slot final ce sums and hits into ce_sums and hits."""
    want_grad = torch.is_grad_enabled() and rows.requires_grad
    if want_grad:
        check_announced(loss_scale, "domino_loss")
    compiled = compiles_elementwise(draft)  # the chunks' [c, V] math compiled where the draft's chains are
    features = draft.correction_features(rows, g)  # [M, E]
    p2 = draft.embed_proj[2].weight  # [V, E]
    grads = (torch.zeros_like(rows), torch.zeros_like(features),
             torch.zeros(p2.shape, dtype=torch.float32, device=p2.device)) if want_grad else None
    ce_f, ce_b = torch.zeros(len(rows), device=rows.device), torch.zeros(len(rows), device=rows.device)
    for s in range(0, len(rows), chunk):
        e = min(s + chunk, len(rows))
        ce_f[s:e], ce_b[s:e], hit, grad = manual_chunk(draft, rows[s:e].detach(), head, j_idx[s:e],
                                                       features[s:e].detach(), y[s:e], w[s:e] * loss_scale,
                                                       base_weight, want_grad, compiled)
        hits.index_add_(0, j_idx[s:e], hit.long())
        if grad is not None:
            grads[0][s:e], grads[1][s:e] = grad[0], grad[1].to(grads[1].dtype)
            grads[2].add_(grad[2].float())
    ce_sums.index_add_(0, j_idx, ce_f)
    value = (w * ((1.0 - base_weight) * ce_f + base_weight * ce_b)).sum()
    if not want_grad:
        return value
    return attach_gradients(value, loss_scale, (rows, grads[0]), (features, grads[1]), (p2, grads[2]))


def slot_metrics(ce_sums: torch.Tensor, hits: torch.Tensor, j_idx: torch.Tensor, block_size: int) -> list[dict]:
    """Per slot j: the mean final ce of its valid rows, its hits and its count of valid rows."""
    counts = torch.bincount(j_idx, minlength=block_size)
    return [{"loss": ce_sums[j] / counts[j].clamp(min=1), "hits": hits[j], "valid": counts[j]}
            for j in range(block_size)]


class DominoModule(torch.nn.Module):
    """The whole loss in one forward (DDP/FSDP see every parameter use); the target's lm_head is a
    frozen buffer. set_progress(step, total_steps) is the Trainer's hook for the curriculum."""

    def __init__(self, draft: DominoDraft, lm_head: torch.Tensor, *, num_anchors: int = 512, gamma: float = 7.0,
                 seed: int = 0, base_weight_start: float = 1.0, base_weight_end: float = 0.0,
                 base_decay_fraction: float = 1.0, label_chunk: int | None = None, compile_elementwise: bool = True,
                 gradient: str = "manual"):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.options = dict(num_anchors=num_anchors, gamma=gamma, seed=seed, label_chunk=label_chunk,
                            gradient=gradient)
        self.schedule = (base_weight_start, base_weight_end, base_decay_fraction)
        self.progress = (0, 1)

    def set_progress(self, step: int, total_steps: int) -> None:
        self.progress = (step, total_steps)

    @property
    def base_weight(self) -> float:
        return base_weight_at(*self.progress, *self.schedule)

    def forward(self, batch: Batch, attention: str = "auto", loss_kernel: str = "auto", loss_scale: float = 1.0):
        del loss_kernel  # hard labels only: no soft-target kernel
        return domino_loss(self.draft, batch, self.lm_head, base_weight=self.base_weight, attention=attention,
                           loss_scale=loss_scale, **self.options)
