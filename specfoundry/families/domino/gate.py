"""The gate's checks of a Domino draft (gate.py drives the gate; block k+1), in order:

    export names every tensor SGLang's Domino loader fills (DFlash's and the head's) is there, shaped so
    mask token   the export's dflash_config.mask_token_id is the id the draft was trained with
    layers       the export's target_layer_ids are the trained ones, and the target's features there
                 match the feature set's
    positions    sf-eval's first round (sequential GRU) equals the teacher-forced training forward
                 (first, middle, last anchor)
    fit          the training forward (teacher-forced) predicts the answer's next tokens at every slot
    decode       greedy block decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

import torch

from specfoundry.families.dflash.decode import BlockDecoder
from specfoundry.families.dflash.gate import block_gate_checks, fit_check, sequential_rounds_and_training
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.domino.decode import DominoRunner, decode_matches_training
from specfoundry.families.domino.export import validate
from specfoundry.families.domino.loss import shifted_targets
from specfoundry.families.domino.options import DominoOptions
from specfoundry.families.folders import DraftRef
from specfoundry.families.gatekit import Check
from specfoundry.featureset.store import FeatureSet


def gate_options(gate) -> dict:
    """The overfit's options: blocks of k + 1 and a small head (the gate's target is small)."""
    return {"dflash": DFlashOptions(block_size=gate.k + 1), "domino": DominoOptions(gru_hidden_dim=64,
                                                                                   correction_dim=64)}


def check_positions_and_fit(runner: DominoRunner, sample) -> list[Check]:
    positions, batch, anchors, keep, states = sequential_rounds_and_training(runner, sample, decode_matches_training,
                                                                             "GRU")
    model, b = runner.draft, runner.draft.cfg.block_size
    with torch.inference_mode():
        labels, valid, tokens = shifted_targets(batch, anchors, keep, b)
        rows = states.view(-1, b, states.shape[-1])  # [N, B, H]
        slots = torch.arange(b, device=rows.device).repeat(rows.shape[0])
        logits = model.block_logits(rows.reshape(-1, rows.shape[-1]), runner.lm_head, slots,
                                    tokens[0].repeat_interleave(b, dim=0))
        predicted = logits.argmax(-1).view(-1, b)
    return [positions, fit_check((predicted == labels[0])[valid[0]].float().mean().item())]


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, ref, fs, sample, target, validate=validate, runner_class=DominoRunner,
                             decoder_class=BlockDecoder, positions_and_fit=check_positions_and_fit)
