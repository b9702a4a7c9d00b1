"""EAGLE-3's tree drafting (greedy): the draft proposes a token tree (decoding/tree.py), the target
verifies all of it in one forward, and the longest branch the target agrees with is accepted.

The tree has a fixed branching per depth, e.g. (4, 2, 2, 1): the 4 most likely first tokens,
the 2 most likely continuations of each, and so on (4 + 8 + 16 + 16 = 44 nodes, depth 4). Its
top-1 branch is exactly the chain `propose` would draft, so a tree accepts at least as much as
the chain of the same depth, for one target forward over more tokens.

Nodes are numbered breadth first. A node sees the committed text and its own ancestors, never
its siblings or cousins: the draft expands one depth per forward under that mask, and the
target verifies every node under it (a 4D attention mask), each at position (root) + depth.

Target cache bookkeeping: the verify input is [pending..., tree nodes], where `pending` are
committed tokens the target has not read yet (the newest token, and after an accepted branch
its nodes too, because an accepted branch is not contiguous in the input). After the verify the
cache is cropped to the pending tokens; the accepted nodes are read again in the next round's
forward, a few tokens among the tree's many. Greedy only: with sampling, tree verification
needs the multi-candidate rejection rule, which is not implemented.
"""

from __future__ import annotations

import math
import time

import torch

from specfoundry.decoding.rounds import DecodeResult, PhaseClock, finish
from specfoundry.decoding.target import TargetRunner
from specfoundry.decoding.tree import DraftTree, accept_tree, verify_mask
from specfoundry.families.eagle3.chain import DraftRunner


@torch.inference_mode()
def propose_tree(draft: DraftRunner, branching: tuple[int, ...]) -> DraftTree:
    """Expand the tree one depth per draft forward from the draft's newest state (which
    predicts the first token); the draft's cache is left as it was found. Each depth takes one
    top-k over all its parents at once and one copy of the chosen ids to the host (not one small
    device sync per node, which costs more than the draft forward itself on a GPU)."""
    base = draft.length
    tree = DraftTree([], [], [])
    parents = [-1]
    logits, pre = draft.logits[None], draft.pre  # [F, Vd] and [1, F, H] of the frontier's F parents
    for depth, width in enumerate(branching, start=1):
        chosen = logits.topk(min(width, logits.shape[-1]), dim=-1).indices.tolist()  # [F][width] draft ids
        new, rows = [], []
        for row, (parent, ids) in enumerate(zip(parents, chosen, strict=True)):
            for d in ids:
                new.append(len(tree))
                rows.append(row)
                tree.tokens.append(draft.target_ids[d])
                tree.parents.append(parent)
                tree.depths.append(depth)
        if depth == len(branching):
            break  # the deepest nodes need no draft forward of their own
        # the new nodes read (own token, parent's next-step state) at position (root) + depth - 1,
        # as training's step `depth`; each sees the committed cache and its ancestors
        # node n's entry is column base + n (breadth first: every node but the deepest is read)
        pattern = tree.sees()[new][:, : len(tree)]  # [N, W]: its ancestors and itself among this round's entries
        hidden = pre[:, torch.tensor(rows, device=pre.device)]  # [1, N, H]: each node's parent state
        pre, logits = draft.run([tree.tokens[n] for n in new], hidden, [base - 1 + depth] * len(new), pattern)
        parents = new
    draft.forget_proposals()
    return tree


def tree_generate(target: TargetRunner, draft: DraftRunner, prompt: list[int], *, branching: tuple[int, ...],
                  max_new_tokens: int, eos: set[int]) -> DecodeResult:
    """Greedy speculative decoding with a draft tree: the output equals the target's own greedy
    decoding; accepted[i] counts the tree nodes accepted in round i."""
    device = target.device
    t0 = time.perf_counter()
    nodes = sum(math.prod(branching[: d + 1]) for d in range(len(branching)))  # the tree's size
    target.reset(len(prompt) + max_new_tokens + len(branching) + 1 + nodes)  # a verify: pending + the tree
    draft.reset(len(prompt) + max_new_tokens + nodes)
    logits, aux, _ = target.forward(prompt)
    tokens = [int(logits[-1].argmax())]
    result = DecodeResult(tokens)
    draft.extend(prompt[1:] + tokens, aux)
    pending = list(tokens)  # committed, not yet read by the target; the last is the tree's root
    tokens, done = finish(tokens, eos, max_new_tokens)
    clock = PhaseClock(device)
    while not done:
        m0 = clock.mark()
        tree = propose_tree(draft, branching)
        m1 = clock.mark()
        cached, p = len(target), len(pending)
        positions = list(range(cached, cached + p)) + [cached + p - 1 + d for d in tree.depths]
        logits, aux, _ = target.forward(pending + tree.tokens, positions=positions,
                                        mask=verify_mask(tree, cached, p))
        path, bonus = accept_tree(tree, logits.argmax(-1).tolist(), root_row=p - 1)
        target.crop(cached + p)  # keep the pending tokens; the tree's entries go
        m2 = clock.mark()
        new = [tree.tokens[n] for n in path] + [bonus]
        # (token t_{i+1}, aux a_i) pairs: the root's and the accepted nodes' features, computed
        # in this forward with exactly the committed text as their context
        draft.extend(new, aux[[p - 1] + [p + n for n in path]])
        m3 = clock.mark()
        clock.add("draft", m0, m1)
        clock.add("target", m1, m2)
        clock.add("draft", m2, m3)
        result.accepted.append(len(path))
        pending = new
        tokens, done = finish(tokens + new, eos, max_new_tokens)
    result.tokens = tokens
    result.draft_s, result.target_s = clock.seconds("draft"), clock.seconds("target")
    result.total_s = time.perf_counter() - t0
    return result
