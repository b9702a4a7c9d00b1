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

Host synchronisation: the tree's structure is fixed by its branching (TreeShape), so the draft's
expansion runs on the device alone (a CUDA graph per branching on a GPU), its tokens go into the
target's verify from the device (TargetRunner.forward's tail), and the host reads the tree's tokens
and the target's choices together once a round, for the acceptance walk.
"""

from __future__ import annotations

import time

import torch

from specfoundry.decoding.rounds import (
    DecodeResult,
    NonFiniteLogitsError,
    PhaseClock,
    cut_at_end,
    read_prompt,
)
from specfoundry.decoding.target import TargetRunner
from specfoundry.decoding.tree import DraftTree, EngineTree, accept_tree, verify_mask
from specfoundry.families.eagle3.chain import DraftRunner
from specfoundry.families.eagle3.expansion import TreeShape


@torch.inference_mode()
def expand_tree(draft: DraftRunner, shape: TreeShape) -> torch.Tensor:
    """The tree's tokens [N] (target ids, on the device, not read by the host) from the draft's
    newest state; the draft's committed entries are left as they were. One captured step per
    branching (DraftRunner.trees)."""
    if draft.length + len(shape) > draft.cache.capacity:
        draft.reset_capacity(draft.length + len(shape))
    return draft.trees(shape.branching)


def propose_tree(draft: DraftRunner, branching: tuple[int, ...]) -> DraftTree:
    """The draft's tree for `branching`, read by the host."""
    shape = TreeShape.of(branching, draft.logits.shape[-1])
    return shape.tree(expand_tree(draft, shape).tolist())


def verify_widths(shape: TreeShape) -> list[int]:
    """The token counts of the target's tree verifies for `shape`: p pending tokens and the tree's
    nodes, p from 1 (the root alone) to depth + 1 (the root and a whole accepted branch). Each is a
    step shape of its own: a captured graph, and a compile under --compile-target."""
    return [p + len(shape) for p in range(1, len(shape.branching) + 2)]


def verify_layout(structure: DraftTree, cached: int, p: int) -> tuple[list[int], torch.Tensor]:
    """The positions [p + N] and mask of a tree verify after `cached` committed tokens: p pending
    tokens at the next positions, then each node at the root's (the last pending token's) position
    plus its depth, seeing the committed text, the pending tokens and its ancestors (verify_mask)."""
    positions = list(range(cached, cached + p)) + [cached + p - 1 + d for d in structure.depths]
    return positions, verify_mask(structure, cached, p)


class FixedTree:
    """The tree of a fixed branching (expansion.py TreeShape): its structure is known before the
    round, so the host reads its tokens only with the target's choices."""

    def __init__(self, draft: DraftRunner, branching: tuple[int, ...]):
        self.shape = TreeShape.of(branching, draft.logits.shape[-1])
        self.nodes, self.depth = len(self.shape), len(self.shape.branching)
        self.structure = self.shape.tree([0] * self.nodes)  # the verify mask reads the structure alone

    def draft(self, draft: DraftRunner) -> tuple[torch.Tensor, DraftTree]:
        return expand_tree(draft, self.shape), self.structure


class ServedTree:
    """The engines' tree (engine_tree.py): its structure changes every round, so the host reads the
    parents [N-1] before the target's verify, whose mask it builds (one read more a round)."""

    def __init__(self, draft: DraftRunner, shape: EngineTree):
        self.shape = shape
        self.nodes, self.depth = shape.num_draft_tokens - 1, shape.num_steps

    def draft(self, draft: DraftRunner) -> tuple[torch.Tensor, DraftTree]:
        if draft.length + self.shape.num_steps * self.shape.topk > draft.cache.capacity:
            draft.reset_capacity(draft.length + self.shape.num_steps * self.shape.topk)
        tokens, parents = draft.engine_trees(self.shape)
        parents = [p - 1 for p in parents.tolist()]  # DraftTree's: -1 for the root's children
        depths = []
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return tokens, DraftTree([0] * self.nodes, parents, depths)


def tree_generate(target: TargetRunner, draft: DraftRunner, prompt: list[int], *,
                  branching: tuple[int, ...] | EngineTree, max_new_tokens: int, eos: set[int]) -> DecodeResult:
    """Greedy speculative decoding with a draft tree, of a fixed branching or the engines' (an
    EngineTree): the output equals the target's own greedy decoding; accepted[i] counts the tree
    nodes accepted in round i."""
    device = target.device
    trees = ServedTree(draft, branching) if isinstance(branching, EngineTree) else FixedTree(draft, branching)
    nodes = trees.nodes
    draft.reset(len(prompt) + max_new_tokens + nodes)  # (outside the decode's time, as the chain's caller's)
    t0 = time.perf_counter()
    target.reset(len(prompt) + max_new_tokens + trees.depth + 1 + nodes)  # a verify: pending + the tree
    clock = PhaseClock(device)
    tokens, result = read_prompt(clock, target, prompt, lambda row: int(row.argmax()),
                                 lambda first, aux: draft.extend(prompt[1:] + first, aux))
    pending = list(tokens)  # committed, not yet read by the target; the last is the tree's root
    tokens, done = cut_at_end(tokens, eos, max_new_tokens)
    while not done:
        proposing = clock.mark()
        drafted, structure = trees.draft(draft)  # [N] on the device
        verifying = clock.mark()
        cached, p = len(target), len(pending)
        positions, mask = verify_layout(structure, cached, p)
        logits, aux, _ = target.forward(pending, positions=positions, mask=mask, tail=drafted)
        # the round's one synchronisation: the tree's tokens and the target's choices, read together
        # (and whether the logits are finite, in the same read: check_logits' question)
        read = torch.cat([drafted, logits.argmax(-1), torch.isfinite(logits).all().long().view(1)]).tolist()
        if not read[-1]:
            raise NonFiniteLogitsError(f"the target's logits are not finite at round {len(result.accepted) + 1}: "
                                       "the target or its weights are broken (a NaN or an inf)")
        tree = DraftTree(read[:nodes], structure.parents, structure.depths)
        path, bonus = accept_tree(tree, read[nodes:-1], root_row=p - 1)
        target.crop(cached + p)  # keep the pending tokens; the tree's entries go
        committing = clock.mark()
        new = [tree.tokens[n] for n in path] + [bonus]
        # (token t_{i+1}, aux a_i) pairs: the root's and the accepted nodes' features, computed
        # in this forward with exactly the committed text as their context
        draft.extend(new, aux[[p - 1] + [p + n for n in path]])
        done_round = clock.mark()
        clock.add("draft", proposing, verifying)
        clock.add("target", verifying, committing)
        clock.add("draft", committing, done_round)
        result.accepted.append(len(path))
        pending = new
        tokens, done = cut_at_end(tokens + new, eos, max_new_tokens)
    result.tokens = tokens
    clock.fill(result)
    result.total_s = time.perf_counter() - t0
    return result
