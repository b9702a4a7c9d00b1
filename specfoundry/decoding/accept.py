"""The acceptance rules: which of a round's drafted tokens the target keeps, and its own token after them.

Greedy: the longest prefix of drafts equal to the target's argmax at the row before each. Sampling
(Leviathan et al. 2023): draft d_j, proposed with probability q_j(d_j), is kept with probability
min(1, p_j(d_j) / q_j(d_j)); the first rejection samples from norm(max(0, p_j - q_j)), so the output
is distributed as the target's own samples. After a accepted drafts the target adds its own token
(from row a: the "bonus"), so a round yields a+1 tokens.
"""

from __future__ import annotations

import torch

from specfoundry.decoding.sampler import Sampler


def greedy_prefix(drafts: list[int], choice: list[int]) -> tuple[int, int]:
    """(a, choice[a]): a = how many drafts lead `choice` (the target's argmax per row, len(drafts)+1
    rows, row r predicting the token after input r), and the target's own token after them."""
    a = 0
    while a < len(drafts) and drafts[a] == choice[a]:
        a += 1
    return a, choice[a]


def accept(drafts: list[int], draft_logits: list[torch.Tensor], target_logits: torch.Tensor,
           draft_to_target: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Verify k drafts proposed from the draft's distributions (logits [Vd] over a draft vocabulary
    whose ids map to the target's through draft_to_target [Vd]) against target_logits [k+1, V].
    Returns (accepted count a, the target's own token after them)."""
    if sampler.greedy:
        return greedy_prefix(drafts, target_logits.argmax(-1).tolist())
    return reject(drafts, lambda j: (draft_to_target, sampler.probs(draft_logits[j])), target_logits, sampler)


def accept_candidates(drafts: list[int], candidates: torch.Tensor, draft_probs: torch.Tensor,
                      target_logits: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Verify k drafts each drawn from a distribution supported on K candidates (a selector's:
    q_j = draft_probs [k, K] over the target ids candidates [k, K], the one d_j was drawn from)
    against target_logits [k+1, V]: d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)), a
    rejection samples from norm(max(0, p_j - q_j)), q_j scattered onto its candidates. Returns
    (accepted count a, the target's own token after them)."""
    if sampler.greedy:
        return greedy_prefix(drafts, target_logits.argmax(-1).tolist())
    return reject(drafts, lambda j: (candidates[j], draft_probs[j]), target_logits, sampler)


def reject(drafts: list[int], proposal, target_logits: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """The rejection rule over drafts whose j-th was drawn from the distribution proposal(j) = (target
    ids [n], their probabilities [n]) (zero elsewhere), against target_logits [k+1, V]."""
    for j, d in enumerate(drafts):
        p = sampler.probs(target_logits[j])  # [V]
        ids, probs = proposal(j)
        q = torch.zeros_like(p)
        q[ids] = probs.to(p.dtype)  # the draft's distribution over target ids
        u = torch.rand((), generator=sampler.generator, device=p.device)
        if u * q[d] < p[d]:  # accept with probability min(1, p/q)
            continue
        residual = (p - q).clamp(min=0)
        return j, sampler.sample(residual / residual.sum())
    return len(drafts), sampler.sample(sampler.probs(target_logits[-1]))


def accept_point_mass(drafts: list[int], target_logits: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Verify proposals that are point masses (q = 1 at d_j: a block's argmax) against target_logits
    [k+1, V]: d_j is kept with probability p_j(d_j), a rejection samples from p_j without d_j
    (renormalised), which is max(0, p_j - q_j). Returns (accepted count a, the target's token after them)."""
    if sampler.greedy:
        return greedy_prefix(drafts, target_logits.argmax(-1).tolist())
    for j, d in enumerate(drafts):
        p = sampler.probs(target_logits[j])  # [V]
        if torch.rand((), generator=sampler.generator, device=p.device) < p[d]:
            continue
        residual = p.clone()
        residual[d] = 0  # max(0, p - q) with q the point mass at d
        return j, sampler.sample(residual / residual.sum())
    return len(drafts), sampler.sample(sampler.probs(target_logits[-1]))
