"""The draft vocabulary: the most frequent loss-masked target tokens, and its d2t / t2d maps.

    draft_ids = sorted(top-k target ids by count)      [Vd]
    d2t[i]    = draft_ids[i] - i   (so target id = draft id + d2t[draft id], SGLang's convention)
    t2d[t]    = True iff target id t is in the draft vocabulary          [V] bool
"""

from __future__ import annotations

import torch


def choose_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids, sorted. If fewer than `size` ids were ever seen, the rest
    is filled with the lowest unseen ids (deterministic, never a crash)."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocab size {size} must be between 1 and the target vocab size {vocab}")
    # stable sort on (-count, id): ties resolved by the lower id
    order = torch.argsort(-counts.to(torch.int64), stable=True)
    return torch.sort(order[:size]).values


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t.to(torch.int64), t2d


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(len(d2t), device=d2t.device)


def vocab_coverage(t2d: torch.Tensor, counts: torch.Tensor) -> float:
    """The share of counts [V] (the feature set's supervised tokens) on the ids t2d [V] marks as the
    draft's vocabulary: what a draft of that vocabulary can learn to propose."""
    counts = counts.to(torch.float64)
    return float(counts[t2d.cpu()].sum() / counts.sum().clamp(min=1))
