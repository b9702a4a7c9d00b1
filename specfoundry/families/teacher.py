"""The teacher: the frozen target lm_head applied to the stored final hidden states, or the top-k
teacher a feature set stores in their place (featureset/teacher.py).

The target distribution is restricted to the draft vocabulary; positions whose full-vocabulary
argmax falls outside it are masked (SGLang could never accept such a draft token there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.featureset.teacher import logit_rows  # the capture's top K chunks by it too

__all__ = ["TopKRows", "batch_teacher", "kept_distribution", "logit_rows", "sparse_teacher_targets", "teacher_targets"]


@torch.no_grad()
def teacher_targets(final_hidden: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor,
                    t2d: torch.Tensor, chunk: int | None = None, out_dtype: torch.dtype = torch.float32,
                    renormalise: bool = True):
    """final_hidden: [N, H]; lm_head: [V, H]; draft_ids: [Vd] sorted target ids.

    Returns p [N, Vd] (softmax over the draft-vocabulary columns of the target logits; with
    `renormalise` False, those columns of the softmax over the whole vocabulary, whose rows sum to
    the teacher's mass inside the draft vocabulary: what the LK losses take),
    valid [N] bool (full-vocab argmax is in the draft vocabulary) and target_draft [N] (that
    argmax as a draft id, -1 where invalid). Chunked over rows (`chunk`, by default logit_rows(V)):
    no [N, V] tensor is kept; the peak is one chunk's logits, in the head's dtype and in fp32."""
    n = final_hidden.shape[0]
    chunk = chunk or logit_rows(lm_head.shape[0])
    p = torch.empty(n, len(draft_ids), dtype=out_dtype, device=final_hidden.device)
    valid = torch.empty(n, dtype=torch.bool, device=final_hidden.device)
    target_draft = torch.empty(n, dtype=torch.int64, device=final_hidden.device)
    # target id -> draft id (or -1)
    t2d_index = torch.full((lm_head.shape[0],), -1, dtype=torch.int64, device=final_hidden.device)
    t2d_index[draft_ids] = torch.arange(len(draft_ids), device=final_hidden.device)
    head = lm_head.to(final_hidden.dtype)
    for start in range(0, n, chunk):
        h = final_hidden[start : start + chunk]
        logits = (h @ head.T).float()  # [c, V], dropped after this chunk
        top = logits.argmax(-1)
        valid[start : start + chunk] = t2d[top]
        target_draft[start : start + chunk] = t2d_index[top]
        if renormalise:
            p[start : start + chunk] = torch.softmax(logits[:, draft_ids], dim=-1).to(out_dtype)
        else:  # exp(z_v - logsumexp(z)) of the draft columns: no [c, V] softmax written
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [c, 1]
            p[start : start + chunk] = torch.exp(logits[:, draft_ids] - lse).to(out_dtype)
    return p, valid, target_draft


@torch.no_grad()
def sparse_teacher_targets(ids: torch.Tensor, probs: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                           vocab_size: int, out_dtype: torch.dtype = torch.float32, renormalise: bool = True):
    """teacher_targets from a stored top-k teacher: ids [N, k] target ids (most probable first), probs
    [N, k] their full-vocabulary probabilities; draft_ids [Vd] sorted target ids; vocab_size V.

    p [N, Vd] holds the kept probabilities of the draft tokens among the k, zero elsewhere: with
    `renormalise`, divided by their sum (the dense teacher's softmax over the draft columns, on the
    kept mass: equal to it where the k hold every draft token with mass); else as they are, so a row
    sums to the kept mass inside the draft vocabulary and the mass the k left out counts as the LK
    losses count the mass outside the draft vocabulary. valid and target_draft from ids[:, 0], the
    teacher's argmax, as teacher_targets takes them from the full logits."""
    device = ids.device
    t2d_index = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
    t2d_index[draft_ids] = torch.arange(len(draft_ids), device=device)
    ids = ids.long()
    column = t2d_index[ids]  # [N, k]: the draft column of each kept id, -1 outside the draft vocabulary
    p = kept_distribution(column, probs, len(draft_ids), renormalise)  # [N, Vd]
    top = ids[:, 0]
    return p.to(out_dtype), t2d[top], t2d_index[top]


def kept_distribution(columns: torch.Tensor, probs: torch.Tensor, width: int, renormalise: bool) -> torch.Tensor:
    """p [N, width] fp32: the kept probabilities probs [N, k] at their columns [N, k] (a column below 0
    drops its probability), zero elsewhere; with `renormalise` divided by their sum (a row without
    mass stays 0)."""
    p = torch.zeros(columns.shape[0], width, dtype=torch.float32, device=columns.device)
    p.scatter_add_(1, columns.clamp(min=0), torch.where(columns >= 0, probs.float(), 0.0))
    if renormalise:
        p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return p


def batch_teacher(batch, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk: int | None = None,
                  renormalise: bool = True):
    """teacher_targets over every position of a Batch ([B*T] rows): from its final state through the
    lm_head, or from the top-k teacher its feature set stores instead; in the states' dtype."""
    if batch.final_hidden is not None:
        h = batch.final_hidden.shape[-1]
        return teacher_targets(batch.final_hidden.reshape(-1, h), lm_head, draft_ids, t2d, chunk=chunk,
                               out_dtype=batch.final_hidden.dtype, renormalise=renormalise)
    if batch.teacher_ids is None:
        raise ValueError("the batch holds neither the final state nor a top-k teacher")
    k = batch.teacher_ids.shape[-1]
    return sparse_teacher_targets(batch.teacher_ids.reshape(-1, k), batch.teacher_probs.reshape(-1, k), draft_ids, t2d,
                                  lm_head.shape[0], out_dtype=batch.aux_hidden.dtype, renormalise=renormalise)


@dataclass(frozen=True)
class TopKRows:
    """Rows of a stored top-k teacher standing where rows of final states would (a full-vocabulary
    draft's soft teacher: DFlash's): ids [M, k] target ids, most probable first, and probs [M, k]
    their probabilities over the full vocabulary. Sliced as the states' rows are."""

    ids: torch.Tensor
    probs: torch.Tensor

    def __getitem__(self, index) -> TopKRows:
        return TopKRows(self.ids[index], self.probs[index])

    def __len__(self) -> int:
        return self.ids.shape[0]

    @torch.no_grad()
    def dense(self, vocab_size: int, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(p [c, V] fp32, the teacher's token [c]): the kept probabilities at their ids, zero elsewhere;
        with `renormalise` divided by their sum (the dense teacher on the kept mass, equal to it where
        the k hold every token with mass), else as they are (the mass the k left out counted as the
        LK losses count mass outside a draft vocabulary). The teacher's token is ids[:, 0], its argmax."""
        ids = self.ids.long()
        return kept_distribution(ids, self.probs, vocab_size, renormalise), ids[:, 0]
