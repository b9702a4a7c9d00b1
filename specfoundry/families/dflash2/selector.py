"""DFlash2's candidate selector, as the engines run it (z-lab's CandidateSelector, SpecForge's and
SGLang's build_lattice, vLLM's _score_edges). Pure math.

Slot t (1 <= t < B) of a block has the final-normed state h_t, the unary logits l_t = h_t W^T of
the target's lm_head W, and its candidates C_t = topk(l_t, K). With A = predecessor_codebook [V, r],
S = successor_codebook [V, r] and P = hidden_projection [r, H] (no biases),
    score_t(p -> c) = l_t[c] + < A[p] * (P h_t), S[c] >          c in C_t
the predecessor p of slot 1 being the anchor (the bonus token), of slot t the token chosen at
slot t-1. Greedy decoding walks x_t = argmax_c score_t(x_{t-1} -> c), t = 1..B-1: one coherent path.
The engines compute every slot's K x K edges at once (the lattice: slot 1's rows all read the
anchor, slot t's the K candidates of slot t-1) and then walk it; training scores the candidates
after the true previous token (teacher forcing). S starts at zero (SpecForge's initialisation), so
a fresh selector ranks by the unary logits alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

INIT_STD = 0.02
"""The normal initialisation's spread of the selector's other weights (the Qwen3 configs'
initializer_range, which SpecForge's draft uses)."""


class CandidateSelector(nn.Module):
    """hidden_projection [r, H], predecessor_codebook [V, r], successor_codebook [V, r]: raw
    parameters, named as the checkpoints name them (no `.weight` on the codebooks)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=INIT_STD)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank).normal_(std=INIT_STD))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary [..., K], ids [..., K]): the top K of logits [..., V], highest first."""
        return torch.topk(logits, self.top_k, dim=-1)

    def score(self, unary: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
              predecessors: torch.Tensor) -> torch.Tensor:
        """score(p -> c) [R, K] fp32 of rows with unary logits [R, K] at candidates ids [R, K], states
        hidden [R, H] and one predecessor each [R]."""
        g = self.hidden_projection(hidden) * self.predecessor_codebook[predecessors].to(hidden.dtype)  # [R, r]
        edges = torch.einsum("nr,nkr->nk", g.float(), self.successor_codebook[ids].float())  # [R, K]
        return unary.float() + edges

    def lattice(self, unary: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        """Every slot's edges at once: [L, K (predecessor), K (candidate)] fp32 for L slots' unary
        logits and candidates [L, K], states [L, H] and the anchor [1]: row p of slot 0 is the
        anchor's (every row), of slot t the t-1'th slot's candidate p."""
        k = ids.shape[1]
        predecessors = torch.cat([anchor.view(1, 1).expand(1, k), ids[:-1]])  # [L, K]
        g = self.hidden_projection(hidden)[:, None] * self.predecessor_codebook[predecessors].to(hidden.dtype)
        edges = torch.einsum("lpr,lcr->lpc", g.float(), self.successor_codebook[ids].float())  # [L, K, K]
        return unary.float()[:, None, :] + edges


def walk(lattice: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor):
    """The path through lattice [L, K, K], slot by slot, on the device alone (no host read: a
    captured step). temperature [] (0: greedy), uniforms [L] in [0, 1) (sampling's draws).
    Each slot's row is the realised one, its scores given the predecessor chosen before it; the slot
    picks argmax (greedy) or a draw from q = softmax(row / T) by inverse CDF (one graph serves
    both, as SGLang's sampler; T clamped as SGLang clamps it). Returns (choices [L] into each
    slot's candidates, q [L, K] the distribution each was drawn from (one-hot under greedy), the
    realised rows [L, K])."""
    k = lattice.shape[-1]
    sampled = temperature > 0
    t = temperature.clamp(min=1e-5)
    index = torch.zeros(1, dtype=torch.long, device=lattice.device)  # slot 0's rows all read the anchor
    slots = torch.arange(k, device=lattice.device)
    choices, dists, rows = [], [], []
    for slot in range(lattice.shape[0]):
        row = lattice[slot].index_select(0, index)[0]  # [K]
        q = torch.softmax(row / t, dim=-1)
        cdf = torch.cumsum(q, dim=0)
        # the first index whose cdf passes u: a candidate of zero probability is never drawn
        drawn = (cdf <= uniforms[slot] * cdf[-1]).sum().clamp(max=k - 1)
        best = row.argmax()
        choice = torch.where(sampled, drawn, best)
        onehot = (slots == best).to(q.dtype)  # (a comparison: one_hot checks its input on the host)
        choices.append(choice)
        dists.append(torch.where(sampled, q, onehot))
        rows.append(row)
        index = choice.view(1)
    return torch.stack(choices), torch.stack(dists), torch.stack(rows)
