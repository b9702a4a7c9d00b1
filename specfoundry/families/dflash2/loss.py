"""DFlash2 training: DFlash's anchored blocks and slot loss (families/dflash/loss.py), plus the
selector's K-way cross entropy, weighted by a schedule over the run.

Per block of anchor a, slot k (1 <= k < B) is scored where DFlash scores it (inside its sample,
supervised) and predicts y = x_{a+k}; its predecessor is p = x_{a+k-1} (the anchor for k = 1:
teacher forcing, as SpecForge, speculators and ModelOpt train it). With DFlash's slot weights
w_k = exp(-(k-1)/gamma), its normaliser N = sum over scored slots of w_k, the unary cross entropy
ce_k of the slot's logits z W^T (DFlash's, chunk by chunk, its gradient taken by hand) and the
slot's candidates C = topk(z W^T, K):
    sel_k  = -log softmax_{c in C}(score(p -> c))[y]       (model.py candidate_scores)
    loss   = (sum w_k ce_k + alpha_eff sum_{trained} w_k sel_k) / N
Which slots train the selector, the objective (--selector-loss):
    topk  (default, the longer acceptance on SmolLM2: docs/families.md; SpecForge's
          _selector_chunk_terms): the strict top K; a slot whose C misses y has no selector loss
    gold  (speculators' selector_training_candidates, ModelOpt's _selector_loss): every scored
          slot; where C misses y, its last candidate (rank K) is replaced by y, with y's own unary
          logit, for the loss only (decoding never injects it)
The same weights and normaliser serve both (SpecForge's; ModelOpt weighs uniformly). The selector's
gradient reaches the unary logits of C and the states (coupled, SpecForge's default) unless
--selector-stop-gradient, where it trains the selector alone. alpha_eff follows SpecForge's
schedule over optimizer steps (selector_weight_at): 0 for the warm-up, then a linear ramp to
--selector-loss-alpha; while it is 0 the selector's term stays in the graph (zero gradients).
The candidates are taken from the unary loss's own chunks of logits (no second [rows, V] product);
the selector's term goes through autograd in chunks of rows across slots (selector_rows), each
recomputed in its backward (activation checkpointing) from the rows and the candidates' K rows of W
alone.

Metrics per slot (train/metrics.py): `loss` the unary ce; `hits` the selector's teacher-forced
hits (the target's token in the strict top K and ranked first: what decoding proposes after a
correct prefix), so acc_k and sim_accept_len are the selector's; rates unary_acc (the backbone's
top-1) and topk_recall (the target's token among the K: its chain is the top-K oracle's acceptance
length); means selector_loss and selector_covered_acc (accuracy where the top K hold the token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specfoundry.families.dflash.anchors import batch_anchors, block_inputs, valid_slots
from specfoundry.families.dflash.loss import (
    AttachGradient,
    check_announced,
    chunked_loss,
    scored_rows,
    slot_weights,
)
from specfoundry.families.dflash2.model import DFlash2Draft, selector_parameters
from specfoundry.families.dflash2.options import SELECTOR_LOSSES
from specfoundry.families.layers import compiles_elementwise
from specfoundry.families.teacher import logit_rows
from specfoundry.featureset.batch import Batch


def selector_weight_at(step: int, total_steps: int, alpha: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """alpha_eff before optimizer step `step` (0-based: the steps completed) of `total_steps`, as
    SpecForge's _selector_alpha: 0 during int(total * warmup_ratio) steps, then
    alpha * min(1, (step - warmup + 1) / ramp) with ramp = int(total * ramp_ratio) (no ramp: alpha)."""
    warmup = int(total_steps * warmup_ratio)
    if step < warmup:
        return 0.0
    ramp = int(total_steps * ramp_ratio)
    if ramp <= 0:
        return alpha
    return alpha * min(max((step - warmup + 1) / ramp, 0.0), 1.0)


def selector_targets(ids: torch.Tensor, labels: torch.Tensor, objective: str):
    """For candidates ids [c, K] (topk of the unary logits) and labels [c]: (the candidates the loss
    reads [c, K], the label's index there [c], covered [c]: the strict top K hold the label,
    trained [c]: the row has a selector loss). gold puts the label at rank K where it is missing."""
    covered = (ids == labels[:, None]).any(-1)
    if objective == "gold":
        ids = torch.cat([ids[:, :-1], torch.where(covered, ids[:, -1], labels)[:, None]], dim=1)
        trained = torch.ones_like(covered)
    else:
        trained = covered
    index = (ids == labels[:, None]).int().argmax(-1)  # 0 where absent: such a row is not trained
    return ids, index, covered, trained


def selector_chunk(draft: DFlash2Draft, rows: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                   predecessors: torch.Tensor, objective: str, stop_gradient: bool):
    """One chunk of scored rows [c, H] with their candidates ids [c, K] (the top K of their unary
    logits): (sel [c] fp32, 0 where not trained; trained, covered [c]; hits [c]: covered and the
    selector ranks the label first). The unary logits of the candidates are h . W[c], so their
    gradient reaches the rows without a [c, V] product."""
    h = rows.detach() if stop_gradient else rows
    ids, index, covered, trained = selector_targets(ids, labels, objective)
    unary = torch.einsum("ch,ckh->ck", h, head[ids].to(h.dtype))  # [c, K]
    scores = draft.candidate_selector.score(unary, ids, h, predecessors)  # [c, K] fp32
    sel = F.cross_entropy(scores, index, reduction="none") * trained
    return sel, trained, covered, covered & (scores.detach().argmax(-1) == index)


SELECTOR_CHUNK_BYTES = 1 << 28
"""What one selector chunk's gathered candidate rows of W ([c, K, H] in the rows' dtype) may take:
c = 14,563 rows for K = 16 at SmolLM2's H = 576 in bf16, 2,048 at H = 4096. The chunks run across
slots: their count, not their size, is what a step's host time pays (each is ~100 launches, its
recompute and backward included)."""


def selector_rows(top_k: int, hidden_size: int, itemsize: int) -> int:
    """Rows per selector chunk (SELECTOR_CHUNK_BYTES)."""
    return max(1, SELECTOR_CHUNK_BYTES // (top_k * hidden_size * itemsize))


def selector_terms(draft: DFlash2Draft, rows, head, candidates, counts: list[int], weights: list[float], labels,
                   predecessors, objective: str, stop_gradient: bool, chunk: int):
    """(sum over rows of w_k(row) sel (autograd), per-slot sums [B-1] of sel, trained, covered and
    hits) over chunks of `chunk` rows that run across slots (rows are slot by slot, counts[k] each),
    each chunk checkpointed; candidates [M, K] the rows'."""
    device = rows.device
    slots = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                    torch.tensor(counts, device=device))  # [M] each row's slot
    row_weights = torch.tensor(weights, dtype=torch.float32, device=device)[slots]  # [M] w_k of each row
    total = torch.zeros((), dtype=torch.float32, device=device)
    sums = torch.zeros(4, len(counts), dtype=torch.float32, device=device)  # sel, trained, covered, hits
    for s in range(0, rows.shape[0], chunk):
        e = min(s + chunk, rows.shape[0])
        sel, *counted = checkpoint(selector_chunk, draft, rows[s:e], head, candidates[s:e], labels[s:e],
                                   predecessors[s:e], objective, stop_gradient, use_reentrant=False)
        total = total + (row_weights[s:e] * sel).sum()
        sums.index_add_(1, slots[s:e], torch.stack([sel.detach(), *(v.float() for v in counted)]))
    return total, dict(zip(("sel", "trained", "covered", "hits"), sums, strict=True))


def slot_metrics(ce_sums, unary_hits, counts: list[int], stats: dict) -> list[dict]:
    """Per slot k = 1..B-1 (the module docstring's metrics)."""
    n = torch.tensor(counts, device=ce_sums.device)
    return [{"loss": ce_sums[k] / max(counts[k], 1), "hits": stats["hits"][k], "valid": n[k],
             "rates": {"unary_acc": (unary_hits[k], n[k]), "topk_recall": (stats["covered"][k], n[k])},
             "means": {"selector_loss": (stats["sel"][k], stats["trained"][k]),
                       "selector_covered_acc": (stats["hits"][k], stats["covered"][k])}}
            for k in range(len(counts))]


def dflash2_loss(draft: DFlash2Draft, batch: Batch, lm_head: torch.Tensor, *, num_anchors: int = 512,
                 gamma: float = 7.0, seed: int = 0, attention: str = "auto", loss_kernel: str = "auto",
                 loss_scale: float = 1.0, label_chunk: int | None = None, selector_loss: str = "topk",
                 selector_weight: float = 1.0, stop_gradient: bool = False):
    """(total loss, per-slot metrics for k = 1..B-1; slot_metrics). selector_weight: alpha_eff of this
    step; the other arguments as dflash_loss's (hard teacher, the dflash objective)."""
    if selector_loss not in SELECTOR_LOSSES:
        raise ValueError(f"unknown selector loss {selector_loss!r}: choose {' or '.join(SELECTOR_LOSSES)}")
    b = draft.cfg.block_size
    anchors, keep = batch_anchors(batch, num_anchors, b, seed)
    ids, positions = block_inputs(batch.input_ids, anchors, b, draft.cfg.mask_token_id)
    context = draft.project_context(batch.aux_hidden)  # [Bsz, T, H]
    states = draft.train_forward(context, ids, positions, anchors, keep, batch.lengths, attention)  # [Bsz, N*B, H]
    rows, where, target_pos, counts = scored_rows(states, valid_slots(batch, anchors, keep, b), anchors)
    labels = batch.input_ids[where[1], target_pos]  # x_{a+k} [M]
    predecessors = batch.input_ids[where[1], target_pos - 1]  # x_{a+k-1} [M], the anchor for k = 1
    head = lm_head.to(rows.dtype)
    want_grad = torch.is_grad_enabled() and rows.requires_grad
    if want_grad:
        check_announced(loss_scale, "dflash2_loss")
    weights, chunk = slot_weights(b, gamma), label_chunk or logit_rows(head.shape[0])
    candidates = []  # each chunk's top K [c, K], taken from the logits the unary loss computes anyway

    def logits(h: torch.Tensor) -> torch.Tensor:  # chunked_loss calls it once per chunk, in slot_chunks' order
        z = draft.block_logits(h, head)
        candidates.append(draft.candidate_selector.candidates(z)[1])
        return z

    value, grad, ce_sums, unary_hits = chunked_loss(
        rows.detach(), head, counts, weights, labels, "hard", chunk=chunk, announced=loss_scale,
        loss_kernel=loss_kernel, want_grad=want_grad, logits=logits, compiled=compiles_elementwise(draft))
    unary = AttachGradient.apply(rows, value, grad, loss_scale) if want_grad else value
    candidates = torch.cat(candidates) if candidates else labels.new_zeros(0, draft.cfg.selector_top_k)  # [M, K]
    selector, stats = selector_terms(draft, rows, head, candidates, counts, weights, labels, predecessors,
                                     selector_loss, stop_gradient,
                                     selector_rows(draft.cfg.selector_top_k, rows.shape[-1], head.element_size()))
    norm = max(sum(w * c for w, c in zip(weights, counts, strict=True)), 1e-6)  # chunked_loss's normaliser
    # 0 that reaches every selector parameter: a micro-batch with nothing scored still gives (zero) gradients
    unused = sum(p.sum() for p in selector_parameters(draft) if p.requires_grad) * 0.0
    total = unary + selector_weight * selector / norm + unused
    return total, slot_metrics(ce_sums, unary_hits, counts, stats)


class DFlash2Module(torch.nn.Module):
    """The whole loss in one forward (DDP/FSDP see every parameter use); the target's lm_head is a
    frozen buffer. set_progress(step, total_steps) is the Trainer's hook for the selector's schedule."""

    def __init__(self, draft: DFlash2Draft, lm_head: torch.Tensor, *, num_anchors: int = 512, gamma: float = 7.0,
                 seed: int = 0, label_chunk: int | None = None, compile_elementwise: bool = True,
                 selector_loss: str = "topk", selector_loss_alpha: float = 1.0, selector_warmup_ratio: float = 0.0,
                 selector_ramp_ratio: float = 0.0, selector_stop_gradient: bool = False):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.options = dict(num_anchors=num_anchors, gamma=gamma, seed=seed, label_chunk=label_chunk,
                            selector_loss=selector_loss, stop_gradient=selector_stop_gradient)
        self.schedule = (selector_loss_alpha, selector_warmup_ratio, selector_ramp_ratio)
        self.progress = (0, 1)

    def set_progress(self, step: int, total_steps: int) -> None:
        self.progress = (step, total_steps)

    @property
    def selector_weight(self) -> float:
        return selector_weight_at(*self.progress, *self.schedule)

    def forward(self, batch: Batch, attention: str = "auto", loss_kernel: str = "auto", loss_scale: float = 1.0):
        return dflash2_loss(self.draft, batch, self.lm_head, attention=attention, loss_kernel=loss_kernel,
                            loss_scale=loss_scale, selector_weight=self.selector_weight, **self.options)
