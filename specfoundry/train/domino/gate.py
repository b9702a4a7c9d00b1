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

from pathlib import Path

import torch

from specfoundry.featureset.store import FeatureSet
from specfoundry.gate_checks import Check
from specfoundry.train.dflash.gate import block_gate_checks
from specfoundry.train.dflash.loss import block_inputs, sample_anchors
from specfoundry.train.dflash.options import DFlashOptions
from specfoundry.train.domino.decode import DominoDecoder, DominoRunner, decode_matches_training
from specfoundry.train.domino.export import validate
from specfoundry.train.domino.loss import shifted_targets
from specfoundry.train.domino.options import DominoOptions
from specfoundry.train.loader import Batch


def gate_options(gate) -> dict:
    """The overfit's options: blocks of k + 1 and a small head (the gate's target is small)."""
    return {"dflash": DFlashOptions(block_size=gate.k + 1), "domino": DominoOptions(gru_hidden_dim=64,
                                                                                   correction_dim=64)}


def check_positions_and_fit(runner: DominoRunner, sample) -> list[Check]:
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
        labels, valid, tokens = shifted_targets(batch, anchors, keep, b)
        rows = states.view(-1, b, states.shape[-1])  # [N, B, H]
        slots = torch.arange(b, device=device).repeat(rows.shape[0])
        logits = model.block_logits(rows.reshape(-1, rows.shape[-1]), runner.lm_head, slots,
                                    tokens[0].repeat_interleave(b, dim=0))
        predicted = logits.argmax(-1).view(-1, b)
    acc = (predicted == labels[0])[valid[0]].float().mean().item()
    ok = worst <= 1e-2 and same
    return [Check("positions", ok, f"the first decoding round (sequential GRU) {'equals' if ok else 'differs from'} "
                  f"the training forward teacher-forced on its proposals (max rel diff {worst:.2g}, the same "
                  f"proposals: {'yes' if same else 'no'})"),
            Check("fit", acc >= 0.9, f"the draft predicts {acc:.0%} of the answer's block tokens from the stored "
                  "features" + ("" if acc >= 0.9 else "; train longer (--max-steps) or with another --lr"))]


def gate_checks(gate, export: Path, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, export, fs, sample, target, validate=validate, runner_class=DominoRunner,
                             decoder_class=DominoDecoder, positions_and_fit=check_positions_and_fit)
