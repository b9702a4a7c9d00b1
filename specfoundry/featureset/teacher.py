"""The top-K teacher a feature set may store instead of the final state (sf-capture --teacher-storage topk:K).

The final state f_t (H values a token) is stored only to form the teacher, softmax(f_t W^T) over
the target's vocabulary (W the lm_head [V, H]). A set of `teacher: {"kind": "topk", "k": K}` stores
in its place, per token, the K most probable next tokens and their probabilities:
    teacher_ids    int32   [N, K]   the top K target ids, most probable first
    teacher_probs  float16 [N, K]   their probabilities under the full-vocabulary softmax
6K bytes a token (K = 32: 192) against H * 2 for a bf16 final state (8,192 at H = 4096). The mass
outside the K, 1 - sum(teacher_probs), is what the kept teacher lacks; the capture records its
mean and its lowest per-mille in the manifest (ModelOpt warns below 0.999 for its sparse teacher).
float16 holds a probability to 2^-11 of itself (2^-25 absolute below 2^-14), far below what
training resolves. Reading it back as a draft-vocabulary distribution is families/teacher.py's.
"""

from __future__ import annotations

import torch

LOGIT_BUDGET = 1 << 26
"""Logits one chunk of rows may hold over the full vocabulary: 64 Mi values, 256 MiB in fp32."""


def logit_rows(vocab_size: int, most: int = 1024) -> int:
    """Rows per chunk of full-vocabulary logits: `most`, fewer where the vocabulary is large, so a
    chunk's [rows, V] fp32 logits stay within LOGIT_BUDGET (1024 rows up to V = 65,536; 441 for
    Qwen3's 151,936, 256 for Gemma-3's 262,144). The capture's top K and training's teachers and
    losses (families/teacher.py) chunk by it."""
    return max(1, min(most, LOGIT_BUDGET // vocab_size))

MAX_K = 1024


def parse_teacher(value) -> int | None:
    """--teacher-storage: 'final' (the final state: None) or 'topk:K' (K in 1..MAX_K) -> K; ValueError naming
    the value otherwise."""
    text = str(value).strip()
    if text == "final":
        return None
    kind, _, k = text.partition(":")
    if kind == "topk" and k.isdigit() and 1 <= int(k) <= MAX_K:
        return int(k)
    raise ValueError(f"--teacher-storage {text!r}: give 'final' (the final state) or 'topk:K' with K from 1 to {MAX_K}")


@torch.no_grad()
def topk_teacher(final: torch.Tensor, lm_head: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """final [N, H] (the final normed states), lm_head [V, H] -> (ids int32 [N, K], probs float16 [N, K]),
    most probable first, on final's device; in chunks of rows whose [rows, V] fp32 logits stay
    within LOGIT_BUDGET."""
    n, rows = final.shape[0], logit_rows(lm_head.shape[0])
    head = lm_head.to(final.device, final.dtype)
    ids = torch.empty(n, k, dtype=torch.int32, device=final.device)
    probs = torch.empty(n, k, dtype=torch.float16, device=final.device)
    for start in range(0, n, rows):
        logits = (final[start : start + rows] @ head.T).float()  # [c, V]
        top, where = torch.topk(logits, k, dim=-1)  # [c, K] sorted, most probable first
        # p = exp(z - logsumexp(z)): the full-vocabulary softmax at the K, no [c, V] softmax written
        probs[start : start + rows] = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)).half()
        ids[start : start + rows] = where.int()
    return ids, probs
