"""The consistency gate (sf-eval gate): the one module that drives every stage.

A training-serving consistency check on one overfitted conversation.

Through the same library calls as the public commands it answers one prompt greedily with the
target (sf-regen --greedy), captures it (sf-capture), trains a draft of --family on it alone for
a bounded number of steps (sf-train) and exports it. A draft that has memorised the target's own
greedy answer must then be accepted almost every time when sf-eval decodes that prompt. When it
is not, the family's checks say which stage disagrees; the first failure is named. Each family
supplies its checks (families/<name>/gate.py, through the catalogue in families/__init__.py; the pieces they
share are in families/gatekit.py), ending with its decode check (docs/families.md lists each
family's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import click

from specfoundry.capture.stage import CaptureConfig, run_capture, stored_layers
from specfoundry.common.cli import resolve_config, stage_command
from specfoundry.common.placement import FUSED_EXPERTS, Placement, launch_env
from specfoundry.common.settings import (
    MAX_DRAFT,
    MAX_TOKENS,
    Range,
    Settings,
    config_dict,
    resume_settings,
    setting,
    shared,
)
from specfoundry.common.shards import record_config
from specfoundry.common.target import EMBEDDED_DEFAULT, Target
from specfoundry.conversations.sources import load_conversations
from specfoundry.eval.cli import FAILURES
from specfoundry.eval.evaluate import one_copy
from specfoundry.eval.prompts import mode_label
from specfoundry.families import FAMILIES, family_names
from specfoundry.families.folders import DraftLoadError, locate_draft
from specfoundry.families.gatekit import Check
from specfoundry.featureset.store import FeatureSet
from specfoundry.generate.backends.hf import HFBackend
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.regen import RegenConfig, run_regen
from specfoundry.train.trainer import TrainConfig, run_train

__all__ = ["Check", "GateConfig", "build", "gate", "run_checks", "run_gate", "verdict"]

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


@dataclass(frozen=True, kw_only=True)
class GateConfig(Settings):
    """Settings of one gate run (recorded in gate_config.json in its folder)."""

    output: str = shared("output", resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    family: str = shared("family", FAMILIES.default, choices=family_names(), help=FAMILIES.family_help())
    prompt: str = setting(DEFAULT_PROMPT, help="The one prompt whose greedy answer the draft overfits.")
    # the length cap of the target's greedy answer
    max_new_tokens: int = shared("max_new_tokens", 96)
    # what the draft is trained to propose per round (the catalogue's gate_k: TTT steps, a block of k+1, K depths)
    k: int = shared("draft_tokens", 4, help=FAMILIES.draft_tokens_help())
    max_steps: int = shared("max_steps", 200)
    lr: float = setting(3e-3, valid=Range(0, 1, min_open=True), help="Learning rate of the overfit.")
    draft_vocab_size: int = setting(1024, valid=Range(1, MAX_TOKENS), help="Draft vocabulary of the overfit draft.")
    min_accept_length: float | None = setting(None, resume=False, shown="0.8*(k+1)", valid=Range(1, MAX_DRAFT + 1),
                                              help="Bar of the decode check, at most k+1 (a round accepts at most "
                                                   "k drafted tokens and the target's own).")
    export: str | None = setting(None, resume=False, shown="the run's own export",
                                 help="Check this exported draft against the gate's run instead of the run's own "
                                      "export.")
    device: str | None = shared("device", None, resume=False)
    placement: Placement = Placement()

    def __post_init__(self):
        super().__post_init__()
        FAMILIES.get(self.family)  # an unknown name is refused before any stage runs
        if self.min_accept_length is not None and self.min_accept_length > self.k + 1:
            raise ValueError(f"--min-accept-length {self.min_accept_length:g} can never be reached: a round accepts "
                             f"at most k + 1 = {self.k + 1} tokens")

    @property
    def bar(self) -> float:
        return self.min_accept_length if self.min_accept_length is not None else 0.8 * (self.k + 1)


def load_gate_target(cfg: GateConfig) -> Target:
    """The target, loaded once for every stage of the gate (regen, capture, the checks)."""
    from specfoundry.kernels.fused_moe import register_fused_experts

    register_fused_experts(FUSED_EXPERTS)  # so that --experts-implementation can name it
    target = Target.load(cfg.target, device=cfg.device, placement=cfg.placement, chat_template=cfg.chat_template,
                         command="sf-eval gate",
                         settings=resume_settings(cfg))
    one_copy(target, "sf-eval gate")
    return target


MODE_SWITCHES = ({"enable_thinking": False},)
"""Chat-template arguments that put a template in another serving mode (Qwen3's non-thinking)."""


def template_modes(tokenizer) -> list[dict]:
    """The modes the gate checks: the template's default, and each of MODE_SWITCHES that renders
    the generation prompt otherwise (a template without modes ignores the argument)."""
    probe = [{"role": "user", "content": "?"}]
    try:
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        return [{}] + [dict(m) for m in MODE_SWITCHES
                       if tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, **m) != plain]
    except Exception:  # noqa: BLE001 - a template that cannot render the probe has no modes to try
        return [{}]


def build(cfg: GateConfig, target: Target | None = None, silent: bool = True) -> Path:
    """Regen, capture and train the one-conversation run; every stage resumes. Returns the export."""
    work = Path(cfg.output)
    target = target or load_gate_target(cfg)  # a bad target is refused before the folder records it
    if target.is_writer:
        record_config(work, "gate", replace(cfg, placement=target.placement))  # as it runs
        # the answer here is a placeholder: sf-regen replaces it with the target's greedy answer;
        # one conversation per mode of the template, each regenerated and captured in its own
        rows = [{"id": f"gate [{mode_label(kwargs)}]" if kwargs else "gate",
                 "messages": [{"role": "user", "content": cfg.prompt}, {"role": "assistant", "content": "-"}],
                 **({"mode": {"chat_template_kwargs": kwargs, "reasoning": "keep"}} if kwargs else {})}
                for kwargs in template_modes(target.tokenizer)]
        (work / "prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target.ranks.group_barrier()
    run_regen(RegenConfig(output=str(work / "regen"), source=str(work / "prompt.jsonl"), target=cfg.target,
                          chat_template=cfg.chat_template, batch_size=1, shard_size=1,
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=cfg.max_new_tokens)),
              HFBackend(target, batch_size=1), silent=silent)
    capture = CaptureConfig(source=str(work / "regen"), output=str(work / "features"), target=cfg.target,
                            chat_template=cfg.chat_template, shard_size=1, device=cfg.device, families=(cfg.family,))
    run_capture(capture, silent=silent, target=target)
    # the draft reads every layer the capture stored (the family's default taps), however many
    # layers of its own the family's gate options give it
    stored = tuple(stored_layers(capture, target.config.num_hidden_layers))
    train = TrainConfig(featureset=str(work / "features"), output=str(work / "train"), target=cfg.target,
                        family=cfg.family, layers=stored, **FAMILIES.provider(cfg.family).gate_options(cfg), lr=cfg.lr,
                        warmup_steps=10,
                        max_steps=cfg.max_steps, eval_fraction=0.0, save_every=cfg.max_steps, keep_last=1,
                        num_workers=0, loss_kernel="auto" if target.input_device.type == "cuda" else "reference",
                        log_every=10**9)
    if target.ranks.world == 1:
        export = Path(run_train(train, silent=silent, target_dir=target.path)["export"])
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

    recipe = Path(train.output).with_suffix(".recipe.json")
    flat = {k: v for k, v in config_dict(train).items() if not isinstance(v, dict)}
    for family in FAMILIES.chain(train.family):  # the groups the family reads: its own and its parents'
        flat.update(config_dict(getattr(train, family.name)))
    flat = {k: v for k, v in flat.items() if v is not None}
    recipe.write_text(json.dumps({"train": flat}))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    subprocess.run([sys.executable, "-m", "specfoundry.train.cli", "run", "--recipe", str(recipe)]
                   + (["--silent"] if silent else []), check=True, env=env)
    return str(Path(train.output) / "export")


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")


def run_checks(cfg: GateConfig, export: Path, target: Target | None = None) -> list[Check]:
    """The family's checks of `export` against the gate's run (the first failure is the verdict)."""
    try:
        ref = locate_draft(export)
    except DraftLoadError as e:  # a folder an engine would misread or not load: nothing after it can run
        return [Check("export", False, str(e))]
    if ref.family != cfg.family:
        return [Check("export", False, f"{export} is a draft of family {ref.family}; the gate trained {cfg.family}")]
    vocab = getattr(ref.config, "draft_vocab_size", None)  # (EAGLE-3's, P-EAGLE's; the block drafters use the target's)
    if vocab is not None and vocab != cfg.draft_vocab_size:  # its checks would compare tensors of other shapes
        return [Check("export", False, f"{export} has a draft vocabulary of {vocab} tokens, the gate's run "
                                       f"{cfg.draft_vocab_size}: pass --draft-vocab-size {vocab} and a new -o folder to gate it")]
    target = target or load_gate_target(cfg)
    fs = FeatureSet(Path(cfg.output) / "features")
    ref = ref.for_target(target.config.num_hidden_layers)
    if len(fs) == 1:
        return ref.provider.gate_checks(cfg, ref, fs, fs[0], target)
    # one conversation per mode of the template (build): each one's checks, named by its mode
    modes = [c.id for c in load_conversations(Path(cfg.output) / "regen").conversations]
    checks = []
    for i, mode in enumerate(modes):
        label = mode.removeprefix("gate").strip() or "[default]"
        checks += [replace(c, name=f"{c.name} {label}") for c in ref.provider.gate_checks(cfg, ref, fs, fs[i], target)]
    return checks


def verdict(checks: list[Check]) -> tuple[bool, str]:
    failed = [c for c in checks if not c.ok]
    if not failed:
        return True, "gate passed: " + "; ".join(f"{c.name.removeprefix('decode').strip() or 'decode'}: {c.detail}"
                                                 if c.name != "decode" else c.detail
                                                 for c in checks if c.name.startswith("decode"))
    return False, f"gate failed at {failed[0].name}: {failed[0].detail}"


def run_gate(cfg: GateConfig, silent: bool = True) -> tuple[list[Check], bool, str]:
    """Build the one-conversation run (resuming what exists), check it: (checks, passed, verdict).
    The target is loaded once, for every stage."""
    target = load_gate_target(cfg)  # resolves the target once; a bad one is refused before anything loads
    export = build(cfg, target, silent=silent)
    checks = run_checks(cfg, export if cfg.export is None else Path(cfg.export), target)
    return (checks, *verdict(checks))


# sf-eval gate: specfoundry/cli.py puts it in the sf-eval group, beside the decoding it ends with
@stage_command(None, "gate", GateConfig, *FAILURES)
def gate(recipe, silent, **options):
    """Overfit one conversation through regen, capture and train, reload the export and decode
    its prompt: the draft must be accepted almost always. Run it before a long training run;
    on failure it names the stage that disagrees (vocab map, export, features, positions, fit,
    decode) and exits with status 1 (2: the gate could not run)."""
    cfg = resolve_config(GateConfig, "gate", recipe, options)
    checks, ok, message = run_gate(cfg, silent=silent)
    if launch_env()[0] != 0:  # under torchrun (--tp), rank 0 reports; every rank exits with the verdict
        raise SystemExit(0 if ok else 1)
    for c in checks:
        click.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<10} {c.detail}")
    click.echo(message)
    raise SystemExit(0 if ok else 1)
