"""DFlash2 in sf-eval: DFlash's block decoding (families/dflash/block.py) with the selector choosing
each slot's token from its top K, as the engines decode it (SGLang's _SelectorDraftSampler, vLLM's
DFlash2Speculator._generate_draft, z-lab's dflash_generate).

A round after the bonus b at position p: one draft forward over [b, M, ..., M] at p..p+B-1 gives
the states of slots 1..B-1; then, on the device alone (one captured step, no host read):
    candidates   C_t = topk(z_t W^T, K)                                  [L, K], L = B - 1
    lattice      every slot's K x K edges, score_t(p -> c)               [L, K, K] (model.py)
    walk         slot by slot from the anchor: greedy x_t = argmax_c score_t(x_{t-1} -> c); sampling
                 x_t ~ q_t = softmax(score_t(x_{t-1} -> .) / T) over C_t, by inverse CDF of a
                 uniform drawn on the host's generator and staged as the step's input
The target verifies [b, x_1..x_{B-1}] in one forward: greedy keeps the longest prefix equal to its
argmax (greedy output equals the target's own); sampling applies the rejection rule against exactly
the q_t each token was drawn from, supported on C_t (decoding/accept.py accept_candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfoundry.decoding.accept import accept_candidates
from specfoundry.decoding.rounds import DecodeResult, decode_rounds
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.steps import Step
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.block import BlockDraftRunner
from specfoundry.families.dflash.decode import BlockDecoder, training_block_states
from specfoundry.families.dflash2.model import DFlash2Draft
from specfoundry.families.dflash2.selector import walk


class DFlash2Runner(BlockDraftRunner):
    """BlockDraftRunner whose B - 1 proposals are the selector's path through the block's lattice."""

    def __init__(self, draft: DFlash2Draft, lm_head: torch.Tensor, *, block_size: int | None = None,
                 graphs: bool | None = None, compiled: bool = False):
        super().__init__(draft, lm_head, block_size=block_size, graphs=graphs, compiled=compiled)
        self.no_draws = torch.zeros(self.block_size - 1)  # greedy's uniforms (unread), equal every round
        self.greedy_inputs = (torch.zeros((), device=self.device), self.no_draws.to(self.device))

    @torch.inference_mode()
    def propose(self, bonus: int, sampler: Sampler | None = None):
        """(the B - 1 proposals after `bonus`, on the device, and what verification reads:
        (candidates [L, K], q [L, K] the distribution each was drawn from, the realised scores [L, K]))."""
        if sampler is None or sampler.greedy:
            temperature, uniforms = 0.0, self.no_draws
        else:
            device = sampler.generator.device if sampler.generator is not None else self.device
            temperature = sampler.temperature
            uniforms = torch.rand(self.block_size - 1, generator=sampler.generator, device=device)
        drafts, candidates, q, rows = self.proposals(None, bonus=bonus, temperature=temperature, uniforms=uniforms)
        return drafts, (candidates, q, rows)

    def proposal_step(self, key: None) -> Step:
        """The proposal (propose_body) reading the bonus, the temperature and the slots' uniforms."""
        inputs = dict(bonus=torch.tensor(0), temperature=torch.tensor(0.0), uniforms=self.no_draws)
        return Step(lambda x: self.propose_body(x.bonus, x.temperature, x.uniforms), inputs)

    def propose_body(self, bonus: torch.Tensor, temperature: torch.Tensor | None = None,
                     uniforms: torch.Tensor | None = None):
        """(drafts [L], candidates [L, K], q [L, K], realised scores [L, K]); greedy where temperature
        is None."""
        if temperature is None:
            temperature, uniforms = self.greedy_inputs
        draft: DFlash2Draft = self.draft
        states = self.block_states(bonus)[1:]  # [L, H], slots 1..B-1
        lattice, candidates = draft.block_lattice(states, self.lm_head, bonus.view(1))
        choices, q, rows = walk(lattice, temperature, uniforms)
        return candidates.gather(1, choices[:, None])[:, 0], candidates, q, rows


@dataclass
class DFlash2Decoder(BlockDecoder):
    """BlockDecoder whose proposals come from the selector's walk (greedy or sampled by the round's
    sampler) and are verified against its q (accept_candidates)."""

    runner: DFlash2Runner

    def generate(self, target: TargetRunner, prompt: list[int], *, max_new_tokens: int, eos: set[int],
                 sampler: Sampler) -> DecodeResult:
        runner = self.runner
        runner.reset(len(prompt) + max_new_tokens)
        return decode_rounds(
            target, prompt, max_new_tokens=max_new_tokens, eos=eos, sampler=sampler,
            start=lambda first, aux: runner.extend(aux),
            propose=lambda last: runner.propose(last, sampler),
            verify=lambda drafts, extra, logits: accept_candidates(drafts, extra[0], extra[1], logits, sampler),
            commit=lambda new, aux: runner.extend(aux))  # b and the accepted proposals' features


@torch.inference_mode()
def decode_matches_training(draft: DFlash2Draft, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """(the first round's realised scores after the prompt ids[:-1] and the bonus ids[-1], the training
    forward's selector scores at the same anchor teacher-forced on the round's own proposals),
    [B-1, K] each: the backbone, the candidates and the selector's edges all enter both."""
    p = len(ids) - 1
    runner = DFlash2Runner(draft, lm_head)
    runner.extend(aux[:p].to(lm_head.device))
    drafts, (_, _, decoded) = runner.propose(int(ids[p]))
    forced = torch.cat([ids[: p + 1].cpu(), drafts.cpu()])  # the path the round drafted
    features = torch.cat([aux[: p + 1].cpu(), aux.new_zeros(len(drafts), aux.shape[1]).cpu()])  # unseen after p
    states = training_block_states(draft, forced, features, p)[1:]  # [L, H]
    predecessors = forced[p: p + len(drafts)].to(states.device)  # the bonus, then the drafts before each slot
    trained, _ = draft.candidate_scores(states, lm_head.to(states.dtype), predecessors)
    return decoded, trained
