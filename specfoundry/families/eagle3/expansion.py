"""EAGLE-3's tree expansion on the draft's side (families/eagle3/tree.py decodes with it): the
tree of a fixed branching, and the body that expands it from the draft's committed state on the
device alone, one captured step per branching (chain.py DraftRunner.trees)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.decoding.cache import visible
from specfoundry.decoding.tree import DraftTree


@dataclass(frozen=True)
class TreeShape:
    """A tree of one branching whatever its tokens: node parents and depths, breadth first, and the
    node range [lo, hi) of each depth. The same every round, so the draft's expansion is one body
    on the device (captured as a CUDA graph on a GPU, per branching) and only its tokens change."""

    branching: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    levels: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, branching: tuple[int, ...], vocab: int | None = None) -> TreeShape:
        """The tree of `branching`, each width at most `vocab` (the draft's vocabulary: no more
        distinct children to pick)."""
        branching = tuple(min(w, vocab) for w in branching) if vocab else tuple(branching)
        parents, depths, levels, frontier = [], [], [], [-1]
        for depth, width in enumerate(branching, start=1):
            lo = len(parents)
            for parent in frontier:
                parents += [parent] * width
                depths += [depth] * width
            levels.append((lo, len(parents)))
            frontier = list(range(lo, len(parents)))
        return cls(branching, tuple(parents), tuple(depths), tuple(levels))

    def __len__(self) -> int:
        return len(self.parents)

    def tree(self, tokens: list[int]) -> DraftTree:
        return DraftTree(list(tokens), list(self.parents), list(self.depths))


def expand_body(draft, shape: TreeShape):
    """The tree's draft expansion on the device alone (`draft`: chain.py's DraftRunner), as a function
    of the draft's committed state
    (pre, logits, base): returns target ids [N], breadth first. Depth d's nodes are the top
    branching[d-1] draft ids of each parent's logits (parent-major, as topk orders them); all but
    the deepest are then read in one draft forward: node n's entry at column base + n, position
    base - 1 + d (training's step d), its parent's next-step state as hidden input, seeing the
    committed entries and its ancestors."""
    dev = draft.device
    sees = shape.tree([0] * len(shape)).sees()  # [N, N] a node and its ancestors
    static = []  # per depth read: parent rows [n_d] in the frontier, pattern [n_d, hi_d], columns [n_d]
    for depth, (lo, hi) in enumerate(shape.levels[:-1], start=1):
        parent_lo = shape.levels[depth - 2][0] if depth > 1 else 0
        rows = [max(shape.parents[n], 0) - parent_lo for n in range(lo, hi)]
        static.append((torch.tensor(rows, device=dev), sees[lo:hi, :hi].to(dev), torch.arange(lo, hi, device=dev)))

    def body() -> torch.Tensor:
        logits, pre = draft.logits[None], draft.pre  # [F, Vd] and [1, F, H] of the frontier's F parents
        tokens = []
        for depth, width in enumerate(shape.branching, start=1):
            chosen = logits.topk(width, dim=-1).indices.reshape(-1)  # [n_d] draft ids
            ids = draft.draft_to_target[chosen]  # [n_d] target ids
            tokens.append(ids)
            if depth == len(shape.branching):
                break  # the deepest nodes need no draft forward of their own
            rows, pattern, columns = static[depth - 1]
            allowed = visible(draft.kv_index, draft.base, pattern)  # [n_d, C]
            draft.cache.columns = draft.base + columns
            positions = (draft.base + (depth - 1)).expand(1, ids.shape[0])  # [1, n_d]
            pre, normed = draft.draft.decode_forward(ids[None], pre[:, rows], positions, draft.cache,
                                                     allowed[None, None])
            logits = draft.draft.lm_head(normed)[0].float()  # [n_d, Vd]
        return torch.cat(tokens)

    return body
