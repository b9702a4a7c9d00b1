"""The consistency gate (sf-eval gate): the one module that drives every stage.

A training-serving consistency check on one overfitted conversation.

Through the same library calls as the public commands it answers one prompt greedily with the
target (sf-regen --greedy), captures it (sf-capture), trains a draft on it alone for a bounded
number of steps (sf-train) and exports it. A draft that has memorised the target's own greedy
answer must then be accepted almost every time when sf-eval decodes that prompt. When it is
not, the checks below say which stage disagrees, in this order (the first failure is named):

    vocab map    the export's d2t/t2d are the vocabulary chosen from the feature set's counts
    export       every tensor SGLang expects is there and equals the trained checkpoint's
    features     sf-eval hooks the feature set's layers, and its target features match the set
    positions    the draft's logits through sf-eval's cached decoding equal the training forward
    fit          the draft predicts the conversation's tokens from its features (teacher-forced)
    decode       greedy speculative decoding of the prompt: acceptance length >= the bar

For a DFlash draft (--family dflash, block k+1) the checks are its own, in this order:

    export names every tensor SGLang's DFlash loader fills is there, shaped so, and equals the checkpoint's
    mask token   the export's dflash_config.mask_token_id is the id the draft was trained with
    layers       the export's target_layer_ids are the trained ones, and the target's features there
                 match the feature set's
    positions    sf-eval's cached block decoding equals the training forward (first, middle, last anchor)
    fit          the training forward predicts the answer's block tokens at every anchor
    decode       greedy block decoding of the prompt: acceptance length >= the bar
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.common.cli import MAX_DRAFT, MAX_TOKENS, Range, Settings, setting, shared
from specfoundry.common.conversations import load_conversations
from specfoundry.common.placement import Placement
from specfoundry.common.shards import record_config
from specfoundry.common.target import EMBEDDED_DEFAULT, Target, resolve_target
from specfoundry.eval.block import BlockDraftRunner, block_generate
from specfoundry.eval.draft import DraftLoadError, find_draft_files, load_draft
from specfoundry.eval.evaluate import one_copy, prompt_ids
from specfoundry.eval.speculative import DraftRunner, Sampler, TargetRunner, speculative_generate
from specfoundry.featureset.store import FeatureSet
from specfoundry.generate.backend import SamplingConfig
from specfoundry.generate.hf_backend import HFBackend
from specfoundry.generate.regen import RegenConfig, run_regen
from specfoundry.train.dflash.export import validate as validate_dflash
from specfoundry.train.dflash.loss import block_inputs, sample_anchors, valid_slots
from specfoundry.train.dflash.options import DFlashOptions
from specfoundry.train.eagle3.config import Eagle3Options
from specfoundry.train.eagle3.export import validate as validate_eagle3
from specfoundry.train.eagle3.model import TTTCache
from specfoundry.train.family import family_names
from specfoundry.train.loader import Batch
from specfoundry.train.trainer import TrainConfig, complete_checkpoints, run_train
from specfoundry.train.vocab import choose_draft_vocab, draft_ids_from_d2t

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


@dataclass(frozen=True, kw_only=True)
class GateConfig(Settings):
    """Settings of one gate run (recorded in gate_config.json in its folder)."""

    output: str = shared("output", resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    family: str = shared("family", "eagle3", choices=family_names())
    prompt: str = setting(DEFAULT_PROMPT, help="The one prompt whose greedy answer the draft overfits.")
    # the length cap of the target's greedy answer
    max_new_tokens: int = shared("max_new_tokens", 96)
    # also the TTT length trained (EAGLE-3), or the block's proposals (DFlash: block_size k+1)
    k: int = shared("draft_tokens", 4)
    max_steps: int = shared("max_steps", 200)
    lr: float = setting(3e-3, valid=Range(0, 1, min_open=True), help="Learning rate of the overfit.")
    draft_vocab_size: int = setting(1024, valid=Range(1, MAX_TOKENS), help="Draft vocabulary of the overfit draft.")
    min_accept_length: float | None = setting(None, resume=False, shown="0.8*(k+1)", valid=Range(1, MAX_DRAFT + 1),
                                              help="Bar of the decode check, at most k+1 (a round accepts at most "
                                                   "k drafted tokens and the target's own).")
    export: str | None = setting(None, resume=False, help="Check this exported draft against the gate's run "
                                 "instead of the run's own export.")
    device: str | None = shared("device", None, resume=False)
    placement: Placement = Placement()

    def __post_init__(self):
        super().__post_init__()
        if self.min_accept_length is not None and self.min_accept_length > self.k + 1:
            raise ValueError(f"--min-accept-length {self.min_accept_length:g} can never be reached: a round accepts "
                             f"at most k + 1 = {self.k + 1} tokens")

    @property
    def bar(self) -> float:
        return self.min_accept_length if self.min_accept_length is not None else 0.8 * (self.k + 1)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def load_gate_target(cfg: GateConfig) -> Target:
    """The target, loaded once for every stage of the gate (regen, capture, the checks)."""
    target = Target.load(cfg.target, device=cfg.device, placement=cfg.placement, chat_template=cfg.chat_template,
                         command="sf-eval gate")
    one_copy(target, "sf-eval gate")
    return target


def build(cfg: GateConfig, target: Target | None = None, silent: bool = True) -> Path:
    """Regen, capture and train the one-conversation run; every stage resumes. Returns the export."""
    work = Path(cfg.output)
    resolve_target(cfg.target)  # a bad target is refused before the folder records it
    target = target or load_gate_target(cfg)
    if target.is_writer:
        record_config(work, "gate", cfg)
        # the answer here is a placeholder: sf-regen replaces it with the target's greedy answer
        (work / "prompt.jsonl").write_text(json.dumps({"id": "gate", "messages": [
            {"role": "user", "content": cfg.prompt}, {"role": "assistant", "content": "-"}]}) + "\n")
    target.ranks.group_barrier()
    run_regen(RegenConfig(output=str(work / "regen"), source=str(work / "prompt.jsonl"), target=cfg.target,
                          chat_template=cfg.chat_template, batch_size=1, shard_size=1,
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=cfg.max_new_tokens)),
              HFBackend(target, batch_size=1), silent=silent)
    run_capture(CaptureConfig(source=str(work / "regen"), output=str(work / "features"), target=cfg.target,
                              chat_template=cfg.chat_template, shard_size=1, device=cfg.device,
                              families=(cfg.family,)), silent=silent, target=target)
    train = TrainConfig(featureset=str(work / "features"), output=str(work / "train"), target=cfg.target,
                        family=cfg.family, eagle3=Eagle3Options(draft_vocab_size=cfg.draft_vocab_size, ttt_length=cfg.k),
                        dflash=DFlashOptions(block_size=cfg.k + 1), lr=cfg.lr, warmup_steps=10,
                        max_steps=cfg.max_steps, eval_fraction=0.0, save_every=cfg.max_steps, keep_last=1,
                        num_workers=0, loss="auto" if target.input_device.type == "cuda" else "reference",
                        log_every=10**9)
    if target.ranks.world == 1:
        export = Path(run_train(train, silent=silent)["export"])
    else:  # the draft trains on one process: the writer, in a process of its own (outside the launch)
        export = Path(train_alone(train, silent) if target.is_writer else "")
        export = Path(target.ranks.from_writer(str(export)))
    return export


def train_alone(train: TrainConfig, silent: bool) -> str:
    """sf-train in a child process outside this torchrun launch (whose ranks would otherwise join
    its data parallelism), as the public command runs it; returns the export folder."""
    import os
    import subprocess
    import sys

    from specfoundry.common.cli import config_dict

    recipe = Path(train.output).with_suffix(".recipe.json")
    flat = {k: v for k, v in config_dict(train).items() if not isinstance(v, dict)}
    flat.update(config_dict(getattr(train, train.family)))
    flat = {k: v for k, v in flat.items() if v is not None}
    recipe.write_text(json.dumps({"train": flat}))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    subprocess.run([sys.executable, "-m", "specfoundry.train.cli", "run", "--recipe", str(recipe)]
                   + (["--silent"] if silent else []), check=True, env=env)
    return str(Path(train.output) / "export")


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")


def check_vocab_map(cfg_draft, tensors: dict, fs: FeatureSet) -> Check:
    expected = choose_draft_vocab(fs.token_counts(), cfg_draft.draft_vocab_size)
    mapped = draft_ids_from_d2t(tensors["d2t"].long())
    wrong = int((mapped != expected).sum())
    t2d_ok = torch.equal(tensors["t2d"].nonzero().flatten(), expected)
    if wrong or not t2d_ok:
        return Check("vocab map", False, f"the export's d2t sends {wrong} of {len(expected)} draft ids to other target "
                     f"tokens than the feature set's vocabulary{'' if t2d_ok else ', and its t2d marks other tokens'}")
    return Check("vocab map", True, f"d2t/t2d equal the feature set's {len(expected)}-token vocabulary")


def check_export(export: Path, cfg_draft, tensors: dict, run_dir: Path, validate=validate_eagle3,
                 name: str = "export") -> Check:
    try:
        validate(tensors, cfg_draft)
    except ValueError as e:
        return Check(name, False, str(e))
    ckpts = complete_checkpoints(run_dir)
    if not ckpts:
        return Check(name, False, f"no checkpoint in {run_dir} to compare the export with")
    _, trained = find_draft_files(ckpts[-1])
    for tensor, t in tensors.items():
        ref = trained.get(tensor)
        if ref is None or not torch.allclose(t.float(), ref.to(t.dtype).float()):
            return Check(name, False, f"export tensor {tensor} is not the trained checkpoint's {ckpts[-1].name} "
                         "(renamed, transposed or from another run)")
    return Check(name, True, f"{len(tensors)} tensors with SGLang's names equal {ckpts[-1].name}")


def check_features(target: TargetRunner, fs: FeatureSet, sample, name: str = "features") -> Check:
    held = list(fs.manifest["aux_layer_ids"])
    if target.aux_layers != held:
        return Check(name, False, f"sf-eval reads the target's layers {target.aux_layers} (the draft's config) "
                     f"but the feature set holds layers {held}, which the draft was trained on")
    target.reset()
    _, aux, final = target.forward(sample.input_ids.tolist(), want_hidden=True)
    worst = 0.0
    for kind, got, stored in (("aux", aux, sample.aux_hidden), ("final", final, sample.final_hidden)):
        err = ((got.float().cpu() - stored.float()).abs().max() / stored.float().abs().max().clamp(min=1e-6)).item()
        worst = max(worst, err)
        if err > 0.03:  # stored in bf16 (2^-8 relative) and maybe by another dtype/kernel: allow a little more
            return Check(name, False, f"the target's {kind} hidden states now differ from the feature set's by "
                         f"{err:.3f} (relative to the largest): another model, layers or chat template?")
    return Check(name, True, f"layers {held}; stored features match the target's (max rel err {worst:.4f})")


def teacher_forced_logits(draft: DraftRunner, sample) -> torch.Tensor:
    """Step-0 logits [n-1, Vd] for the whole sample through sf-eval's cached path."""
    draft.reset()
    ids = sample.input_ids.tolist()
    device = draft.draft.fc.weight.device
    return draft.extend(ids[1:], sample.aux_hidden[:-1].to(device))


def check_positions(draft: DraftRunner, sample, cached: torch.Tensor) -> Check:
    model = draft.draft
    device, dtype = model.fc.weight.device, model.fc.weight.dtype
    n = len(sample.input_ids)
    with torch.inference_mode():
        ids = sample.input_ids[1:].to(device)[None]  # training's step 0: token x_{i+1} at position i
        hidden = model.project(sample.aux_hidden[:-1].to(device, dtype)[None])
        _, normed = model.ttt_forward(ids, hidden, torch.arange(n - 1, device=device)[None], TTTCache(), [n - 1], 0,
                                       "sdpa")
        training = model.lm_head(normed)[0].float()
    err = ((training - cached).abs().max() / training.abs().max()).item()
    if err > 1e-2:
        return Check("positions", False, f"the draft's logits through sf-eval's cached decoding differ from the "
                     f"training forward on the same features (max rel diff {err:.3g}): positions or cache disagree")
    return Check("positions", True, f"cached decoding equals the training forward (max rel diff {err:.2g})")


def check_fit(draft: DraftRunner, sample, cached: torch.Tensor, history: list[dict]) -> Check:
    # row i predicts x_{i+2}; it counts where x_{i+2} is an assistant token
    predicted = draft.draft_to_target[cached.argmax(-1)][:-1].cpu()
    truth = sample.input_ids[2:]
    mask = sample.loss_mask[2:].bool()
    acc = (predicted[mask] == truth[mask]).float().mean().item()
    train_acc = history[-1].get("acc_0") if history else None
    if acc < 0.9:
        return Check("fit", False, f"the draft predicts only {acc:.0%} of the answer's tokens from the stored features "
                     f"(training reported acc_0 {train_acc}); train longer (--max-steps) or with another --lr")
    return Check("fit", True, f"teacher-forced accuracy {acc:.0%} (training acc_0 {train_acc})")


def check_trained_setting(name: str, field: str, exported, trained) -> Check:
    """The export's `field` (what SGLang will use) against the value the draft was trained with."""
    if exported != trained:
        return Check(name, False, f"the export's {field} {exported} is not the {trained} the draft was trained with")
    return Check(name, True, f"{field} {exported}, as trained")


def dflash_blocks(sample, dcfg, device):
    """Every anchor of the sample (the training rule, all of them), and its blocks' ids and positions."""
    n = len(sample.input_ids)
    batch = Batch(sample.input_ids[None].to(device), sample.loss_mask[None].to(device), sample.aux_hidden[None], None,
                  [n], [0])
    anchors = sample_anchors(sample.loss_mask, n, dcfg.block_size, n, 0)[None].to(device)
    ids, positions = block_inputs(batch.input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)
    return batch, anchors, ids, positions


def check_dflash_positions_and_fit(runner: BlockDraftRunner, sample) -> list[Check]:
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
        predicted = (states.view(-1, bsz, states.shape[-1])[:, 1:] @ runner.lm_head.T.to(dtype)).argmax(-1)
    valid = valid_slots(batch, anchors, keep, bsz)[0]  # [N, B-1]
    truth = sample.input_ids.to(device)[(anchors[0, :, None] + torch.arange(1, bsz, device=device)).clamp(
        max=len(sample.input_ids) - 1)]
    acc = (predicted == truth)[valid].float().mean().item()
    checks = [Check("positions", worst <= 1e-2, f"cached block decoding {'equals' if worst <= 1e-2 else 'differs from'}"
                    f" the training forward on the same context (max rel diff {worst:.2g})")]
    checks.append(Check("fit", acc >= 0.9, f"the draft predicts {acc:.0%} of the answer's block tokens from the "
                        "stored features" + ("" if acc >= 0.9 else "; train longer (--max-steps) or with another --lr")))
    return checks


def run_dflash_checks(cfg: GateConfig, export: Path, fs: FeatureSet, sample, target: Target) -> list[Check]:
    work = Path(cfg.output)
    dcfg, tensors = find_draft_files(export)
    ckpts = complete_checkpoints(work / "train")
    export_check = check_export(export, dcfg, tensors, work / "train", validate_dflash, "export names")
    if not ckpts or not export_check.ok:  # no trained draft to compare with, or one SGLang would not fill
        return [export_check]
    trained, _ = find_draft_files(ckpts[-1])
    checks = [export_check,
              check_trained_setting("mask token", "dflash_config.mask_token_id", dcfg.mask_token_id,
                                    trained.mask_token_id),
              check_trained_setting("layers", "dflash_config.target_layer_ids", list(dcfg.target_layer_ids),
                                    list(trained.target_layer_ids))]
    runner_target = TargetRunner(target, list(dcfg.target_layer_ids))
    try:
        checks.append(check_features(runner_target, fs, sample, "layers"))
        draft = load_draft(export, target.path, target.input_device, target.dtype)
        runner = BlockDraftRunner(draft, target.lm_head())
        checks += check_dflash_positions_and_fit(runner, sample)
        conv = load_conversations(work / "regen").conversations[0].to_messages()
        result = block_generate(runner_target, runner, prompt_ids(target.tokenizer, conv[:-1]),
                                max_new_tokens=int(sample.loss_mask.sum()), eos=set(target.end_of_turn_ids()),
                                sampler=Sampler())
        checks.append(decode_check(cfg, result, f"block {dcfg.block_size}"))
    finally:
        runner_target.remove_hooks()
    return checks


def decode_check(cfg: GateConfig, result, shape: str) -> Check:
    length = result.accept_length
    ok = length >= cfg.bar
    return Check("decode", ok, f"acceptance length {length:.2f} at {shape} over {result.rounds} rounds "
                 f"({'>=' if ok else '<'} the bar {cfg.bar:.2f})"
                 + ("" if ok else ": every earlier check agrees, so the draft's steps past the first (positions, "
                    "its own states) disagree with training"))


def run_checks(cfg: GateConfig, export: Path, target: Target | None = None) -> list[Check]:
    work = Path(cfg.output)
    target = target or load_gate_target(cfg)
    fs = FeatureSet(work / "features")
    sample = fs[0]
    if cfg.family == "dflash":
        return run_dflash_checks(cfg, export, fs, sample, target)
    try:
        cfg_draft, tensors = find_draft_files(export)
    except DraftLoadError as e:  # a folder an engine would misread or not load: nothing after it can run
        return [Check("export", False, str(e))]
    checks = [check_vocab_map(cfg_draft, tensors, fs), check_export(export, cfg_draft, tensors, work / "train")]
    runner_target = TargetRunner(target, list(cfg_draft.aux_layer_ids))
    try:
        checks.append(check_features(runner_target, fs, sample))
        runner = DraftRunner(load_draft(export, target.path, target.input_device, target.dtype))
        cached = teacher_forced_logits(runner, sample)
        checks.append(check_positions(runner, sample, cached))
        history_path = work / "train" / "history.json"
        history = json.loads(history_path.read_text()) if history_path.exists() else []
        checks.append(check_fit(runner, sample, cached, history))
        conv = load_conversations(work / "regen").conversations[0].to_messages()
        answer = int(sample.loss_mask.sum())
        result = speculative_generate(runner_target, runner, prompt_ids(target.tokenizer, conv[:-1]), k=cfg.k,
                                      max_new_tokens=answer, eos=set(target.end_of_turn_ids()), sampler=Sampler())
        checks.append(decode_check(cfg, result, f"k={cfg.k}"))
    finally:
        runner_target.remove_hooks()
    return checks


def verdict(checks: list[Check]) -> tuple[bool, str]:
    failed = [c for c in checks if not c.ok]
    if not failed:
        return True, "gate passed: " + next(c.detail for c in checks if c.name == "decode")
    return False, f"gate failed at {failed[0].name}: {failed[0].detail}"


def run_gate(cfg: GateConfig, silent: bool = True) -> tuple[list[Check], bool, str]:
    """Build the one-conversation run (resuming what exists), check it: (checks, passed, verdict).
    The target is loaded once, for every stage."""
    resolve_target(cfg.target)  # a bad target is refused before anything loads
    target = load_gate_target(cfg)
    export = build(cfg, target, silent=silent)
    checks = run_checks(cfg, export if cfg.export is None else Path(cfg.export), target)
    return (checks, *verdict(checks))
