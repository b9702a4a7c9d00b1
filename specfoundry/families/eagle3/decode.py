"""EAGLE-3 in sf-eval: the chain (decoding/rounds.py, decode_rounds' callables) and the token tree
(families/eagle3/tree.py), and its first round against Training-Time Test's step 0. Imported by sf-eval and
the gate only, through the family's provider."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.decoding.rounds import DecodeResult
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.decoding.tree import EngineTree, tree_nodes
from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
from specfoundry.families.eagle3.model import Eagle3Draft, TTTCache
from specfoundry.families.eagle3.tree import TreeShape, tree_generate, verify_widths
from specfoundry.families.interface import Decoder


@dataclass
class Eagle3Decoder(Decoder):
    """A chain of k proposals per round, or the token tree of `tree`'s branching, or the engines' tree
    of an EngineTree (greedy)."""

    runner: DraftRunner
    k: int
    tree: tuple[int, ...] | EngineTree | None = None

    def generate(self, target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                 sampler: Sampler) -> DecodeResult:
        if self.tree:
            return tree_generate(target, self.runner, prompt, branching=self.tree, max_new_tokens=max_new_tokens,
                                 eos=eos)
        return speculative_generate(target, self.runner, prompt, k=self.k, max_new_tokens=max_new_tokens, eos=eos,
                                    sampler=sampler)

    def reserve(self, tokens: int) -> None:
        # what a decode's proposals take past its text: k entries, or the tree's nodes (as
        # speculative_generate and tree_generate reset it)
        self.runner.reset(tokens + self.proposals())

    def proposals(self) -> int:
        """The draft's entries past the committed text a round writes (tree.py ServedTree's reserve)."""
        if isinstance(self.tree, EngineTree):
            return max(self.tree.num_draft_tokens - 1, self.tree.num_steps * self.tree.topk)
        return tree_nodes(self.tree) if self.tree else self.k

    def step_keys(self, target: TargetRunner, prompts: list[int]) -> list:
        """The prompt's read, the commit of every count a round may take (a + 1 for a = 0..k, or
        0..depth of the tree's accepted path), the chain of k or the tree's expansion, and the
        target's verify: k + 1 tokens, or the tree's nodes after each number of pending tokens."""
        if not self.tree:
            return (self.runner.step_keys(self.k, prompts) + [(self.runner.chains, self.k)]
                    + [(target.steps, self.k + 1)])
        if isinstance(self.tree, EngineTree):  # p pending tokens (1..S + 1) and the N - 1 drafted ones
            nodes, depth = self.tree.num_draft_tokens - 1, self.tree.num_steps
            return (self.runner.step_keys(depth, prompts) + [(self.runner.engine_trees, self.tree)]
                    + [(target.steps, p + nodes) for p in range(1, depth + 2)])
        shape = TreeShape.of(self.tree, self.runner.logits.shape[-1])
        return (self.runner.step_keys(len(self.tree), prompts) + [(self.runner.trees, shape.branching)]
                + [(target.steps, width) for width in verify_widths(shape)])


def decode_settings(k: int, tree: tuple[int, ...] | None) -> tuple[int, tuple[int, ...] | None, None]:
    """Chains of -k, or the tree (sf-eval checks its branching and that it decodes greedily)."""
    return k, tree, None


def teacher_forced_logits(runner: DraftRunner, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """The decoder's start on one sequence: step-0 logits [T-1, Vd] through sf-eval's cached path
    (row i predicts ids[i+2]; the last row is the first proposal's)."""
    runner.reset()
    device = runner.draft.fc.weight.device
    return runner.extend(ids[1:].tolist(), aux[:-1].to(device))


def training_logits(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Training-Time Test's step 0 on the same sequence: token x_{i+1} and the features at i."""
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    n = len(ids)
    with torch.inference_mode():
        hidden = draft.project(aux[:-1].to(device, dtype)[None])
        _, normed = draft.ttt_forward(ids[1:].to(device)[None], hidden, torch.arange(n - 1, device=device)[None],
                                      TTTCache(), [n - 1], 0, "sdpa")
        return draft.lm_head(normed)[0].float()


def decode_matches_training(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor):
    """(the decoder's step-0 logits over the sequence, Training-Time Test's step 0), [T-1, Vd] each."""
    return teacher_forced_logits(DraftRunner(draft), ids, aux), training_logits(draft, ids, aux)
