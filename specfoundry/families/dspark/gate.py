"""The gate's checks of a DSpark draft (gate.py drives the gate; blocks of k, k proposals), in order:

    export names every tensor SGLang's DSpark loader fills (DFlash's and the heads') is there, shaped so
    mask token   the export's dflash_config.mask_token_id is the id the draft was trained with
    layers       the export's target_layer_ids are the trained ones, and the target's features there
                 match the feature set's
    positions    sf-eval's first round (sequential Markov bias) equals the teacher-forced training
                 forward (first, middle, last anchor)
    fit          the training forward (teacher-forced) predicts the answer's next tokens at every slot
    decode       greedy block decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

import torch

from specfoundry.families.dflash.decode import BlockDecoder
from specfoundry.families.dflash.gate import block_gate_checks, fit_check, sequential_rounds_and_training
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.dspark.decode import DSparkRunner, decode_matches_training
from specfoundry.families.dspark.export import validate
from specfoundry.families.dspark.loss import anchor_targets
from specfoundry.families.dspark.options import DSparkOptions
from specfoundry.families.folders import DraftRef
from specfoundry.families.gatekit import Check
from specfoundry.featureset.store import FeatureSet


def gate_options(gate) -> dict:
    """The overfit's options: blocks of k (a DSpark block proposes all of its slots) and a small
    Markov head (the gate's target is small)."""
    return {"dflash": DFlashOptions(block_size=max(2, gate.k)), "dspark": DSparkOptions(markov_rank=32)}


def check_positions_and_fit(runner: DSparkRunner, sample) -> list[Check]:
    positions, batch, anchors, keep, states = sequential_rounds_and_training(runner, sample, decode_matches_training,
                                                                             "Markov bias")
    model, b = runner.draft, runner.draft.cfg.block_size
    with torch.inference_mode():
        labels, counted, prev = anchor_targets(batch, anchors, keep, b)
        predicted = model.step_logits(states, runner.lm_head, prev[0].reshape(-1)).argmax(-1).view(-1, b)
    return [positions, fit_check((predicted == labels[0])[counted[0]].float().mean().item())]


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, ref, fs, sample, target, validate=validate, runner_class=DSparkRunner,
                             decoder_class=BlockDecoder, positions_and_fit=check_positions_and_fit)
