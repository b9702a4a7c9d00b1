"""DFlash in sf-eval: block decoding (families/dflash/block.py, decode_rounds' callables), its settings, and
its first round against the training forward at the same positions. Imported by sf-eval and the
gate only, through the family's provider."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.common.settings import MAX_DRAFT
from specfoundry.decoding.rounds import DecodeResult
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.anchors import block_inputs
from specfoundry.families.dflash.block import BlockDraftRunner, block_generate
from specfoundry.families.dflash.config import DFlashConfig
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.interface import Decoder


@dataclass
class BlockDecoder(Decoder):
    """sf-eval's decoder of a draft on DFlash's backbone (DFlash, Domino, DSpark, DFlash2): one block of
    proposals a round, the runner's `propose` (block_size - 1 of them for DFlash and Domino,
    block_size for DSpark)."""

    runner: BlockDraftRunner

    def generate(self, target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                 sampler: Sampler) -> DecodeResult:
        return block_generate(target, self.runner, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler)

    def reserve(self, tokens: int) -> None:
        # a block past the text: the last round's commit may run over max_new_tokens by up to a block
        self.runner.reset(tokens + self.runner.block_size)

    def step_keys(self, target: TargetRunner, prompts: list[int]) -> list:
        """The draft's proposal and appends (BlockDraftRunner.step_keys), and the target's verify of
        the bonus and the block's proposals."""
        return self.runner.step_keys(prompts) + [(target.steps, self.runner.proposal_count + 1)]


DFlashDecoder = BlockDecoder


def decode_settings(cfg: DFlashConfig, *, k: int, tree, k_given: bool, source: str):
    """(k, no tree, no warning): a block of B proposes B - 1 tokens; -k serves a block of k + 1 <= B
    (SGLang's --speculative-num-draft-tokens, vLLM's num_speculative_tokens), else the trained block.
    A tree, or a block larger than trained or than sf-eval decodes, is refused."""
    if tree:
        raise ValueError(f"--tree drafts EAGLE-3 token trees; {source} is a DFlash draft, which proposes blocks of "
                         f"{cfg.block_size}")
    if k_given and not 1 <= k <= cfg.block_size - 1:
        raise ValueError(f"-k {k}: DFlash-family draft {source} of blocks of {cfg.block_size} proposes 1 to "
                         f"{cfg.block_size - 1} tokens a round (a block of k + 1, at most the trained one)")
    served = k if k_given else cfg.block_size - 1
    if served > MAX_DRAFT:
        raise ValueError(f"{source} is a DFlash draft of blocks of {cfg.block_size}; sf-eval decodes blocks of at most "
                         f"{MAX_DRAFT + 1} (-k serves a smaller block)")
    return served, None, None


@torch.inference_mode()
def training_block_states(draft: DFlashDraft, ids: torch.Tensor, aux: torch.Tensor, anchor: int) -> torch.Tensor:
    """The training forward's final-normed states [B, H] of the block anchored at `anchor` (context:
    aux before it), for a draft on DFlash's backbone."""
    cfg = draft.cfg
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    anchors = torch.tensor([[anchor]], device=device)
    block_ids, positions = block_inputs(ids[None].to(device), anchors, cfg.block_size, cfg.mask_token_id)
    context = draft.project_context(aux[None].to(device, dtype))
    keep = torch.ones_like(anchors, dtype=torch.bool)
    return draft.train_forward(context, block_ids, positions, anchors, keep, [len(ids)], "sdpa")[0]


def training_block_logits(draft: DFlashDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor,
                          anchor: int) -> torch.Tensor:
    """The training forward's logits [B-1, V] of the block anchored at `anchor` (context: aux before it)."""
    with torch.inference_mode():
        return draft.block_logits(training_block_states(draft, ids, aux, anchor)[1:], lm_head).float()


def sequential_first_round(runner, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, training_logits):
    """For a head run sequentially in decoding (Domino's GRU, DSpark's Markov bias): (the first
    round's logits after the prompt ids[:-1] and the bonus ids[-1], `training_logits` at the same
    anchor teacher-forced on the round's own proposals), [proposals, V] each. runner: a fresh one."""
    p = len(ids) - 1
    runner.extend(aux[:p].to(lm_head.device))
    drafts, decoded = runner.propose(int(ids[p]))
    forced = torch.cat([ids[: p + 1].cpu(), torch.as_tensor(drafts).cpu()])  # the sequence the round drafted
    features = torch.cat([aux[: p + 1].cpu(), aux.new_zeros(len(drafts), aux.shape[1]).cpu()])  # unseen after p
    return decoded, training_logits(runner.draft, lm_head, forced, features, p)


def decode_matches_training(draft: DFlashDraft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """(the first round's block logits after the prompt ids[:-1], the training forward's at the
    same anchor), [B-1, V] each: the decoder reads the prompt's features and proposes after the
    bonus token ids[-1]."""
    p = len(ids) - 1
    runner = BlockDraftRunner(draft, lm_head)
    runner.extend(aux[:p].to(lm_head.device))
    _, decoded = runner.propose(int(ids[p]))
    return decoded, training_block_logits(draft, lm_head, ids, aux, p)
