"""The gate's checks of a P-EAGLE draft (gate.py drives the gate; k = the depths drafted), in order:

    vocab map    the export's d2t/t2d are the vocabulary chosen from the feature set's counts
    export       every tensor vLLM's loader reads is there, shaped so, and equals the trained checkpoint's
    mask token   the export's mask_token_id (vLLM's pard_token) is the one the draft was trained with
    layers       the export's layer ids are the trained ones, and the target's features there match the set
    positions    sf-eval's first round (one forward, k depths) equals the training forward of the same
                 rollout (first, middle and last anchor)
    fit          the training forward (every anchor at every depth) predicts the answer's tokens
    decode       greedy decoding of the prompt, k proposals per round: acceptance length >= the bar
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.decoding.target import TargetRunner
from specfoundry.families.eagle3.gate import check_vocab_map
from specfoundry.families.folders import (
    DraftLoadError,
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
from specfoundry.families.peagle.decode import PEagleDecoder, PEagleRunner, decode_matches_training
from specfoundry.families.peagle.export import validate
from specfoundry.families.peagle.loss import every_rollout, pack_batch, pack_row, packed_states
from specfoundry.families.peagle.options import PEagleOptions
from specfoundry.featureset.store import FeatureSet


def gate_options(gate) -> dict:
    """The overfit's options: the gate's vocabulary, k depths, two layers (layer 0 and a plain one),
    and every anchor at every depth (COD ratio 1: one short conversation)."""
    return {"peagle": PEagleOptions(peagle_vocab_size=gate.draft_vocab_size, num_depths=gate.k, peagle_layers=2,
                                    down_sample_ratio=1.0, down_sample_ratio_min=1.0)}


def check_positions(draft, sample) -> Check:
    """The decoder's first round against the training forward, for prefixes ending at the first, a
    middle and the last supervised position."""
    supervised = torch.nonzero(sample.loss_mask).flatten().tolist()
    ends = sorted({max(2, supervised[0]), max(2, supervised[len(supervised) // 2]), len(sample.input_ids)})
    worst, same = 0.0, True
    for end in ends:
        decoded, trained = decode_matches_training(draft, sample.input_ids[:end].cpu(), sample.aux_hidden[:end].cpu())
        worst = max(worst, ((decoded - trained).abs().max() / trained.abs().max()).item())
        same = same and torch.equal(decoded.argmax(-1), trained.argmax(-1))
    ok = worst <= 1e-2 and same
    return Check("positions", ok, f"the first decoding round (one forward, {draft.cfg.num_depths} depths) "
                 f"{'equals' if ok else 'differs from'} the training forward of the same rollout (max rel diff "
                 f"{worst:.2g}, the same proposals: {'yes' if same else 'no'})")


def check_fit(runner: PEagleRunner, sample) -> Check:
    """Teacher-forced: every anchor at every depth (no sampling), element (i, d) against x_{i+2+d}."""
    draft = runner.draft
    n, k = len(sample.input_ids), draft.cfg.num_depths
    kept = every_rollout(sample.loss_mask, n, k)
    device = draft.fc.weight.device
    anchor, depth, real = pack_batch([pack_row(n, kept)], device)
    with torch.inference_mode():
        states = packed_states(draft, sample.input_ids[None].to(device), sample.aux_hidden[None].to(device), anchor,
                               depth, real, "sdpa")[0]
        predicted = runner.draft_to_target[draft.lm_head(states).argmax(-1)].cpu()
    label = (anchor + 2 + depth)[0].cpu()
    inside = label < n
    counted = inside & sample.loss_mask[label.clamp(max=n - 1)].bool()
    acc = (predicted == sample.input_ids[label.clamp(max=n - 1)])[counted].float().mean().item()
    return Check("fit", acc >= 0.9, f"the draft predicts {acc:.0%} of the answer's tokens at every depth from the "
                 "stored features" + ("" if acc >= 0.9 else "; train longer (--max-steps) or with another --lr"))


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    work = Path(gate.output)
    try:
        dcfg, tensors = find_draft_files(ref)
    except DraftLoadError as e:  # a folder vLLM would misread or not load: nothing after it can run
        return [Check("export", False, str(e))]
    checks = [check_vocab_map(dcfg, tensors, fs), check_export(ref.where, dcfg, tensors, work / "train", validate)]
    ckpts = complete_checkpoints(work / "train")
    if not ckpts or not checks[-1].ok:
        return checks
    trained, _ = find_draft_files(locate_draft(ckpts[-1]))
    checks.append(check_trained_setting("mask token", "mask_token_id", dcfg.mask_token_id, trained.mask_token_id))
    checks.append(check_trained_setting("layers", "eagle_aux_hidden_state_layer_ids (ours)", list(dcfg.aux_layer_ids),
                                        list(trained.aux_layer_ids)))
    runner_target = TargetRunner(target, list(dcfg.target_layers))
    try:
        checks.append(check_features(runner_target, fs, sample, "layers"))
        runner = PEagleRunner(load_draft(ref, target.path, target.input_device, target.dtype))
        checks.append(check_positions(runner.draft, sample))
        checks.append(check_fit(runner, sample))
        checks.append(decode_prompt(gate, target, PEagleDecoder(runner, dcfg.num_depths), runner_target, sample,
                                    f"k={dcfg.num_depths}"))
    finally:
        runner_target.remove_hooks()
    return checks
