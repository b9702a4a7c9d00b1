"""Every setting's valid values are declared where it is defined and checked when the config is
built, before anything is loaded, written or recorded; recipes are checked as strictly as the
command line. No test here loads a model: each costs milliseconds."""

from __future__ import annotations

import dataclasses
import importlib
import typing

import click
import pytest
from click.testing import CliRunner

from specfoundry.capture.stage import CaptureConfig
from specfoundry.common.cli import build_config, resolve_config
from specfoundry.common.settings import Range, config_fields, default_of, long_flag
from specfoundry.eval.evaluate import EvalConfig
from specfoundry.eval.sweep import SweepConfig
from specfoundry.gate import GateConfig
from specfoundry.generate.regen import RegenConfig
from specfoundry.train.export import ExportConfig
from specfoundry.train.trainer import TrainConfig
from tests.test_cli_help import COMMANDS, leaf_commands, options

CONFIGS = [RegenConfig, CaptureConfig, TrainConfig, EvalConfig, SweepConfig, GateConfig, ExportConfig]

# what each command runs once its config is built (replaced here: the test never runs a stage)
RUNNERS = {"sf-regen run": ("specfoundry.generate.cli", "run_regen"),
           "sf-capture run": ("specfoundry.capture.cli", "run_capture"),
           "sf-capture verify": ("specfoundry.capture.cli", "verify_featureset"),
           "sf-train run": ("specfoundry.train.cli", "run_train"),
           "sf-export run": ("specfoundry.train.cli", "run_export"),
           "sf-eval run": ("specfoundry.eval.cli", "run_eval"),
           "sf-eval sweep": ("specfoundry.eval.cli", "run_sweep"),
           "sf-eval gate": ("specfoundry.gate", "run_gate")}
ARGS = {"sf-regen run": ["IN", "-o", "OUT"], "sf-capture run": ["IN", "-o", "OUT"], "sf-capture verify": ["IN"],
        "sf-train run": ["IN", "-o", "OUT"], "sf-export run": ["IN", "-o", "OUT"], "sf-eval run": ["IN", "-o", "OUT"],
        "sf-eval sweep": ["IN", "-o", "OUT"], "sf-eval gate": ["-o", "OUT"]}
ABSURD = {int: "1000000000000", float: "1e12"}


def numeric_options() -> list[tuple[str, click.Option, type]]:
    out = []
    for path, cmd in leaf_commands().items():
        for p in options(cmd):
            kind = {"integer": int, "float": float}.get(getattr(p.type, "name", None))
            if kind is not None and not p.is_flag:
                out.append((path, p, kind))
    return out


CASES = [pytest.param(path, p.opts[-1], value, id=f"{path} {p.opts[-1]} {value}")
         for path, p, kind in numeric_options() for value in ("0", "-1", ABSURD[kind])]

# The (option, value) pairs that are valid: --help says what each means (its range, and what 0
# does). Every other 0, -1 and absurd value is refused before any work.
ACCEPTED = {
    # 0 switches something off (or is greedy), as --help says
    ("sf-regen run", "--synthesize", "0"), ("sf-regen run", "--top-k", "0"), ("sf-regen run", "--temperature", "0"),
    ("sf-regen run", "--retries", "0"), ("sf-train run", "--weight-decay", "0"),
    ("sf-train run", "--warmup-steps", "0"), ("sf-train run", "--clip-grad", "0"),
    ("sf-train run", "--eval-fraction", "0"), ("sf-train run", "--keep-last", "0"),
    ("sf-train run", "--num-workers", "0"), ("sf-train run", "--lk-kl-scale", "0"),
    ("sf-train run", "--lk-kl-decay", "0"), ("sf-eval run", "--temperature", "0"),
    ("sf-train run", "--dpace-alpha", "0"),  # D-PACE on the raw label probabilities, unsmoothed
    ("sf-train run", "--selector-loss-alpha", "0"), ("sf-train run", "--selector-warmup-ratio", "0"),  # DFlash2's
    ("sf-train run", "--selector-ramp-ratio", "0"),  # selector frozen, no warm-up, no ramp
    ("sf-capture verify", "--recompute", "0"), ("sf-train run", "--profile-steps", "0"),
    # 0 is an ordinary value
    ("sf-regen run", "--seed", "0"), ("sf-train run", "--seed", "0"), ("sf-eval run", "--seed", "0"),
    ("sf-eval sweep", "--seed", "0"),
    ("sf-train run", "--mask-token-id", "0"), ("sf-train run", "--pard-token-id", "0"),
    ("sf-train run", "--down-sample-ratio-min", "0"),  # P-EAGLE's COD sampling without a floor
    ("sf-train run", "--base-weight-start", "0"), ("sf-train run", "--base-weight-end", "0"),  # Domino's lambda
    # DFlash's gamma: <= 0 weighs the block positions uniformly, a huge one nearly so
    ("sf-train run", "--gamma", "0"), ("sf-train run", "--gamma", "-1"), ("sf-train run", "--gamma", "1e12"),
    # "at most N", "every N", "N in a shard", "a long run": a huge N works as it says
    ("sf-regen run", "--shard-size", "1000000000000"), ("sf-regen run", "--limit", "1000000000000"),
    ("sf-capture run", "--shard-size", "1000000000000"), ("sf-capture run", "--limit", "1000000000000"),
    ("sf-capture verify", "--recompute", "1000000000000"), ("sf-eval run", "--limit", "1000000000000"),
    ("sf-eval sweep", "--limit", "1000000000000"),
    ("sf-train run", "--warmup-steps", "1000000000000"), ("sf-train run", "--max-steps", "1000000000000"),
    ("sf-train run", "--epochs", "1e12"), ("sf-train run", "--eval-every", "1000000000000"),
    ("sf-train run", "--save-every", "1000000000000"), ("sf-train run", "--keep-last", "1000000000000"),
    ("sf-train run", "--log-every", "1000000000000"), ("sf-eval gate", "--max-steps", "1000000000000"),
    ("sf-train run", "--clip-grad", "1e12"),  # a clip no gradient reaches: clipping is off in effect
    # a temperature that high samples the vocabulary uniformly
    ("sf-regen run", "--temperature", "1e12"), ("sf-regen run", "--prompt-temperature", "1e12"),
    ("sf-eval run", "--temperature", "1e12"),
}
ORDINARY_ZERO = {"--seed", "--mask-token-id", "--pard-token-id", "--gamma", "--base-weight-start", "--base-weight-end"}


def family_of_option(flag: str) -> str:
    """The family whose options group holds sf-train's `flag` (eagle3 for a shared option)."""
    return next((p[0] for f, _, p in config_fields(TrainConfig) if p and long_flag(f) == flag), "eagle3")


class Ran(Exception):
    """The stage would have run with this config."""


@pytest.mark.parametrize("path, option, value", CASES)
def test_every_numeric_option_is_checked_before_any_work(tmp_path, monkeypatch, path, option, value):
    module, name = RUNNERS[path]

    def run(cfg, *args, **kwargs):
        raise Ran(cfg)

    monkeypatch.setattr(importlib.import_module(module), name, run)
    cmd = leaf_commands()[path]
    argv = [str(tmp_path / a) if a in ("IN", "OUT") else a for a in ARGS[path]] + [option, value]
    if path == "sf-train run":  # a family's option is given with that family (another's is refused)
        argv += ["--family", family_of_option(option)]
    result = CliRunner().invoke(COMMANDS[path.split()[0]], [path.split()[1], *argv])
    if (path, option, value) in ACCEPTED:
        assert isinstance(result.exception, Ran), result.output
        cfg = result.exception.args[0]
        if dataclasses.is_dataclass(cfg):
            flat = {f.name: getattr(cfg if not p else getattr(cfg, p[0]), f.name) for f, _, p in config_fields(type(cfg))}
            dest = next(p.name for p in options(cmd) if option in p.opts)
            assert flat[dest] == type(flat[dest])(float(value)), "the config holds the value given"
        param = next(p for p in options(cmd) if option in p.opts)
        text = param.get_help_record(click.Context(cmd, info_name=path))[1]
        assert param.type.valid.describe() in text, "--help shows the valid values"
        if value == "0" and option not in ORDINARY_ZERO:
            assert "0:" in text, f"--help says what 0 means: {text}"
    else:
        assert result.exit_code == 2, (result.output, result.exception)
        assert not isinstance(result.exception, Ran)
        assert "Traceback" not in result.output
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and option in errors[0], result.output
        assert value in errors[0] or str(float(value)) in errors[0], result.output
        assert list(tmp_path.iterdir()) == [], "nothing written, nothing recorded"


@pytest.mark.parametrize("path, option", [(path, p.opts[-1]) for path, p, kind in numeric_options() if kind is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_option_takes_a_non_finite_number(path, option, value):
    param = next(p for p in options(leaf_commands()[path]) if option in p.opts)
    with pytest.raises(click.BadParameter, match="not a finite number|not in the range"):
        param.type.convert(value, param, None)


def numeric_fields(cls):
    for f, hint, _ in config_fields(cls):
        typ = hint
        if typing.get_origin(hint) in (typing.Union, type(int | None)):
            typ = next(a for a in typing.get_args(hint) if a is not type(None))
        if typ in (int, float):
            yield f


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_setting_declares_its_valid_values_and_its_default_is_one(cls):
    for f in numeric_fields(cls):
        valid = f.metadata.get("valid")
        assert isinstance(valid, Range), f"{cls.__name__}.{f.name} declares no valid values"
        default = default_of(f)
        assert default is None or valid.problem(default) is None, f"{cls.__name__}.{f.name} default {default}"


def test_a_config_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match=r"--max-length: -5 is not in the range 1<=x"):
        CaptureConfig(source="s", output="o", max_length=-5)
    with pytest.raises(ValueError, match=r"--epochs: 0.0 is not in the range x>0"):
        TrainConfig(featureset="f", output="o", epochs=0.0)
    with pytest.raises(ValueError, match=r"--min-accept-length 6 can never be reached.*k \+ 1 = 5"):
        GateConfig(output="o", min_accept_length=6.0)


# ---- recipes ---------------------------------------------------------------------------------------

def resolve(tmp_path, cls, section, text, **values):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(("target: smollm2\n" if text.strip() and not text.startswith("#") else "") + text)  # its target
    return resolve_config(cls, section, str(recipe), {}, **values)


def test_recipe_values_are_checked_naming_the_file_section_and_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    for text, words in [
        ("capture:\n  max_length: -5\n", "capture: max_length: -5 is not in the range 1<=x"),
        ("train:\n  eval_every: 0\n", "train: eval_every: 0 is not in the range x>=1"),
        ("train:\n  draft_vocab_size: 6.5\n", "train: draft_vocab_size: 6.5 is not an int"),
        ("regen:\n  prompt_starters: 5\n", "regen: prompt_starters: 5 is neither 'default', 'none', a file nor a list"),
        ("regen:\n  max_new_tokens: ~\n", "regen: max_new_tokens: null is not an int"),
        ("eval:\n  tree: 5\n", "eval: tree: tree branching must be comma-separated integers, got 5"),
    ]:
        section = text.split(":")[0]
        cls = {"capture": CaptureConfig, "train": TrainConfig, "regen": RegenConfig, "eval": EvalConfig}[section]
        required = {"capture": {"source": "s", "output": "o"}, "train": {"featureset": "f", "output": "o"},
                    "regen": {"output": "o"}, "eval": {"draft": "d"}}[section]
        with pytest.raises(click.ClickException) as e:
            resolve(tmp_path, cls, section, text, **required)
        assert e.value.format_message().startswith(f"{recipe}: {words}"), e.value.format_message()
        assert e.value.exit_code == 2 and "\n" not in e.value.format_message()
    # null for a setting whose default is None is that default
    assert resolve(tmp_path, RegenConfig, "regen", "regen:\n  limit: ~\n", output="o").limit is None


def test_a_recipe_with_an_unknown_section_or_nothing_in_it_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    for text, words in [("Train:\n  max_steps: 10\n", "unknown section Train:"),
                        ("training:\n  lr: 0.1\ncapture:\n  max_length: 64\n", "unknown section training:"),
                        ("", "the recipe is empty"), ("# only a comment\n", "the recipe is empty")]:
        with pytest.raises(click.ClickException, match=rf"^{recipe}: {words}"):
            resolve(tmp_path, TrainConfig, "train", text, featureset="f", output="o")
    # before: both ran sf-train with its defaults (1,000 steps at lr 1e-4)
    cfg = resolve(tmp_path, TrainConfig, "train", "train:\n  max_steps: 10\n", featureset="f", output="o")
    assert (cfg.max_steps, cfg.lr) == (10, 1e-4)


def test_a_null_recipe_value_no_longer_reaches_the_stage(tmp_path):
    # before: max_new_tokens None reached transformers, which cut every answer at its own ~20 tokens
    # and the manifest recorded null
    with pytest.raises(click.ClickException, match="max_new_tokens: null is not an int"):
        resolve(tmp_path, RegenConfig, "regen", "regen:\n  max_new_tokens: ~\n", output="o")
    cfg = resolve(tmp_path, RegenConfig, "regen", "regen:\n  max_new_tokens: 64\n", output="o")
    assert cfg.sampling.max_new_tokens == 64


def test_epochs_zero_is_refused_and_epochs_decide_the_steps(tmp_path):
    from specfoundry.train.trainer import planned_steps

    with pytest.raises(click.ClickException, match="train: epochs: 0.0 is not in the range x>0"):
        resolve(tmp_path, TrainConfig, "train", "train:\n  epochs: 0\n", featureset="f", output="o")
    cfg = build_config(TrainConfig, {"featureset": "f", "output": "o", "epochs": 0.25, "max_steps": 1000})
    assert planned_steps(cfg, steps_per_epoch=10) == 3  # a quarter of 10 steps, rounded up; not --max-steps
    assert planned_steps(build_config(TrainConfig, {"featureset": "f", "output": "o"}), 10) == 1000


def test_an_empty_prompt_list_is_refused(tmp_path):
    result = CliRunner().invoke(COMMANDS["sf-eval"], ["run", str(tmp_path / "d"), "--prompts", ""])
    assert result.exit_code == 2 and "--prompts names no prompt set" in result.output
    assert list(tmp_path.iterdir()) == []


def test_synthesize_counts_prompts_and_zero_reads_the_source(tmp_path):
    result = CliRunner().invoke(COMMANDS["sf-regen"], ["run", "--synthesize", "-3", "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "'--synthesize': -3 is not in the range" in result.output
    assert list(tmp_path.iterdir()) == []
    help_text = CliRunner().invoke(COMMANDS["sf-regen"], ["run", "--help"]).output
    assert "0: read SOURCE." in " ".join(help_text.split())


def test_a_negative_max_length_is_refused_before_the_target_loads(tmp_path):
    # before: accepted; Python's negative slicing cut the last 5 tokens (the answer's end and its
    # end-of-turn) off every sample, and the manifest recorded -5
    src = tmp_path / "chat.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    result = CliRunner().invoke(COMMANDS["sf-capture"], ["run", str(src), "-o", str(tmp_path / "fs"),
                                                         "--max-length", "-5"])
    assert result.exit_code == 2 and "Error: Invalid value for '--max-length': -5 is not in the range " \
        "1<=x<=16,777,216." in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


@pytest.mark.parametrize("cls, stage, field, other", [
    (TrainConfig, "train", "token_loss", "lk-lambda"),
    (TrainConfig, "train", "keep_best", True),
    (TrainConfig, "train", "lk_kl_decay", 1.0),
    (RegenConfig, "regen", "reasoning", "drop"),
])
def test_a_run_begun_before_a_setting_existed_resumes_at_its_as_before_value(tmp_path, cls, stage, field, other):
    """The record of a run begun before `field` existed lacks it: at the value that does what that
    run did (setting(before=...)) it is the same run; at another, a different one, named."""
    import json

    from specfoundry.common.settings import config_dict
    from specfoundry.common.shards import OutputFolderError, check_output_folder

    cfg = cls(source="chat.jsonl", output=str(tmp_path)) if cls is RegenConfig else \
        cls(featureset="fs", output=str(tmp_path))
    old = config_dict(cfg)
    del old[field]
    (tmp_path / f"{stage}_config.json").write_text(json.dumps(old))
    check_output_folder(tmp_path, stage, cfg)
    with pytest.raises(OutputFolderError, match=rf"{field}: '<unset>' -> {other!r}"):
        check_output_folder(tmp_path, stage, dataclasses.replace(cfg, **{field: other}))
