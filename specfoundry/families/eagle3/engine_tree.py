"""The engines' draft tree (SGLang's EAGLE worker, EAGLE-2's dynamic tree): which nodes a server that
runs an EAGLE-3 draft with `--speculative-num-steps S --speculative-eagle-topk K
--speculative-num-draft-tokens N` drafts and verifies, as tensor functions on the device.

SGLang's algorithm (python/sglang/srt/speculative: eagle_worker.py draft_forward, spec_utils.py
select_top_k_tokens, eagle_utils.py organize_draft_results and build_tree_kernel_efficient):
    scores        a node's score is the product of the draft's probabilities (a softmax of its logits
                  over the draft vocabulary, no temperature) along its path from the root
    step 0        the root's K most probable tokens: the pool's first K nodes and the frontier
    step i < S    one draft forward over the K frontier nodes (depth i); each one's K most probable
                  children enter the pool (K^2 nodes, frontier-major: node K + K^2 (i-1) + f K + c),
                  and the K best of them by score become the next frontier
    selection     the N - 1 best scores of the pool's K + (S - 1) K^2 nodes, taken in pool order
                  (ascending index: breadth first by step, not by score); the verify reads the root
                  then them, N tokens. A node's parent is the root for step 0, else the frontier node
                  it was expanded from, always selected before it (a child's score is at most its
                  parent's, and ties go to the lower index)
    ties          the lowest pool index first (CUDA's torch.topk picks so; CPU torch does not, so
                  the functions here sort stably instead of calling topk)
The tree is at most S deep; K = 1 is a chain of S tokens (SGLang then forces N = S + 1). Greedy
acceptance walks each node's children in ascending order (decoding/tree.py accept_tree).
"""

from __future__ import annotations

import torch

from specfoundry.decoding.cache import visible
from specfoundry.decoding.tree import EngineTree


def best(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dimension, highest first, ties to the lowest
    index (a stable sort: torch.topk's choice among ties differs between CPU and CUDA)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The draft's next-token probabilities from its logits [..., Vd], as SGLang takes them: fp32 softmax."""
    return torch.softmax(logits.float(), dim=-1)


def first_step(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The root's children: (scores [K] fp32, draft ids [K]) from the draft's probabilities [Vd] there."""
    return best(probs, k)


def later_step(frontier_scores: torch.Tensor, probs: torch.Tensor, k: int):
    """One expansion (select_top_k_tokens): the frontier's scores [K] and each frontier node's draft
    probabilities [K, Vd] -> (the pool's new block: scores [K*K], draft ids [K*K], the frontier slot
    each was expanded from [K*K]; the next frontier: its indices into the block [K])."""
    child_scores, child_ids = best(probs, k)  # [K, K] each
    block = (frontier_scores[:, None] * child_scores).reshape(-1)  # [K*K] frontier-major
    slots = torch.arange(frontier_scores.shape[0], device=probs.device).repeat_interleave(k)  # [K*K]
    return block, child_ids.reshape(-1), slots, best(block, k)[1]


def select(pool_scores: torch.Tensor, pool_parents: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified tree (organize_draft_results): pool scores [P] and each node's parent in the pool
    [P] (-1: the root) -> (the selected pool nodes [n-1], ascending; each one's parent as a tree node
    [n-1]: 0 the root, j the j-th selected)."""
    chosen = torch.sort(best(pool_scores, n - 1)[1]).values  # [n-1]
    node_of = torch.zeros_like(pool_parents)  # [P] pool index -> tree node (0 where not selected)
    node_of[chosen] = torch.arange(1, n, device=pool_scores.device)
    parents = pool_parents[chosen]  # [n-1]
    return chosen, torch.where(parents < 0, torch.zeros_like(parents), node_of[parents.clamp(min=0)])


def grow(root_probs: torch.Tensor, expand, shape: EngineTree) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's policy over a draft given by its probabilities at the root [Vd] and `expand(i, ids,
    came_from)`, the probabilities [K, Vd] after each frontier node of depth i (draft ids [K]; came_from
    [K], the previous frontier's slot each grows from, None at depth 1: the root): (draft ids [N-1] of
    the selected pool nodes, their parents [N-1] as tree nodes). On the device alone where `expand` is."""
    k = shape.topk
    scores, ids = first_step(root_probs, k)  # [K] the frontier's (depth 1)
    pool_scores, pool_ids, pool_parents = [scores], [ids], [torch.full((k,), -1, device=ids.device)]
    at, came_from = torch.arange(k, device=ids.device), None  # the frontier's pool indices [K]
    for i in range(1, shape.num_steps):
        block, block_ids, parent_slot, nxt = later_step(scores, expand(i, ids, came_from), k)
        pool_scores.append(block)
        pool_ids.append(block_ids)
        pool_parents.append(at[parent_slot])
        came_from = parent_slot[nxt]  # [K] the frontier slot each next frontier node grows from
        scores, ids, at = block[nxt], block_ids[nxt], k + (i - 1) * k * k + nxt
    chosen, parents = select(torch.cat(pool_scores), torch.cat(pool_parents), shape.num_draft_tokens)
    return torch.cat(pool_ids)[chosen], parents


def tree_from_distributions(dist, shape: EngineTree) -> tuple[list[int], list[int]]:
    """The tree SGLang drafts where the draft's probabilities after each path are `dist(path)` ([Vd]
    fp32, path a tuple of draft ids from the root): (draft ids of the N-1 selected nodes, their parents as
    tree nodes). grow, as the decoder's device step runs it, with the paths read node by node (tests)."""
    paths: list[tuple[int, ...]] = []  # the frontier's

    def expand(i, ids, came_from):
        nonlocal paths
        if came_from is None:
            paths = [(int(t),) for t in ids]
        else:
            paths = [paths[int(c)] + (int(t),) for c, t in zip(came_from, ids, strict=True)]
        return torch.stack([dist(p) for p in paths])  # [K, Vd]

    ids, parents = grow(dist(()), expand, shape)
    return ids.tolist(), parents.tolist()


def expand_body(draft, shape: EngineTree):
    """The engines' tree drafted from the draft's committed state on the device alone (`draft`:
    chain.py's DraftRunner; captured per EngineTree, chain.py DraftRunner.engine_trees): returns
    (target ids [N-1], parents [N-1] as tree nodes, 0 the root). Step i's frontier (depth i) is one
    draft forward of K rows: row j's entry at column base + (i-1) K + j, position base + i - 1
    (training's step i), its parent's next-step state as hidden input, seeing the committed entries,
    its ancestors' entries and its own."""
    dev, k = draft.device, shape.topk
    slots = torch.arange(k, device=dev)  # [K]
    columns = max((shape.num_steps - 1) * k, 1)  # this round's entries: depths 1..S-1, K each
    # the value the ancestors' mask is set to, on the device: a Python True would be copied from the
    # host inside the body, which a CUDA graph's capture refuses
    true = torch.ones((), dtype=torch.bool, device=dev)

    def body():
        pre = draft.pre.expand(1, k, -1)  # [1, K, H] the hidden inputs: the root's state, then each forward's
        sees = torch.zeros(k, columns, dtype=torch.bool, device=dev)  # [K, W] ancestors' columns

        def expand(i, ids, came_from):
            nonlocal pre, sees
            if came_from is not None:  # each node's parent's output state and ancestors
                pre, sees = pre[:, came_from], sees[came_from]
            own = (i - 1) * k + slots  # [K] the frontier's columns from base
            sees.index_put_((slots, own), true)
            draft.cache.columns = draft.base + own
            positions = (draft.base + (i - 1)).expand(1, k)  # [1, K]
            allowed = visible(draft.kv_index, draft.base, sees)  # [K, C]
            pre, normed = draft.draft.decode_forward(draft.draft_to_target[ids][None], pre, positions, draft.cache,
                                                     allowed[None, None])
            return probabilities(draft.draft.lm_head(normed)[0])  # [K, Vd]

        ids, parents = grow(probabilities(draft.logits), expand, shape)
        return draft.draft_to_target[ids], parents

    return body
