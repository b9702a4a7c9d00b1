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

from pathlib import Path

import torch

from specfoundry.featureset.store import FeatureSet
from specfoundry.gate_checks import Check
from specfoundry.train.dflash.gate import block_gate_checks
from specfoundry.train.dflash.loss import block_inputs, sample_anchors
from specfoundry.train.dflash.options import DFlashOptions
from specfoundry.train.dspark.decode import DSparkDecoder, DSparkRunner, decode_matches_training
from specfoundry.train.dspark.export import validate
from specfoundry.train.dspark.loss import anchor_targets
from specfoundry.train.dspark.options import DSparkOptions
from specfoundry.train.loader import Batch


def gate_options(gate) -> dict:
    """The overfit's options: blocks of k (a DSpark block proposes all of its slots) and a small
    Markov head (the gate's target is small)."""
    return {"dflash": DFlashOptions(block_size=max(2, gate.k)), "dspark": DSparkOptions(markov_rank=32)}


def check_positions_and_fit(runner: DSparkRunner, sample) -> list[Check]:
    model, dcfg = runner.draft, runner.draft.cfg
    device, dtype, b = model.fc.weight.device, model.fc.weight.dtype, dcfg.block_size
    n = len(sample.input_ids)
    batch = Batch(sample.input_ids[None].to(device), sample.loss_mask[None].to(device), sample.aux_hidden[None], None,
                  [n], [0])
    anchors = sample_anchors(sample.loss_mask, n, b, n, 0)[None].to(device)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    worst, same = 0.0, True
    for i in sorted({0, anchors.shape[1] // 2, anchors.shape[1] - 1}):
        a = int(anchors[0, i])
        decoded, trained = decode_matches_training(model, runner.lm_head, sample.input_ids[: a + 1].cpu(),
                                                   sample.aux_hidden[: a + 1].cpu())
        worst = max(worst, ((decoded - trained).abs().max() / trained.abs().max()).item())
        # teacher-forced on the round's proposals, the training forward proposes them again
        same = same and torch.equal(decoded.argmax(-1), trained.argmax(-1))
    with torch.inference_mode():
        ids, positions = block_inputs(batch.input_ids, anchors, b, dcfg.mask_token_id)
        context = model.project_context(sample.aux_hidden[None].to(device, dtype))
        states = model.train_forward(context, ids, positions, anchors, keep, batch.lengths, "sdpa")[0]
        labels, counted, prev = anchor_targets(batch, anchors, keep, b)
        logits = model.step_logits(states, runner.lm_head, prev[0].reshape(-1))
        predicted = logits.argmax(-1).view(-1, b)
    acc = (predicted == labels[0])[counted[0]].float().mean().item()
    ok = worst <= 1e-2 and same
    verb = "equals" if ok else "differs from"
    return [Check("positions", ok, f"the first decoding round (sequential Markov bias) {verb} the training forward "
                  f"teacher-forced on its proposals (max rel diff {worst:.2g}, the same proposals: "
                  f"{'yes' if same else 'no'})"),
            Check("fit", acc >= 0.9, f"the draft predicts {acc:.0%} of the answer's block tokens from the stored "
                  "features" + ("" if acc >= 0.9 else "; train longer (--max-steps) or with another --lr"))]


def gate_checks(gate, export: Path, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, export, fs, sample, target, validate=validate, runner_class=DSparkRunner,
                             decoder_class=DSparkDecoder, positions_and_fit=check_positions_and_fit)
