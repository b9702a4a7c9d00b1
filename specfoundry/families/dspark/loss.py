"""DSpark training: DFlash's sampled anchors and blocks (families/dflash/loss.py), labels from the
anchor, and the three-term objective of the DSpark paper (arXiv 2607.05147) as SpecForge trains it
(specforge/core/dspark.py, after DeepSpec's loss).

Per sample of tokens x_0..x_{n-1}, loss mask m and the target's stored final states f_0..f_{n-1},
anchors a are drawn as DFlash draws them (sample_anchors: m[a] and m[a+1]). The block of anchor a
is [x_a, M, ..., M] at a..a+B-1; its slot j (0 <= j < B) predicts y_j = x_{a+j+1} with the previous
token u_j = x_{a+j} (model.py; teacher forcing). Slot j counts iff every slot i <= j has a+i+1 < n
and m[a+i+1]: the supervised prefix of the block (DeepSpec's eval mask; a hole ends the block, as a
rejection ends a round). With l_j = model.py's logits (Markov bias included), p_j = softmax(l_j),
the teacher q_j = softmax(f_{a+j} W^T) (the target's distribution for x_{a+j+1}), c_j the
confidence head's logit and w_j = exp(-j / gamma) (gamma <= 0: 1):
    ce_j   = -log p_j[y_j]
    l1_j   = sum_v |p_j[v] - q_j[v]|                      in [0, 2]
    acc_j  = clamp(1 - l1_j / 2, 0, 1)                    sum_v min(p, q): the probability that
                                                          speculative sampling accepts p's token
    bce_j  = BCE(sigmoid(c_j), acc_j)                     acc_j held without gradient
    loss   = sum_counted w_j (ce_w ce_j + l1_w l1_j + conf_w bce_j) / sum_counted w_j
(--ce-weight 0.1, --l1-weight 0.9, --confidence-weight 1). The normaliser is the micro-batch's. The
loss is taken chunk by chunk and no [rows, V] tensor is kept: by default each chunk's ce and L1
gradient with respect to the rows, A_u and P is taken at once in the forward (manual_chunk, as
DFlash's loss takes its own), so the backward only scales it; the reference path goes through
autograd with each chunk recomputed in the backward (activation checkpointing). The confidence
term has no [rows, V] part and goes through autograd on both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specfoundry.families.dflash.anchors import batch_anchors, block_inputs
from specfoundry.families.dflash.loss import attach_gradients, check_announced
from specfoundry.families.dspark.model import DSparkDraft, head_parameters
from specfoundry.families.layers import compiled_on_cuda, compiles_elementwise
from specfoundry.families.teacher import logit_rows
from specfoundry.featureset.batch import Batch


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_j = exp(-j / gamma) for j = 0..B-1 (gamma <= 0: uniform)."""
    return torch.tensor([math.exp(-j / gamma) if gamma > 0 else 1.0 for j in range(block_size)])


def anchor_targets(batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int):
    """(labels, counted, prev) [Bsz, N, B] each: slot j's label x_{a+j+1}, whether it counts (the
    block's supervised prefix), and its previous token x_{a+j}, clamped to the padded width."""
    width = batch.input_ids.shape[1]
    target = anchors[:, :, None] + 1 + torch.arange(block_size, device=anchors.device)  # [Bsz, N, B]
    lengths = torch.as_tensor(batch.lengths, device=anchors.device)
    flat = target.clamp(max=width - 1).flatten(1)
    labels = batch.input_ids.gather(1, flat).view_as(target)
    supervised = batch.loss_mask.gather(1, flat).view_as(target).to(torch.bool)
    ok = keep[:, :, None] & (target < lengths[:, None, None]) & supervised
    counted = ok.to(torch.int32).cumprod(-1).to(torch.bool)
    prev = batch.input_ids.gather(1, (target - 1).clamp(max=width - 1).flatten(1)).view_as(target)
    return labels, counted, prev


def chunk_terms(draft: DSparkDraft, rows, head, prev, labels, teacher):
    """ce, l1, bce [c] fp32 of a chunk of rows [c, H] (previous tokens prev [c], labels [c], the
    target's final states teacher [c, H]), the argmax hits [c] and the predicted confidence [c]."""
    logits = draft.step_logits(rows, head, prev).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    with torch.no_grad():
        q = torch.softmax((teacher @ head.T).float(), dim=-1)
    l1 = (torch.softmax(logits, dim=-1) - q).abs().sum(-1)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    c = draft.confidence_logit(rows, prev).float()
    bce = F.binary_cross_entropy_with_logits(c, accept, reduction="none")
    return ce, l1, bce, logits.detach().argmax(-1) == labels, torch.sigmoid(c.detach())


def dspark_rows(z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor):
    """From the draft's logits z and the target's t [c, V] (any float dtype) and labels [c]: (ce,
    hits, lse, l1, sp) [c], with p = softmax(z) = exp(z - lse), q = softmax(t) and s = sign(p - q):
    ce = lse - z[y], l1 = sum |p - q|, sp = <s, p>; all in fp32. Compiled, two passes over each
    row (the logsumexps, then the sums that need them)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    p = torch.exp(zf - lse[:, None])
    d = -(torch.softmax(t.float(), dim=-1) - p)  # p - q
    return (lse - zf.gather(1, labels[:, None]).squeeze(1), zf.argmax(-1) == labels, lse, d.abs().sum(-1),
            (d.sign() * p).sum(-1))


def dspark_grad(z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, sp: torch.Tensor,
                coef: torch.Tensor, ce_weight: float, l1_weight: float, dtype: torch.dtype) -> torch.Tensor:
    """dL/dz [c, V] in `dtype` for L = sum_rows coef (ce_weight ce + l1_weight l1) (manual_chunk's
    formulas), p and q recomputed from z, lse and t as dspark_rows takes them. Compiled, one pass
    reading both logits and writing the result."""
    zf = z.float()
    p = torch.exp(zf - lse[:, None])
    s = (-(torch.softmax(t.float(), dim=-1) - p)).sign()
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]).float()  # [c, V]
    dz = (s - sp[:, None]) * p * l1_weight + p * ce_weight - onehot * ce_weight
    return (dz * coef[:, None]).to(dtype)


DSPARK_ROWS = compiled_on_cuda(dspark_rows)
DSPARK_GRAD = compiled_on_cuda(dspark_grad)


@torch.no_grad()
def manual_chunk(draft: DSparkDraft, rows, head, a_u, prev, labels, teacher, coef, ce_weight: float,
                 l1_weight: float, want_grad: bool, compiled: bool = False):
    """One chunk's ce and l1 [c] fp32 and argmax hits [c] with, for want_grad, the gradient of
    L = sum_rows coef (ce_weight ce + l1_weight l1) taken at once: (dL/drows [c, H], dL/dA_u [c, R],
    dL/dP [V, R]) for rows [c, H], A_u = markov_w1[prev] [c, R] and P = markov_w2 [V, R]. With
    z = rows W^T + A_u P^T, p = softmax(z), q = softmax(teacher W^T) and s = sign(p - q):
        d ce / dz = p - onehot(y)
        d l1 / dz_k = sum_v s_v p_v (delta_vk - p_k) = p_k (s_k - <s, p>)
        dL/drows = dz W,   dL/dA_u = dz P,   dL/dP = dz^T A_u            (dz = dL/dz [c, V])
    (dspark_rows, dspark_grad; `compiled`: through torch.compile on a GPU, no fp32 [c, V] buffer)."""
    rows_fn, grad_fn = (DSPARK_ROWS, DSPARK_GRAD) if compiled else (dspark_rows, dspark_grad)
    z = draft.step_logits(rows, head, prev)  # [c, V]
    t = teacher @ head.T  # [c, V] the target's logits
    ce, hits, lse, l1, sp = rows_fn(z, t, labels)
    if not want_grad:
        return ce, l1, hits, None
    dz = grad_fn(z, t, labels, lse, sp, coef, ce_weight, l1_weight, head.dtype)
    w2 = draft.markov_head.markov_w2.weight
    return ce, l1, hits, (dz @ head, dz @ w2.to(dz.dtype), dz.T @ a_u.to(dz.dtype))


def manual_loss(draft: DSparkDraft, rows, head, u, y, teacher, w, j_idx, chunk: int, weights, loss_scale: float,
                sums: dict, hits: torch.Tensor) -> torch.Tensor:
    """dspark_loss's loss by manual_chunk, chunk by chunk (w [M]: the rows' weights, normalised;
    weights: ce, l1 and confidence weights), its gradients attached to the rows, A_u and P; the
    confidence term through autograd. Adds the per-slot sums and hits into sums and hits."""
    ce_weight, l1_weight, confidence_weight = weights
    want_grad = torch.is_grad_enabled() and rows.requires_grad
    if want_grad:
        check_announced(loss_scale, "dspark_loss")
    compiled = compiles_elementwise(draft)  # the chunks' [c, V] math compiled where the draft's chains are
    a_u = draft.markov_head.markov_w1(u)  # [M, R]
    w2 = draft.markov_head.markov_w2.weight  # [V, R]
    grads = (torch.zeros_like(rows), torch.zeros_like(a_u),
             torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)) if want_grad else None
    ce, l1 = torch.zeros(len(rows), device=rows.device), torch.zeros(len(rows), device=rows.device)
    for s in range(0, len(rows), chunk):
        e = min(s + chunk, len(rows))
        ce[s:e], l1[s:e], hit, g = manual_chunk(draft, rows[s:e].detach(), head, a_u[s:e].detach(), u[s:e], y[s:e],
                                                teacher[s:e], w[s:e] * loss_scale, ce_weight, l1_weight, want_grad,
                                                compiled)
        hits.index_add_(0, j_idx[s:e], hit.long())
        if g is not None:
            grads[0][s:e], grads[1][s:e] = g[0], g[1].to(grads[1].dtype)
            grads[2].add_(g[2].float())
    value = (w * (ce_weight * ce + l1_weight * l1)).sum()
    if want_grad:
        value = attach_gradients(value, loss_scale, (rows, grads[0]), (a_u, grads[1]), (w2, grads[2]))
    c = draft.confidence_logit(rows, u).float()  # [M]: no [M, V] part, so through autograd
    bce = F.binary_cross_entropy_with_logits(c, (1.0 - 0.5 * l1).clamp(0.0, 1.0), reduction="none")
    for k, v in (("ce", ce), ("l1", l1), ("confidence", torch.sigmoid(c.detach()))):
        sums[k].index_add_(0, j_idx, v)
    return value + (w * confidence_weight * bce).sum()


def dspark_loss(draft: DSparkDraft, batch: Batch, lm_head: torch.Tensor, *, num_anchors: int = 512,
                gamma: float = 7.0, seed: int = 0, ce_weight: float = 0.1, l1_weight: float = 0.9,
                confidence_weight: float = 1.0, attention: str = "auto", label_chunk: int | None = None,
                gradient: str = "manual", loss_scale: float = 1.0):
    """(total loss, per-slot metrics [{loss, hits, valid, l1, confidence}] for j = 0..B-1: loss the
    mean ce of slot j's counted rows, hits argmax == x_{a+j+1}, l1 and confidence their sums).
    gradient: "manual", each chunk's ce and L1 gradient taken at once (manual_chunk; loss_scale,
    the upstream gradient the Trainer will send, announced so that it is written at its scale), or
    "autograd", each chunk through autograd with its logits recomputed in the backward (the
    reference). The confidence term, which has no [rows, V] part, goes through autograd either way."""
    if gradient not in ("manual", "autograd"):
        raise ValueError(f"unknown DSpark gradient {gradient!r}: choose manual or autograd")
    if batch.final_hidden is None:
        raise ValueError("DSpark's L1 and confidence terms read the target's final hidden states; the batch "
                         "holds none (capture with the final state)")
    b = draft.cfg.block_size
    anchors, keep = batch_anchors(batch, num_anchors, b, seed)
    ids, positions = block_inputs(batch.input_ids, anchors, b, draft.cfg.mask_token_id)
    context = draft.project_context(batch.aux_hidden)  # [Bsz, T, H]
    states = draft.train_forward(context, ids, positions, anchors, keep, batch.lengths, attention)  # [Bsz, N*B, H]
    labels, counted, prev = anchor_targets(batch, anchors, keep, b)
    bsz, n = anchors.shape
    j_idx, b_idx, n_idx = torch.nonzero(counted.permute(2, 0, 1), as_tuple=True)  # sorted by slot j
    rows = states.view(bsz, n, b, -1)[b_idx, n_idx, j_idx]  # [M, H]
    head = lm_head.to(rows.dtype)
    teacher = batch.final_hidden[b_idx, anchors[b_idx, n_idx] + j_idx].to(head.dtype)  # f_{a+j}: [M, H]
    y, u = labels[b_idx, n_idx, j_idx], prev[b_idx, n_idx, j_idx]
    w = slot_weights(b, gamma).to(rows.device)[j_idx]  # [M]
    norm = w.sum().clamp(min=1e-6)
    chunk = label_chunk or logit_rows(head.shape[0])
    # 0 that reaches every parameter: a micro-batch with nothing to learn still gives (zero) gradients
    total = 0.0 * (states.sum() + sum(p.sum() for p in head_parameters(draft))).float()
    sums = {k: torch.zeros(b, dtype=torch.float32, device=rows.device) for k in ("ce", "l1", "confidence")}
    hits = torch.zeros(b, dtype=torch.int64, device=rows.device)
    if gradient == "autograd":
        for s in range(0, len(rows), chunk):
            e = min(s + chunk, len(rows))
            ce, l1, bce, hit, conf = checkpoint(chunk_terms, draft, rows[s:e], head, u[s:e], y[s:e], teacher[s:e],
                                                use_reentrant=False)
            total = total + (w[s:e] * (ce_weight * ce + l1_weight * l1 + confidence_weight * bce)).sum()
            for k, v in (("ce", ce), ("l1", l1), ("confidence", conf)):
                sums[k].index_add_(0, j_idx[s:e], v.detach())
            hits.index_add_(0, j_idx[s:e], hit.long())
        total = total / norm
    else:
        total = total + manual_loss(draft, rows, head, u, y, teacher, w / norm, j_idx, chunk,
                                    (ce_weight, l1_weight, confidence_weight), loss_scale, sums, hits)
    counts = torch.bincount(j_idx, minlength=b)
    metrics = [{"loss": sums["ce"][j] / counts[j].clamp(min=1), "hits": hits[j], "valid": counts[j],
                "l1": sums["l1"][j], "confidence": sums["confidence"][j]} for j in range(b)]
    return total, metrics


class DSparkModule(torch.nn.Module):
    """The whole loss in one forward (DDP/FSDP see every parameter use); the target's lm_head is a
    frozen buffer."""

    def __init__(self, draft: DSparkDraft, lm_head: torch.Tensor, *, num_anchors: int = 512, gamma: float = 7.0,
                 seed: int = 0, ce_weight: float = 0.1, l1_weight: float = 0.9, confidence_weight: float = 1.0,
                 label_chunk: int | None = None, compile_elementwise: bool = True, gradient: str = "manual"):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.options = dict(num_anchors=num_anchors, gamma=gamma, seed=seed, ce_weight=ce_weight,
                            l1_weight=l1_weight, confidence_weight=confidence_weight, label_chunk=label_chunk,
                            gradient=gradient)

    def forward(self, batch: Batch, attention: str = "auto", loss_kernel: str = "auto", loss_scale: float = 1.0):
        del loss_kernel  # no soft-target kernel: the L1 term needs the draft's whole distribution
        return dspark_loss(self.draft, batch, self.lm_head, attention=attention, loss_scale=loss_scale,
                           **self.options)
