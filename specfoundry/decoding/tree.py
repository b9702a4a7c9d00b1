"""Token trees: the shape of a tree of drafts, the mask under which the target verifies all of it in
one forward, and the greedy walk that accepts its longest branch the target agrees with.

The tree has a fixed branching per depth, e.g. (4, 2, 2, 1): the 4 most likely first tokens,
the 2 most likely continuations of each, and so on (4 + 8 + 16 + 16 = 44 nodes, depth 4). Nodes
are numbered breadth first. A node sees the committed text and its own ancestors, never its
siblings or cousins; the target verifies every node under that mask, each at position (root) +
depth. Greedy only: with sampling, tree verification needs the multi-candidate rejection rule,
which is not implemented. A family drafts its tree (families/eagle3/tree.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specfoundry.common.settings import MAX_DRAFT


@dataclass
class DraftTree:
    tokens: list[int]  # target ids, breadth first
    parents: list[int]  # parent node per node; -1 for the root's children
    depths: list[int]  # 1 for the root's children

    def __len__(self) -> int:
        return len(self.tokens)

    def sees(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j (j is i or one of its ancestors)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]  # breadth first: the parent's row is complete already
        return mask

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out


@dataclass(frozen=True)
class EngineTree:
    """The engines' draft tree (SGLang's EAGLE worker: families/eagle3/engine_tree.py drafts it): its three
    serving knobs, under SGLang's flags' names without their prefix."""

    num_steps: int  # S: draft forwards a round (the root's included), the tree's depth
    topk: int  # K: children kept per expanded node, and the frontier's width
    num_draft_tokens: int  # N: tokens the target verifies a round, the root included

    def __post_init__(self):
        if min(self.num_steps, self.topk, self.num_draft_tokens) < 1:
            raise ValueError(f"--num-steps, --topk and --num-draft-tokens are at least 1, got {self}")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"--topk 1 drafts a chain of --num-steps tokens: --num-draft-tokens is "
                             f"{self.num_steps + 1} (SGLang sets it so), not {self.num_draft_tokens}")
        if self.num_draft_tokens - 1 > self.pool_size:
            raise ValueError(f"--num-draft-tokens {self.num_draft_tokens} verifies more drafted tokens than the "
                             f"{self.pool_size} that {self.num_steps} steps of top {self.topk} draft")

    @property
    def pool_size(self) -> int:
        """The nodes the draft scores a round: K at step 0, K^2 at each later step."""
        return self.topk + (self.num_steps - 1) * self.topk ** 2


def parse_branching(text: str) -> tuple[int, ...]:
    """'4,2,2,1' -> (4, 2, 2, 1); each at least 1."""
    try:
        branching = tuple(int(x) for x in text.split(","))
    except ValueError as e:
        raise ValueError(f"tree branching must be comma-separated integers, got {text!r}") from e
    check_branching(branching)
    return branching


MAX_TREE_NODES = 4096
"""The most nodes a tree may have: one target forward verifies them all, with an [N, cache] mask and
[N, vocabulary] fp32 logits (4,096 nodes at a 128k vocabulary: 2 GiB of logits alone). The engines
verify far fewer (SGLang's --speculative-num-draft-tokens, a few dozen); 8,4,2,1,1,1,1 has 360."""


def check_branching(branching: tuple[int, ...]) -> None:
    if not branching or min(branching) < 1 or len(branching) > MAX_DRAFT:
        raise ValueError(f"tree branching needs 1 to {MAX_DRAFT} depths, each >= 1, got "
                         f"{','.join(map(str, branching))!r}")
    if tree_nodes(branching) > MAX_TREE_NODES:
        raise ValueError(f"tree {','.join(map(str, branching))} has {tree_nodes(branching):,} nodes, more than the "
                         f"{MAX_TREE_NODES:,} one target forward may verify (each depth's count multiplies the ones "
                         "before it: 8,4,2,1,1,1,1 has 360)")


def tree_nodes(branching: tuple[int, ...]) -> int:
    """Nodes of a tree of that branching (vocabulary permitting): 4,2,2,1 -> 4 + 8 + 16 + 16 = 44."""
    return sum(math.prod(branching[: d + 1]) for d in range(len(branching)))


def shape_name(k: int, tree: tuple[int, ...] | EngineTree | None) -> str:
    """How a report names the draft's shape: 'tree 4,2,2,1', SGLang's 'served tree S,K,N', or 'k=4'."""
    if isinstance(tree, EngineTree):
        return f"served tree {tree.num_steps},{tree.topk},{tree.num_draft_tokens}"
    return f"tree {','.join(map(str, tree))}" if tree else f"k={k}"


def accept_tree(tree: DraftTree, choice: list[int], root_row: int) -> tuple[list[int], int]:
    """Greedy walk: from the root, follow the child whose token is the target's choice at the
    current node. choice[r] is the target's argmax at input row r; node n is row root_row+1+n.
    Returns (accepted nodes, the target's own token after them)."""
    children = tree.children()
    path, node, row = [], -1, root_row
    while True:
        y = choice[row]
        match = next((c for c in children[node] if tree.tokens[c] == y), None)
        if match is None:
            return path, y
        path.append(match)
        node, row = match, root_row + 1 + match


def verify_mask(tree: DraftTree, cached: int, pending: int) -> torch.Tensor:
    """[pending + N, cached + pending + N] bool: pending tokens causally, every tree node after
    all pending tokens and its ancestors."""
    n = len(tree)
    rows = pending + n
    mask = torch.zeros(rows, cached + rows, dtype=torch.bool)
    mask[:, :cached] = True
    mask[:pending, cached : cached + pending] = torch.tril(torch.ones(pending, pending, dtype=torch.bool))
    mask[pending:, cached : cached + pending] = True
    mask[pending:, cached + pending :] = tree.sees()
    return mask
