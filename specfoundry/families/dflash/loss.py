"""DFlash training: many anchored blocks per sample, one forward, a weighted per-slot loss.

With a row's tokens x_0..x_{n-1} (n its real length) and its loss mask m, N anchors a are drawn
(anchors.py sample_anchors). The block of anchor a is
    ids        [x_a, MASK, ..., MASK]                 B slots
    positions  a, a+1, ..., a+B-1
    context    the row's features at positions j < a  (the mask in kernels/dflash_attention.py)
and its slot k (1 <= k < B) predicts x_{a+k}; slot 0 holds the anchor and is never scored. Slot k
is valid iff a + k < n and m[a+k] (a block may run past the end: those slots are dropped). With
w_k = exp(-(k-1) / gamma) (gamma <= 0: w_k = 1) and the cross entropy ce of the target's lm_head
over the block's final states,
    loss = sum_{valid (row, a, k)} w_k * ce(a, k)  /  sum_{valid} w_k
normalised over the micro-batch's valid slots, not per block: a block cut short by the end of its
sample weighs less, as its slots do at serving time. teacher "hard": ce against x_{a+k}; "soft":
against the target's distribution for that token, softmax(lm_head(final_hidden[a+k-1])), or the
top-k teacher a feature set stores in the final state's place (families/teacher.py TopKRows).

The logits are the draft's own (model.block_logits, the target's lm_head over the states unless a
family adds a head of its own). Their [rows, V] (V = 151936 for Qwen3, rows up to N*(B-1) per
sample) are never held whole: they are computed chunk by chunk. For a head without parameters
(model.plain_head) each chunk's loss and gradient with respect to the block states are taken at
once, so the backward only scales that stored [rows, H] gradient; a head with parameters goes
through autograd, each chunk's logits recomputed in the backward (activation checkpointing), so
its parameters train and no chunk's logits outlive it.

D-PACE (objective "dpace"; Wu et al., "D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel
Speculative Drafting", arXiv 2605.18810) replaces the fixed w_k with weights from the draft's own
confidence, recomputed every step and held without gradient. Per block, with m_k whether slot k
counts and q_k = exp(-ce(a, k)) (hard teacher: the draft's probability of the label x_{a+k}, the
paper's case; soft, our extension: the exp of the slot's soft cross entropy, so that w_k below is
still the weight of that slot's own loss in the gradient of tau),
    s_k = (1 - alpha) q_k + alpha  where m_k, else 1    a slot that does not count is a no-op
    P_k = prod_{j <= k} s_j                              slots 1..k all accepted (smoothed)
    tau = sum_k m_k P_k                                  the surrogate of the expected accepted length
    w_k = sum_{j >= k} m_j P_j  (= d tau / d log s_k)    every later acceptance that needs slot k
    loss = sum_{counted} w_k * ce  /  sum_{counted} w_k  over the micro-batch
so the signal moves to the positions that currently limit the accepted length. The weights are
those of the authors' code (github.com/Lucas-TY/D-PACE, specforge/core/dflash.py) and of
SpecForge's `--loss-type dpace`; alpha (dpace_alpha) defaults to their 0.5. The normaliser is ours:
they divide sum w * ce by the batch size, here it is sum w, as for the dflash objective. Both are
constants of the micro-batch, so the gradient's direction is theirs; its scale stays that of a
mean cross entropy, comparable with the dflash objective's, and a recipe's learning rate and
gradient clip carry over (theirs grows with the anchors per sample and as the draft improves).
The weights need every slot of a block, which later chunks compute: each chunk writes its
gradient for a unit weight and keeps its rows' ce [M]; after the last chunk the weights are
computed from them and the stored [M, H] gradient rows scaled by w / sum(w). One pass over the
logits as before, no [M, V] tensor; in bf16 the scaled gradient is rounded once more.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specfoundry.families.dflash.anchors import batch_anchors, block_inputs, valid_slots
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dflash.options import OBJECTIVES
from specfoundry.families.layers import compiled_on_cuda, compiles_elementwise
from specfoundry.families.teacher import TopKRows, logit_rows
from specfoundry.featureset.batch import Batch
from specfoundry.kernels.lk_loss import TokenLoss, lk_loss
from specfoundry.kernels.soft_ce import soft_target_cross_entropy

TINY_SUM = torch.finfo(torch.float32).tiny
"""D-PACE's normaliser at least: only an all-zero sum of weights (nothing counts) reaches it."""


def slot_weights(block_size: int, gamma: float) -> list[float]:
    """w_k = exp(-(k-1) / gamma) for k = 1..B-1 (gamma <= 0: uniform)."""
    return [math.exp(-(k - 1) / gamma) if gamma > 0 else 1.0 for k in range(1, block_size)]


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, where, alpha: float) -> torch.Tensor:
    """D-PACE's weight of each scored row (module docstring), without gradient: ce [M] fp32 of the
    rows, valid [Bsz, N, B-1] the slots that count, where: scored_rows' (k-1, b, n) of each row.
    Returns w [M] fp32. The blocks are laid out [B-1, Bsz, N], so the products and sums run over
    the first axis; a slot that does not count is 1 in the products and 0 in the sums. Indexed by
    `where`, not by the mask: no host sync."""
    by_slot = valid.permute(2, 0, 1)  # [B-1, Bsz, N]
    s = torch.ones(by_slot.shape, dtype=torch.float32, device=ce.device)
    s[where] = (1.0 - alpha) * torch.exp(-ce.float()) + alpha
    prefix = torch.cumprod(s, dim=0) * by_slot  # m_k P_k
    return prefix.flip(0).cumsum(0).flip(0)[where]  # w_k = sum_{j >= k} m_j P_j


def slot_chunks(counts: list[int], chunk: int):
    """(k index, start, end) of each chunk of at most `chunk` rows within each slot's rows."""
    start = 0
    for k, count in enumerate(counts):
        for s in range(start, start + count, chunk):
            yield k, s, min(s + chunk, start + count)
        start += count


class AttachGradient(torch.autograd.Function):
    """`value`, computed without autograd, as a function of x whose gradient was computed with it:
    grad is d(value)/dx for the upstream gradient `announced`; backward scales it to the actual."""

    @staticmethod
    def forward(ctx, x, value, grad, announced: float):
        ctx.save_for_backward(grad)
        ctx.announced = announced
        return value.clone()

    @staticmethod
    def backward(ctx, upstream):
        (grad,) = ctx.saved_tensors
        return grad * (upstream / ctx.announced).to(grad.dtype), None, None, None


def check_announced(loss_scale: float, loss: str) -> None:
    """A loss that writes its gradient at once is told the upstream gradient (loss_scale): it must be
    a positive finite number."""
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"{loss}: loss_scale must be a positive finite number, got {loss_scale}")


def attach_gradients(value: torch.Tensor, announced: float, *pairs) -> torch.Tensor:
    """value (0-d, computed without autograd) as a function of each (tensor, its gradient) pair:
    the gradients were computed for the upstream gradient `announced`; the backward scales them."""
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    (x, grad), *rest = pairs
    total = AttachGradient.apply(x, value, grad.to(x.dtype), announced)
    for x, grad in rest:  # the value once; the others carry only their gradients
        total = total + AttachGradient.apply(x, zero, grad.to(x.dtype), announced)
    return total


def hard_ce_rows(z: torch.Tensor, labels: torch.Tensor):
    """z [c, V] logits (any float dtype), labels [c]: (ce [c], hits [c] bool, lse [c]), summed in
    fp32, with lse = logsumexp(z) and ce = lse - z[y]. One pass over z when compiled."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    return lse - zf.gather(1, labels[:, None]).squeeze(1), zf.argmax(-1) == labels, lse


def hard_ce_grad(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """d(sum_rows coef * ce) / dz = coef * (softmax(z) - onehot(y)), [c, V] in `dtype`, the
    softmax taken in fp32 as exp(z - lse). Compiled, one pass reading z and writing the result;
    eager, the same operations in the same order as the in-place chain it replaced."""
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]  # [c, V]
    return ((torch.exp(z.float() - lse[:, None]) - onehot.float()) * coef[:, None]).to(dtype)


# on a GPU each runs through torch.compile: the eager chain was about ten memory passes over every
# [c, V] fp32 chunk (the cast, logsumexp, argmax, gather, subtract, exp, one-hot, scale, cast back),
# more than half of a SmolLM2 DFlash step's kernel time (docs/LOG.md)
HARD_CE_ROWS = compiled_on_cuda(hard_ce_rows)
HARD_CE_GRAD = compiled_on_cuda(hard_ce_grad)


def teacher_probs(t: torch.Tensor, dtype: torch.dtype):
    """t [c, V] the target's logits of a chunk (any float dtype): (p [c, V] = softmax(t) taken in
    fp32 and stored in `dtype`, the teacher's token argmax(p) [c]). Compiled, one pass computes
    each row's max and sum of exp and one more writes p; eager, the same operations in the same
    order as the chain it replaced."""
    p = torch.softmax(t.float(), dim=-1)
    return p.to(dtype), p.argmax(-1)


# the soft teacher's eager chain made an fp32 copy of every [c, V] chunk of target logits, its
# softmax, an argmax and a cast back, each a pass over the chunk: a larger share of a soft-teacher
# DFlash step's kernel time than its loss kernel (docs/LOG.md)
TEACHER_PROBS = compiled_on_cuda(teacher_probs)


@torch.no_grad()
def hard_chunk(h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, want_grad: bool,
               logits, compiled: bool = False):
    """h [c, H] rows of one slot k, labels [c]; coef [c] = w_k * announced / sum(w); logits(h): the
    draft's logits of the rows, h W^T (a plain head, whose W the gradient below multiplies by).
    Returns (ce [c] fp32, hits [c], dL/dh [c, H] or None). With z = h W^T and lse = logsumexp(z):
        ce = lse - z[y],     d ce / dz = softmax(z) - onehot(y)
    (hard_ce_rows, hard_ce_grad; `compiled`: through torch.compile on a GPU, one pass over the
    [c, V] logits each)."""
    rows_fn, grad_fn = (HARD_CE_ROWS, HARD_CE_GRAD) if compiled else (hard_ce_rows, hard_ce_grad)
    z = logits(h)  # [c, V]
    ce, hits, lse = rows_fn(z, labels)
    if not want_grad:
        return ce, hits, None
    return ce, hits, (grad_fn(z, labels, lse, coef, head.dtype) @ head).to(h.dtype)


def soft_chunk(h: torch.Tensor, head: torch.Tensor, teacher_h: torch.Tensor, weight: float, normaliser: torch.Tensor,
               announced: float, loss_kernel: str, want_grad: bool, logits, rows_ce: bool = False,
               token_loss: TokenLoss = TokenLoss(), compiled: bool = False):
    """h [c, H] rows of one slot k, teacher_h [c, H] the target's final states one position before
    (or their rows of a stored top-k teacher, TopKRows: its kept probabilities, renormalised for the
    CE, as they are for an LK loss);
    logits(h): the draft's logits of the rows, h W^T (a plain head).
    Returns (sum of the rows' ce (fp32 0-d), hits [c], dL/dh [c, H] or None) through the in-place
    soft-target CE (its row mask carries the weight w_k; normaliser = sum(w)). rows_ce (D-PACE):
    the rows' ce [c] fp32 instead of their sum, taken before the kernel consumes the logits (two
    more [c, V] fp32 temporaries). An LK `token_loss` takes the CE's place (kernels/lk_loss.py:
    the teacher here is the target's whole distribution, so alpha is the slot's acceptance rate),
    and its rows' losses, which the kernel stores, are rows_ce's values. compiled: the teacher's
    softmax through torch.compile on a GPU (teacher_probs; not with rows_ce and ce, which also
    hold p in fp32)."""
    with torch.no_grad():
        if isinstance(teacher_h, TopKRows):  # a stored top-k teacher: its kept mass, renormalised for the CE
            p32, target_ids = teacher_h.dense(head.shape[0], renormalise=token_loss.kind == "ce")
            p = p32.to(h.dtype)
        else:
            t = teacher_h @ head.T  # [c, V] the target's logits
            if rows_ce and token_loss.kind == "ce":  # ce below reads p in fp32; the kernel reads it in h's dtype
                p32 = torch.softmax(t.float(), dim=-1)
                p, target_ids = p32.to(h.dtype), p32.argmax(-1)
            else:
                p, target_ids = (TEACHER_PROBS if compiled else teacher_probs)(t, h.dtype)  # the target's distribution
    with torch.enable_grad():
        leaf = h.detach().requires_grad_(want_grad)
        z = logits(leaf)  # [c, V], consumed by the loss kernel
        hits = z.detach().argmax(-1) == target_ids  # before the kernel overwrites the logits
        if rows_ce and token_loss.kind == "ce":
            with torch.no_grad():
                ce = torch.log_softmax(z.detach().float(), dim=-1).mul_(p32).sum(-1).neg_()  # [c]
        rows = torch.full((len(h),), weight, device=h.device)
        if token_loss.kind != "ce":
            loss, _, row_losses = lk_loss(z, p, rows, normaliser, loss=token_loss.kind, kl_scale=token_loss.kl_scale,
                                          kl_decay=token_loss.kl_decay, impl=loss_kernel, grad_scale=announced,
                                          rows=True)
            grad = torch.autograd.grad(loss, leaf, torch.tensor(announced, device=h.device))[0] if want_grad else None
            return (row_losses / weight if rows_ce else loss.detach() * normaliser / weight), hits, grad
        loss = soft_target_cross_entropy(z, p, rows, normaliser=normaliser, impl=loss_kernel,
                                         grad_scale=announced)
        grad = torch.autograd.grad(loss, leaf, torch.tensor(announced, device=h.device))[0] if want_grad else None
    return (ce if rows_ce else loss.detach() * normaliser / weight), hits, grad


def scored_rows(states: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor):
    """The block states of the valid slots, grouped by slot k (k = 1 first).
    states [Bsz, N*B, H]; valid [Bsz, N, B-1]. Returns (rows [M, H], where: the rows' (k-1, row b,
    anchor index n), three [M], target position a + k [M], counts: rows per k, a list of B-1 ints)."""
    bsz, n, slots = valid.shape
    k_idx, b_idx, n_idx = torch.nonzero(valid.permute(2, 0, 1), as_tuple=True)  # sorted by k, then b, n
    counts = torch.bincount(k_idx, minlength=slots).tolist()  # the host needs the group sizes
    rows = states.view(bsz, n, slots + 1, -1)[b_idx, n_idx, k_idx + 1]  # [M, H]
    return rows, (k_idx, b_idx, n_idx), anchors[b_idx, n_idx] + k_idx + 1, counts


def chunked_loss(rows, head, counts, weights, targets, teacher: str, *, chunk: int, announced: float,
                 loss_kernel: str, want_grad: bool, logits, token_loss: TokenLoss = TokenLoss(),
                 compiled: bool = False):
    """loss = sum_k w_k sum_{rows of k} ce / sum_k w_k n_k, chunk by chunk within each slot k.
    rows: detached (the gradient is computed here, not recorded). targets: labels [M] (hard) or
    the teacher's final states [M, H] (soft). logits(h): the draft's logits of rows, a plain head's
    h W^T (the gradient below is that product's). Returns (loss fp32 0-d,
    dloss/drows [M, H] for the upstream gradient `announced` or None, per-k ce sums [B-1], per-k
    hits [B-1]). compiled: each chunk's [c, V] math through torch.compile on a GPU (hard_chunk's, or
    the soft teacher's softmax in soft_chunk; the draft's own elementwise switch,
    compiles_elementwise, decides it)."""
    device = rows.device
    norm = torch.tensor(max(sum(w * c for w, c in zip(weights, counts, strict=True)), 1e-6), device=device)
    grad = torch.zeros_like(rows) if want_grad else None
    ce_sums = torch.zeros(len(counts), dtype=torch.float32, device=device)
    hits = torch.zeros(len(counts), dtype=torch.int64, device=device)
    for k, s, e in slot_chunks(counts, chunk):
        w = weights[k]
        if teacher == "hard":
            coef = torch.full((e - s,), w * announced, device=device) / norm
            ce, hit, g = hard_chunk(rows[s:e], head, targets[s:e], coef, want_grad, logits, compiled)
            ce = ce.sum()
        else:
            ce, hit, g = soft_chunk(rows[s:e], head, targets[s:e], w, norm, announced, loss_kernel, want_grad, logits,
                                    token_loss=token_loss, compiled=compiled)
        ce_sums[k] += ce
        hits[k] += hit.sum()
        if g is not None:
            grad[s:e] = g
    weight_of = torch.tensor(weights, device=device)
    return (ce_sums * weight_of).sum() / norm, grad, ce_sums, hits


def dpace_chunked_loss(rows, head, counts, valid, where, alpha: float, targets, teacher: str, *, chunk: int,
                       announced: float, loss_kernel: str, want_grad: bool, logits,
                       token_loss: TokenLoss = TokenLoss(), compiled: bool = False):
    """chunked_loss with D-PACE's weights (module docstring): loss = sum w ce / sum w over the rows,
    w = dpace_weights of the rows' own ce (valid, where: dpace_weights'). Each chunk writes its
    gradient for a unit weight; once every row's ce is known, the gradient rows are scaled by
    w / sum(w). Returns chunked_loss's four values."""
    device = rows.device
    unit = torch.ones((), device=device)  # the soft kernel's normaliser for a unit weight
    grad = torch.zeros_like(rows) if want_grad else None
    ce = torch.zeros(len(rows), dtype=torch.float32, device=device)
    ce_sums = torch.zeros(len(counts), dtype=torch.float32, device=device)
    hits = torch.zeros(len(counts), dtype=torch.int64, device=device)
    for k, s, e in slot_chunks(counts, chunk):
        if teacher == "hard":
            coef = torch.full((e - s,), announced, device=device)
            ce[s:e], hit, g = hard_chunk(rows[s:e], head, targets[s:e], coef, want_grad, logits, compiled)
        else:
            ce[s:e], hit, g = soft_chunk(rows[s:e], head, targets[s:e], 1.0, unit, announced, loss_kernel, want_grad,
                                         logits, rows_ce=True, token_loss=token_loss, compiled=compiled)
        ce_sums[k] += ce[s:e].sum()
        hits[k] += hit.sum()
        if g is not None:
            grad[s:e] = g
    w = dpace_weights(ce, valid, where, alpha)
    norm = w.sum().clamp(min=TINY_SUM)
    if grad is not None:
        grad.mul_((w / norm).to(grad.dtype)[:, None])
    return (w * ce).sum() / norm, grad, ce_sums, hits


def chunk_ce(model: DFlashDraft, rows, head, slots, tokens, targets, teacher: str):
    """ce [c] fp32 and hits [c] of a chunk of rows through the draft's own head (autograd)."""
    z = model.block_logits(rows, head, slots, tokens).float()  # [c, V]
    if teacher == "hard":
        return F.cross_entropy(z, targets, reduction="none"), z.detach().argmax(-1) == targets
    if isinstance(targets, TopKRows):  # a stored top-k teacher's kept mass, renormalised
        p, top = targets.dense(head.shape[0])
    else:
        p = torch.softmax((targets @ head.T).float(), dim=-1)  # the target's distribution
        top = p.argmax(-1)
    return -(p * torch.log_softmax(z, dim=-1)).sum(-1), z.detach().argmax(-1) == top


def head_loss(model: DFlashDraft, rows, head, counts, weights, targets, teacher: str, *, chunk: int, slots, tokens):
    """chunked_loss's loss for a draft whose head has parameters (plain_head False), through autograd:
    each chunk's logits are recomputed in the backward (checkpoint), so the gradient reaches the
    head's parameters and the rows, and no chunk's [c, V] logits are kept. slots [M]: each row's
    slot k; tokens [M, B]: its block's true tokens. Returns (loss fp32 0-d, per-k ce sums, per-k hits)."""
    device = rows.device
    norm = max(sum(w * c for w, c in zip(weights, counts, strict=True)), 1e-6)
    total = torch.zeros((), dtype=torch.float32, device=device)
    ce_sums = torch.zeros(len(counts), dtype=torch.float32, device=device)
    hits = torch.zeros(len(counts), dtype=torch.int64, device=device)
    for k, s, e in slot_chunks(counts, chunk):
        ce, hit = checkpoint(chunk_ce, model, rows[s:e], head, slots[s:e], tokens[s:e], targets[s:e], teacher,
                             use_reentrant=False)
        total = total + weights[k] * ce.sum()
        ce_sums[k] += ce.detach().sum()
        hits[k] += hit.sum()
    return total / norm, ce_sums, hits


def dpace_head_loss(model: DFlashDraft, rows, head, counts, valid, where, alpha: float, targets, teacher: str, *,
                    chunk: int, slots, tokens):
    """head_loss with D-PACE's weights: the chunks' ce [c] (each with its checkpointed graph, no
    logits) are gathered, and the loss is sum w ce / sum w with w = dpace_weights of their values.
    Returns head_loss's three values."""
    device = rows.device
    ces = []
    ce_sums = torch.zeros(len(counts), dtype=torch.float32, device=device)
    hits = torch.zeros(len(counts), dtype=torch.int64, device=device)
    for k, s, e in slot_chunks(counts, chunk):
        ce, hit = checkpoint(chunk_ce, model, rows[s:e], head, slots[s:e], tokens[s:e], targets[s:e], teacher,
                             use_reentrant=False)
        ces.append(ce)
        ce_sums[k] += ce.detach().sum()
        hits[k] += hit.sum()
    ce = torch.cat(ces) if ces else torch.zeros(0, dtype=torch.float32, device=device)
    w = dpace_weights(ce.detach(), valid, where, alpha)
    return (w * ce).sum() / w.sum().clamp(min=TINY_SUM), ce_sums, hits


def block_tokens(input_ids: torch.Tensor, b_idx: torch.Tensor, target_pos: torch.Tensor, counts: list[int],
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [M] (each scored row's k) and tokens [M, B] (x_a..x_{a+B-1} of its block, the last
    position repeated past the row's end) of scored_rows' rows."""
    device = target_pos.device
    slots = torch.repeat_interleave(torch.arange(1, block_size, device=device), torch.tensor(counts, device=device))
    span = (target_pos - slots)[:, None] + torch.arange(block_size, device=device)  # [M, B]
    return slots, input_ids[b_idx[:, None], span.clamp(max=input_ids.shape[1] - 1)]


def lk_refusal(kind: str, teacher: str, plain_head: bool) -> str | None:
    """Why the DFlash loss cannot take LK token loss `kind` with this teacher and head, or None."""
    if teacher != "soft":
        return (f"--token-loss {kind} measures acceptance against the target's whole distribution: give --teacher "
                "soft (the target's lm_head over the captured final state)")
    if not plain_head:
        return f"--token-loss {kind}: this draft's head has parameters of its own; it trains with ce only"
    return None


def slot_targets(batch: Batch, teacher: str, b_idx: torch.Tensor, target_pos: torch.Tensor, dtype: torch.dtype):
    """What each scored row (its batch row b_idx, its token's position target_pos, [M] each) is trained
    towards: the token x_{a+k} (hard, [M]); else the target's distribution for it, from the final
    state at a+k-1 ([M, H], its lm_head applied chunk by chunk) or the top-k teacher stored in its
    place there (TopKRows)."""
    if teacher == "hard":
        return batch.input_ids[b_idx, target_pos]
    if batch.final_hidden is not None:
        return batch.final_hidden[b_idx, target_pos - 1].to(dtype)
    return TopKRows(batch.teacher_ids[b_idx, target_pos - 1], batch.teacher_probs[b_idx, target_pos - 1])


def dflash_loss(model: DFlashDraft, batch: Batch, lm_head: torch.Tensor, *, num_anchors: int = 512,
                gamma: float = 7.0, seed: int = 0, attention: str = "auto", loss_kernel: str = "auto",
                loss_scale: float = 1.0, teacher: str = "hard", label_chunk: int | None = None,
                objective: str = "dflash", dpace_alpha: float = 0.5, token_loss: TokenLoss = TokenLoss()):
    """Returns (total loss, per-slot metrics [{loss, hits, valid}] for k = 1..B-1).

    lm_head: [V, H] the target's (frozen). objective: "dflash", the slots weighted by the decay
    gamma, or "dpace", by D-PACE with the smoothing dpace_alpha (module docstring). seed: the run's
    seed; a sample's anchors are drawn with anchor_seed(seed, batch.epoch, its index). loss_kernel:
    the soft-target CE (auto, triton, reference; the hard CE is plain torch). loss_scale: the
    gradient that will flow into the total (1 / accumulation steps), announced so that each chunk
    writes its final gradient at once. label_chunk: logit rows per chunk ([label_chunk, V] fp32
    temporaries; by default teacher.logit_rows(V), 1024 rows at most). metrics: loss is the unweighted mean ce of slot k's valid rows; hits counts
    argmax matches with x_{a+k} (hard) or the target's argmax (soft)."""
    if teacher not in ("hard", "soft"):
        raise ValueError(f"unknown DFlash teacher {teacher!r}: choose hard or soft")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown DFlash objective {objective!r}: choose {' or '.join(OBJECTIVES)}")
    if not 0.0 <= dpace_alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in [0, 1], got {dpace_alpha}")
    if teacher == "soft" and batch.final_hidden is None and batch.teacher_ids is None:
        raise ValueError("the soft teacher reads the target's final hidden states or a stored top-k teacher; the "
                         "batch holds neither")
    if token_loss.kind != "ce" and (teacher != "soft" or not model.plain_head):
        raise ValueError(lk_refusal(token_loss.kind, teacher, model.plain_head))
    b = model.cfg.block_size
    anchors, keep = batch_anchors(batch, num_anchors, b, seed)
    ids, positions = block_inputs(batch.input_ids, anchors, b, model.cfg.mask_token_id)
    context = model.project_context(batch.aux_hidden)  # [Bsz, T, H]
    states = model.train_forward(context, ids, positions, anchors, keep, batch.lengths, attention)
    valid = valid_slots(batch, anchors, keep, b)
    rows, where, target_pos, counts = scored_rows(states, valid, anchors)
    b_idx = where[1]
    head = lm_head.to(rows.dtype)
    targets = slot_targets(batch, teacher, b_idx, target_pos, head.dtype)
    want_grad = torch.is_grad_enabled() and rows.requires_grad
    if want_grad:
        check_announced(loss_scale, "dflash_loss")
    chunk = label_chunk or logit_rows(head.shape[0])
    # the slots' weights: fixed per slot (dflash), or computed from the rows' own ce (dpace)
    weighting = (slot_weights(b, gamma),) if objective == "dflash" else (valid, where, dpace_alpha)
    if model.plain_head:
        loss_fn = chunked_loss if objective == "dflash" else dpace_chunked_loss
        value, grad, ce_sums, hits = loss_fn(rows.detach(), head, counts, *weighting, targets, teacher, chunk=chunk,
                                             announced=loss_scale, loss_kernel=loss_kernel, want_grad=want_grad,
                                             logits=lambda h: model.block_logits(h, head), token_loss=token_loss,
                                             compiled=compiles_elementwise(model))
        total = AttachGradient.apply(rows, value, grad, loss_scale) if want_grad else value
    else:
        slots, tokens = block_tokens(batch.input_ids, b_idx, target_pos, counts, b)
        loss_fn = head_loss if objective == "dflash" else dpace_head_loss
        total, ce_sums, hits = loss_fn(model, rows, head, counts, *weighting, targets, teacher, chunk=chunk,
                                       slots=slots, tokens=tokens)
    n_valid = torch.tensor(counts, device=rows.device)
    metrics = [{"loss": ce_sums[k] / max(counts[k], 1), "hits": hits[k], "valid": n_valid[k]}
               for k in range(b - 1)]
    return total, metrics


class DFlashModule(torch.nn.Module):
    """Wraps the draft so that the whole loss is one forward: DDP/FSDP wrappers see every parameter
    use inside their forward. The target's lm_head is a frozen buffer, not a parameter. On a GPU
    the draft's elementwise chains run compiled unless compile_elementwise is False."""

    def __init__(self, draft: DFlashDraft, lm_head: torch.Tensor, *, num_anchors: int = 512, gamma: float = 7.0,
                 seed: int = 0, teacher: str = "hard", label_chunk: int | None = None,
                 compile_elementwise: bool = True, objective: str = "dflash", dpace_alpha: float = 0.5,
                 token_loss: TokenLoss = TokenLoss()):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.options = dict(num_anchors=num_anchors, gamma=gamma, seed=seed, teacher=teacher,
                            label_chunk=label_chunk, objective=objective, dpace_alpha=dpace_alpha,
                            token_loss=token_loss)

    def forward(self, batch: Batch, attention: str = "auto", loss_kernel: str = "auto", loss_scale: float = 1.0):
        return dflash_loss(self.draft, batch, self.lm_head, attention=attention, loss_kernel=loss_kernel,
                           loss_scale=loss_scale, **self.options)
