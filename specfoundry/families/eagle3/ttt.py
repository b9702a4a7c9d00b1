"""Training-Time Test: k draft steps unrolled in one forward, each on the previous one's output.

A TTT step s (0 <= s < ttt_length) is one draft step inside this forward; an optimizer step
(the trainer's) is one update, over grad_accum micro-batches. With target tokens x_0..x_{n-1},
its final hidden states h_j (h_j predicts x_{j+1}) and aux features a_j, the draft at TTT step s
and index i:
    token input   x_{i+1+s}
    hidden input  fc(a_i) at s = 0, else the state the draft passes on at step s-1 at i (its
                  pre-norm state; its normed state under the EAGLE-3.1 option norm_output)
    position      i + s
    teacher       p(h_{i+1+s}) restricted to the draft vocab (it predicts x_{i+2+s})
    valid         x_{i+2+s} is an assistant token, i+2+s < n, teacher argmax in the draft vocab
Keys of every step stay in the cache; the tree mask lets (s, i) see the prefix j <= i of step 0
and its own branch (t, i) for t < s. loss = sum_s 0.8^s * loss_s, each the mean over valid
positions of the token loss: the soft-target CE, or an LK loss on the acceptance rate
(kernels/lk_loss.py, sf-train --token-loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specfoundry.families.eagle3.model import Eagle3Draft, TTTCache
from specfoundry.families.teacher import batch_teacher
from specfoundry.families.vocab import draft_ids_from_d2t
from specfoundry.featureset.batch import Batch
from specfoundry.kernels.lk_loss import TokenLoss


def shift(x: torch.Tensor, by: int, width: int) -> torch.Tensor:
    """x[:, by : by + width] along dim 1, zero-padded past the end."""
    out = x[:, by : by + width]
    if out.shape[1] < width:
        pad = [0, 0] * (x.dim() - 2) + [0, width - out.shape[1]]
        out = F.pad(out, pad)
    return out


def ttt_loss(model: Eagle3Draft, batch: Batch, lm_head: torch.Tensor, draft_ids: torch.Tensor, *,
             ttt_length: int = 7, decay: float = 0.8, attention: str = "auto", loss_kernel: str = "auto",
             teacher_chunk: int | None = None, loss_scale: float = 1.0, token_loss: TokenLoss = TokenLoss()):
    """Returns (total loss, per-TTT-step metrics [{loss, hits, valid}]). loss_kernel: which
    kernel of the token loss runs (auto, triton or reference). loss_scale: the gradient that will
    flow into the total (1 / accumulation steps under Accelerate), so the in-place loss kernel
    writes each TTT step's final gradient during the forward."""
    bsz, seq = batch.input_ids.shape
    p_all, ok_all, tgt_all = batch_teacher(batch, lm_head, draft_ids, model.t2d, chunk=teacher_chunk,
                                           renormalise=token_loss.renormalised_teacher)
    vd = p_all.shape[-1]
    p_all = p_all.view(bsz, seq, vd)
    ok_all, tgt_all = ok_all.view(bsz, seq), tgt_all.view(bsz, seq)
    lengths = torch.tensor(batch.lengths, device=batch.input_ids.device)
    index = torch.arange(seq, device=batch.input_ids.device)
    hidden = model.project(batch.aux_hidden)  # [B, T, H]
    cache = TTTCache()  # the earlier TTT steps' keys and values, the q/k/v weight concatenated once
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    metrics = []
    for s in range(ttt_length):  # s: the TTT step
        ids = shift(batch.input_ids, 1 + s, seq)
        positions = (index + s).expand(bsz, seq)
        hidden, normed = model.ttt_forward(ids, hidden, positions, cache, batch.lengths, s, attention)
        rows = seq - 1 - s  # rows i with a teacher at i+1+s; the rest are never valid
        if rows <= 0:
            break
        valid = (shift(batch.loss_mask, 2 + s, rows) & ok_all[:, 1 + s :]
                 & (index[:rows] + 2 + s < lengths[:, None]))  # [B, rows]
        logits = model.lm_head(normed[:, :rows])  # [B, rows, Vd], consumed by the loss
        target_p = p_all[:, 1 + s :]
        n_valid = valid.sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == tgt_all[:, 1 + s :]) & valid
        weight = decay ** s
        # a TTT step of weight 0 (--loss-decay 0 past step 0) teaches nothing: its loss is a metric only
        with torch.set_grad_enabled(torch.is_grad_enabled() and weight > 0):
            loss_s = token_loss(logits.reshape(-1, vd), target_p.reshape(-1, vd), valid.reshape(-1),
                                normaliser=n_valid.clamp(min=1).float(), impl=loss_kernel,
                                grad_scale=weight * loss_scale)
        total = total + weight * loss_s
        metrics.append({"loss": loss_s.detach(), "hits": hit.sum(), "valid": n_valid})
    return total, metrics


class TTTModule(torch.nn.Module):
    """Wraps the draft so that the whole TTT unroll is one forward: DDP/FSDP wrappers see every
    parameter use inside their forward. The teacher head is a frozen buffer, not a parameter.
    On a GPU the draft's elementwise chains run compiled unless compile_elementwise is False.
    ttt_length and decay are the defaults of every forward; a call may override them."""

    def __init__(self, draft: Eagle3Draft, lm_head: torch.Tensor, compile_elementwise: bool = True,
                 ttt_length: int = 7, decay: float = 0.8, token_loss: TokenLoss = TokenLoss()):
        super().__init__()
        self.draft = draft.compile_elementwise(compile_elementwise)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.ttt_length, self.decay, self.token_loss = ttt_length, decay, token_loss

    def forward(self, batch: Batch, **kw):
        kw = {"ttt_length": self.ttt_length, "decay": self.decay, "token_loss": self.token_loss, **kw}
        return ttt_loss(self.draft, batch, self.lm_head, draft_ids_from_d2t(self.draft.d2t), **kw)
