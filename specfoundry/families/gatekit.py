"""What every family's gate checks share (gate.py drives the gate; each family's checks live in its
folder, families/<name>/gate.py, and are reached through the catalogue).

A check is named after the stage it vouches for; the gate reports the first one that fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specfoundry.conversations.records import ChatMessages
from specfoundry.conversations.sources import load_conversations
from specfoundry.conversations.templates import prompt_ids
from specfoundry.decoding.rounds import DecodeResult
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.folders import complete_checkpoints, find_draft_files, locate_draft
from specfoundry.featureset.store import FeatureSet, median_row_error


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_export(export: Path, cfg_draft, tensors: dict, run_dir: Path, validate, name: str = "export") -> Check:
    """The export holds exactly the names its engine's loader fills (`validate`), each equal to the
    run's last checkpoint's."""
    try:
        validate(tensors, cfg_draft)
    except ValueError as e:
        return Check(name, False, str(e))
    ckpts = complete_checkpoints(run_dir)
    if not ckpts:
        return Check(name, False, f"no checkpoint in {run_dir} to compare the export with")
    _, trained = find_draft_files(locate_draft(ckpts[-1]))
    for tensor, t in tensors.items():
        ref = trained.get(tensor)
        if ref is None or not torch.allclose(t.float(), ref.to(t.dtype).float()):
            return Check(name, False, f"export tensor {tensor} is not the trained checkpoint's {ckpts[-1].name} "
                         "(renamed, transposed or from another run)")
    return Check(name, True, f"{len(tensors)} tensors with SGLang's names equal {ckpts[-1].name}")


def check_features(target: TargetRunner, fs: FeatureSet, sample, name: str = "features") -> Check:
    """sf-eval taps the feature set's layers, and the target's features there are the stored ones."""
    held = list(fs.manifest["aux_layer_ids"])
    if target.aux_layers != held:
        return Check(name, False, f"sf-eval reads the target's layers {target.aux_layers} (the draft's config) "
                     f"but the feature set holds layers {held}, which the draft was trained on")
    target.reset()
    _, aux, final = target.forward(sample.input_ids.tolist(), want_hidden=True)
    worst = 0.0
    for kind, got, stored, layers in (("aux", aux, sample.aux_hidden, held), ("final", final, sample.final_hidden,
                                                                               ["final"])):
        errors = median_row_error(got.cpu(), stored, len(layers))  # [layers]: each token's error, its median
        err, where = errors.max().item(), layers[int(errors.argmax())]
        worst = max(worst, err)
        if err > 0.03:  # stored in bf16 (2^-8 relative) and maybe by another dtype/kernel: allow a little more
            return Check(name, False, f"the target's {kind} hidden states now differ from the feature set's at "
                         f"layer {where} by {err:.3f} (a token's relative error, the median): another model, "
                         "layers or chat template?")
    return Check(name, True, f"layers {held}; stored features match the target's (median rel err a token at most "
                 f"{worst:.4f})")


def check_trained_setting(name: str, field: str, exported, trained) -> Check:
    """The export's `field` (what SGLang will use) against the value the draft was trained with."""
    if exported != trained:
        return Check(name, False, f"the export's {field} {exported} is not the {trained} the draft was trained with")
    return Check(name, True, f"{field} {exported}, as trained")


def gate_prompt(work: Path, tokenizer, sample=None) -> list[int]:
    """The prompt (its regenerated answer left out) of the gate conversation `sample` was captured
    from, as token ids, rendered in that conversation's mode: the one whose prompt its tokens begin
    with (the gate holds one conversation per mode of the template); the first without a sample."""
    prompts = []
    for conv in load_conversations(work / "regen").conversations:
        messages = conv.to_messages()
        prompts.append(prompt_ids(tokenizer, ChatMessages(messages[:-1], messages.tools, messages.template_kwargs)))
    if sample is None:
        return prompts[0]
    ids = sample.input_ids.tolist()
    found = [p for p in prompts if ids[: len(p)] == p]
    if not found:
        raise ValueError("no gate conversation's prompt begins the captured sample: the regen and capture of the "
                         "gate's run disagree (rerun into a new folder)")
    return max(found, key=len)


def decode_check(bar: float, result: DecodeResult, shape: str) -> Check:
    length = result.accept_length
    ok = length >= bar
    return Check("decode", ok, f"acceptance length {length:.2f} at {shape} over {result.rounds} rounds "
                 f"({'>=' if ok else '<'} the bar {bar:.2f})"
                 + ("" if ok else ": where every check before it passed, the draft's steps past the first "
                    "(positions, its own states) disagree with training"))


def decode_prompt(gate, target, decoder, runner_target: TargetRunner, sample, shape: str) -> Check:
    """Greedy decoding of the gate's prompt with the family's decoder, against the bar."""
    result = decoder.generate(runner_target, gate_prompt(Path(gate.output), target.tokenizer, sample),
                              max_new_tokens=int(sample.loss_mask.sum()), eos=set(target.end_of_turn_ids()),
                              sampler=Sampler())
    return decode_check(gate.bar, result, shape)
