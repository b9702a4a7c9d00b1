"""The gate's checks of an EAGLE-3 draft (gate.py drives the gate), in order:

    vocab map    the export's d2t/t2d are the vocabulary chosen from the feature set's counts
    export       every tensor SGLang expects is there and equals the trained checkpoint's
    features     sf-eval hooks the feature set's layers, and its target features match the set
    positions    the draft's logits through sf-eval's cached decoding equal the training forward
    fit          the draft predicts the conversation's tokens from its features (teacher-forced)
    decode       greedy speculative decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfoundry.decoding.target import TargetRunner
from specfoundry.families.eagle3.chain import DraftRunner
from specfoundry.families.eagle3.decode import Eagle3Decoder, teacher_forced_logits, training_logits
from specfoundry.families.eagle3.export import validate
from specfoundry.families.eagle3.options import Eagle3Options
from specfoundry.families.folders import DraftLoadError, DraftRef, find_draft_files, load_draft
from specfoundry.families.gatekit import Check, check_export, check_features, decode_prompt
from specfoundry.families.vocab import choose_draft_vocab, draft_ids_from_d2t
from specfoundry.featureset.store import FeatureSet


def gate_options(gate) -> dict:
    """The overfit's options: the gate's draft vocabulary, TTT as long as the chain it decodes."""
    return {"eagle3": Eagle3Options(draft_vocab_size=gate.draft_vocab_size, ttt_length=gate.k)}


def check_vocab_map(cfg_draft, tensors: dict, fs: FeatureSet) -> Check:
    expected = choose_draft_vocab(fs.token_counts(), cfg_draft.draft_vocab_size)
    mapped = draft_ids_from_d2t(tensors["d2t"].long())
    wrong = int((mapped != expected).sum())
    t2d_ok = torch.equal(tensors["t2d"].nonzero().flatten(), expected)
    if wrong or not t2d_ok:
        return Check("vocab map", False, f"the export's d2t sends {wrong} of {len(expected)} draft ids to other target "
                     f"tokens than the feature set's vocabulary{'' if t2d_ok else ', and its t2d marks other tokens'}")
    return Check("vocab map", True, f"d2t/t2d equal the feature set's {len(expected)}-token vocabulary")


def check_positions(runner: DraftRunner, sample, cached: torch.Tensor) -> Check:
    training = training_logits(runner.draft, sample.input_ids, sample.aux_hidden)
    err = ((training - cached).abs().max() / training.abs().max()).item()
    if err > 1e-2:
        return Check("positions", False, f"the draft's logits through sf-eval's cached decoding differ from the "
                     f"training forward on the same features (max rel diff {err:.3g}): positions or cache disagree")
    return Check("positions", True, f"cached decoding equals the training forward (max rel diff {err:.2g})")


def check_fit(runner: DraftRunner, sample, cached: torch.Tensor, history: list[dict]) -> Check:
    # row i predicts x_{i+2}; it counts where x_{i+2} is an assistant token
    predicted = runner.draft_to_target[cached.argmax(-1)][:-1].cpu()
    truth = sample.input_ids[2:]
    mask = sample.loss_mask[2:].bool()
    acc = (predicted[mask] == truth[mask]).float().mean().item()
    train_acc = history[-1].get("acc_0") if history else None
    if acc < 0.9:
        return Check("fit", False, f"the draft predicts only {acc:.0%} of the answer's tokens from the stored features "
                     f"(training reported acc_0 {train_acc}); train longer (--max-steps) or with another --lr")
    return Check("fit", True, f"teacher-forced accuracy {acc:.0%} (training acc_0 {train_acc})")


def gate_checks(gate, ref: DraftRef, fs: FeatureSet, sample, target) -> list[Check]:
    work = Path(gate.output)
    try:
        cfg_draft, tensors = find_draft_files(ref)
    except DraftLoadError as e:  # a folder an engine would misread or not load: nothing after it can run
        return [Check("export", False, str(e))]
    checks = [check_vocab_map(cfg_draft, tensors, fs), check_export(ref.where, cfg_draft, tensors, work / "train", validate)]
    runner_target = TargetRunner(target, list(cfg_draft.target_layers))
    try:
        checks.append(check_features(runner_target, fs, sample))
        runner = DraftRunner(load_draft(ref, target.path, target.input_device, target.dtype))
        cached = teacher_forced_logits(runner, sample.input_ids, sample.aux_hidden)
        checks.append(check_positions(runner, sample, cached))
        history_path = work / "train" / "history.json"
        history = json.loads(history_path.read_text()) if history_path.exists() else []
        checks.append(check_fit(runner, sample, cached, history))
        checks.append(decode_prompt(gate, target, Eagle3Decoder(runner, gate.k), runner_target, sample,
                                    f"k={gate.k}"))
    finally:
        runner_target.remove_hooks()
    return checks
