"""The gate's checks of a DFlash2 draft (gate.py drives the gate; block k+1, k proposals), in order:

    export names every tensor the engines' DFlash2 loaders fill (DFlash's, the convolutions', the
                 selector's) is there, shaped so, and equals the checkpoint's
    mask token   the export's dflash_config.mask_token_id is the id the draft was trained with
    layers       the export's target_layer_ids are the trained ones, and the target's features there
                 match the feature set's
    positions    sf-eval's first round (the selector's walk) equals the training forward's selector
                 scores teacher-forced on that round's proposals (first, middle, last anchor)
    fit          the training forward's selector (teacher-forced) picks the answer's token at every slot
    decode       greedy block decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

import torch

from specfoundry.families.dflash.anchors import valid_slots
from specfoundry.families.dflash.gate import (
    GATE_DRAFT_LAYERS,
    block_gate_checks,
    fit_check,
    sequential_rounds_and_training,
)
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.dflash2.decode import DFlash2Decoder, DFlash2Runner, decode_matches_training
from specfoundry.families.dflash2.export import validate
from specfoundry.families.dflash2.options import DFlash2Options
from specfoundry.families.folders import DraftRef
from specfoundry.families.gatekit import Check
from specfoundry.featureset.store import FeatureSet


def gate_options(gate) -> dict:
    """The overfit's options: DFlash's (blocks of k + 1, GATE_DRAFT_LAYERS layers) and a small
    selector (the gate's target is small)."""
    return {"dflash": DFlashOptions(block_size=gate.k + 1, num_draft_layers=GATE_DRAFT_LAYERS),
            "dflash2": DFlash2Options(selector_rank=32, selector_top_k=8)}


def selector_choices(model, states: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
    """(the selector's teacher-forced choice, the true token) [N, B-1] of every anchor's slots 1..B-1,
    from the training forward's states [N*B, H] of the sample's tokens ids [n]."""
    b = model.cfg.block_size
    rows = states.view(-1, b, states.shape[-1])[:, 1:].reshape(-1, states.shape[-1])  # [N*(B-1), H]
    at = anchors[0, :, None] + torch.arange(1, b, device=anchors.device)  # [N, B-1] each slot's position
    last = len(ids) - 1
    truth, prev = ids[at.clamp(max=last)], ids[(at - 1).clamp(max=last)]
    scores, candidates = model.candidate_scores(rows, head, prev.reshape(-1))
    return candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0].view_as(truth), truth


def check_positions_and_fit(runner: DFlash2Runner, sample) -> list[Check]:
    positions, batch, anchors, keep, states = sequential_rounds_and_training(runner, sample, decode_matches_training,
                                                                             "selector")
    model = runner.draft
    with torch.inference_mode():
        predicted, truth = selector_choices(model, states, runner.lm_head.to(states.dtype),
                                            sample.input_ids.to(states.device), anchors)
    valid = valid_slots(batch, anchors, keep, model.cfg.block_size)[0]  # [N, B-1]
    return [positions, fit_check((predicted == truth)[valid].float().mean().item())]


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, ref, fs, sample, target, validate=validate, runner_class=DFlash2Runner,
                             decoder_class=DFlash2Decoder, positions_and_fit=check_positions_and_fit)
