"""The gate's checks of a DFlash draft (gate.py drives the gate; block k+1), in order:

    export names every tensor SGLang's DFlash loader fills is there, shaped so, and equals the checkpoint's
    mask token   the export's dflash_config.mask_token_id is the id the draft was trained with
    layers       the export's target_layer_ids are the trained ones, and the target's features there
                 match the feature set's
    positions    sf-eval's cached block decoding equals the training forward (first, middle, last anchor)
    fit          the training forward predicts the answer's block tokens at every anchor
    decode       greedy block decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.anchors import block_inputs, sample_anchors, valid_slots
from specfoundry.families.dflash.block import BlockDraftRunner
from specfoundry.families.dflash.decode import DFlashDecoder
from specfoundry.families.dflash.export import validate
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.folders import (
    DraftRef,
    complete_checkpoints,
    find_draft_files,
    load_draft,
    locate_draft,
)
from specfoundry.families.gatekit import (
    Check,
    check_export,
    check_features,
    check_trained_setting,
    decode_prompt,
)
from specfoundry.featureset.batch import Batch
from specfoundry.featureset.store import FeatureSet

GATE_DRAFT_LAYERS = 2
"""The gate's DFlash draft: 2 layers over the default taps (5 target layers; gate.build passes the
stored ones). One conversation needs no more depth to be fitted: on SmolLM2, 2 layers predict every
block token of the answer after the gate's 60 steps, as the default 5 did, and a step does about
two thirds of the default's arithmetic (the rest is the target's lm_head over its vocabulary)."""


def gate_options(gate) -> dict:
    """The overfit's options: blocks of k + 1 (k proposals per round, as the gate's -k), a draft of
    GATE_DRAFT_LAYERS layers."""
    return {"dflash": DFlashOptions(block_size=gate.k + 1, num_draft_layers=GATE_DRAFT_LAYERS)}


def dflash_blocks(sample, dcfg, device):
    """Every anchor of the sample (the training rule, all of them), and its blocks' ids and positions."""
    n = len(sample.input_ids)
    batch = Batch(sample.input_ids[None].to(device), sample.loss_mask[None].to(device), sample.aux_hidden[None], None,
                  [n], [0])
    anchors = sample_anchors(sample.loss_mask, n, dcfg.block_size, n, 0)[None].to(device)
    ids, positions = block_inputs(batch.input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)
    return batch, anchors, ids, positions


def check_positions_and_fit(runner: BlockDraftRunner, sample) -> list[Check]:
    """positions: sf-eval's cached block decoding equals the training forward for the first, a middle
    and the last anchor; fit: the training forward predicts the answer's tokens at every anchor."""
    model, dcfg = runner.draft, runner.draft.cfg
    device, dtype, bsz = model.fc.weight.device, model.fc.weight.dtype, dcfg.block_size
    batch, anchors, ids, positions = dflash_blocks(sample, dcfg, device)
    with torch.inference_mode():
        context = model.project_context(sample.aux_hidden[None].to(device, dtype))
        keep = torch.ones_like(anchors, dtype=torch.bool)
        states = model.train_forward(context, ids, positions, anchors, keep, batch.lengths, "sdpa")[0]
        worst = 0.0
        for n in sorted({0, anchors.shape[1] // 2, anchors.shape[1] - 1}):
            a = int(anchors[0, n])
            runner.reset()
            runner.extend(sample.aux_hidden[:a].to(device))
            decoded = model.decode_block(ids[:, n * bsz:(n + 1) * bsz], positions[:, n * bsz:(n + 1) * bsz],
                                         runner.cache)[0]
            ref = states[n * bsz:(n + 1) * bsz]
            worst = max(worst, ((decoded - ref).abs().max() / ref.abs().max()).item())
        predicted = model.block_logits(states.view(-1, bsz, states.shape[-1])[:, 1:], runner.lm_head).argmax(-1)
    valid = valid_slots(batch, anchors, keep, bsz)[0]  # [N, B-1]
    truth = sample.input_ids.to(device)[(anchors[0, :, None] + torch.arange(1, bsz, device=device)).clamp(
        max=len(sample.input_ids) - 1)]
    acc = (predicted == truth)[valid].float().mean().item()
    return [Check("positions", worst <= 1e-2, f"cached block decoding {'equals' if worst <= 1e-2 else 'differs from'}"
                  f" the training forward on the same context (max rel diff {worst:.2g})"),
            fit_check(acc)]


def fit_check(acc: float) -> Check:
    """fit: the share of the answer's block tokens the training forward predicts, at least 90%."""
    return Check("fit", acc >= 0.9, f"the draft predicts {acc:.0%} of the answer's block tokens from the stored "
                 "features" + ("" if acc >= 0.9 else "; train longer (--max-steps) or with another --lr"))


def sequential_rounds_and_training(runner, sample, decode_matches_training, head: str):
    """For a family whose head runs sequentially in decoding (Domino's GRU, DSpark's Markov bias):
    its first decoding round against the training forward teacher-forced on that round's proposals,
    at the first, a middle and the last anchor, as the positions Check (`head` names the head); and
    the training forward over every anchor: (positions check, batch, anchors, keep, states [N*B, H])."""
    model, dcfg = runner.draft, runner.draft.cfg
    device, dtype = model.fc.weight.device, model.fc.weight.dtype
    batch, anchors, ids, positions = dflash_blocks(sample, dcfg, device)
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
        context = model.project_context(sample.aux_hidden[None].to(device, dtype))
        states = model.train_forward(context, ids, positions, anchors, keep, batch.lengths, "sdpa")[0]
    ok = worst <= 1e-2 and same
    check = Check("positions", ok, f"the first decoding round (sequential {head}) {'equals' if ok else 'differs from'}"
                  f" the training forward teacher-forced on its proposals (max rel diff {worst:.2g}, the same "
                  f"proposals: {'yes' if same else 'no'})")
    return check, batch, anchors, keep, states


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    return block_gate_checks(gate, ref, fs, sample, target, validate=validate, runner_class=BlockDraftRunner,
                             decoder_class=DFlashDecoder, positions_and_fit=check_positions_and_fit)


def block_gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target, *, validate, runner_class, decoder_class,
                      positions_and_fit) -> list[Check]:
    """The gate's checks of a draft on DFlash's backbone (DFlash, Domino, DSpark, DFlash2), in order: its
    export's names (`validate`: the family's spec), the mask token and layers against the trained
    checkpoint, the target's features, `positions_and_fit(runner, sample)` (the family's first
    round against its training forward, and the overfit), and the decoded prompt."""
    work = Path(gate.output)
    dcfg, tensors = find_draft_files(ref)
    ckpts = complete_checkpoints(work / "train")
    export_check = check_export(ref.where, dcfg, tensors, work / "train", validate, "export names")
    if not ckpts or not export_check.ok:  # no trained draft to compare with, or one SGLang would not fill
        return [export_check]
    trained, _ = find_draft_files(locate_draft(ckpts[-1]))
    checks = [export_check,
              check_trained_setting("mask token", "dflash_config.mask_token_id", dcfg.mask_token_id,
                                    trained.mask_token_id),
              check_trained_setting("layers", "dflash_config.target_layer_ids", list(dcfg.target_layer_ids),
                                    list(trained.target_layer_ids))]
    runner_target = TargetRunner(target, list(dcfg.target_layers))
    try:
        checks.append(check_features(runner_target, fs, sample, "layers"))
        runner = runner_class(load_draft(ref, target.path, target.input_device, target.dtype), target.lm_head())
        checks += positions_and_fit(runner, sample)
        checks.append(decode_prompt(gate, target, decoder_class(runner), runner_target, sample,
                                    f"block {dcfg.block_size}"))
    finally:
        runner_target.remove_hooks()
    return checks
