"""The teacher: the frozen target lm_head applied to the stored final hidden states.

The target distribution is restricted to the draft vocabulary; positions whose full-vocabulary
argmax falls outside it are masked (SGLang could never accept such a draft token there).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def teacher_targets(final_hidden: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor,
                    t2d: torch.Tensor, chunk: int = 1024, out_dtype: torch.dtype = torch.float32):
    """final_hidden: [N, H]; lm_head: [V, H]; draft_ids: [Vd] sorted target ids.

    Returns p [N, Vd] (softmax over the draft-vocabulary columns of the target logits),
    valid [N] bool (full-vocab argmax is in the draft vocabulary) and target_draft [N] (that
    argmax as a draft id, -1 where invalid). Chunked over rows: no [N, V] tensor is kept."""
    n = final_hidden.shape[0]
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
        p[start : start + chunk] = torch.softmax(logits[:, draft_ids], dim=-1).to(out_dtype)
    return p, valid, target_draft
