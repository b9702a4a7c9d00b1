"""A recipe names its target once and every command that reads it runs that target (or says in one
line why it cannot), never the embedded default; the command line wins over the recipe, also where
two settings decide one thing; every command names the target it runs before loading it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specfoundry.capture.stage import CaptureConfig
from specfoundry.common.cli import CommandError, resolve_config
from specfoundry.eval.evaluate import EvalConfig
from specfoundry.gate import GateConfig
from specfoundry.generate.regen import RegenConfig
from specfoundry.train.export import ExportConfig
from specfoundry.train.trainer import TrainConfig
from tests.test_cli_help import COMMANDS
from tests.test_settings import RUNNERS, Ran

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STAGES = {"regen": (RegenConfig, {"output": "o", "synthesize": 1}), "capture": (CaptureConfig, {"source": "s", "output": "o"}),
          "train": (TrainConfig, {"featureset": "f", "output": "o"}), "export": (ExportConfig, {"draft": "d", "output": "o"}),
          "eval": (EvalConfig, {"draft": "d"}), "gate": (GateConfig, {"output": "o"})}


def stage_recipes():
    return [p for p in sorted(RECIPES.glob("*.yaml")) if "compute_environment" not in p.read_text()]


@pytest.mark.parametrize("recipe", stage_recipes(), ids=lambda p: p.name)
def test_every_command_given_a_shipped_recipe_runs_the_recipes_target(recipe):
    """The 70B, 235B and 30B recipes have no gate: section, qwen3-8b-dflash no regen: or capture:;
    each command still resolves the recipe's own target, not the embedded SmolLM2."""
    named = yaml.safe_load(recipe.read_text())["target"]
    for section, (cls, required) in STAGES.items():
        values = {k: v for k, v in required.items() if k not in (yaml.safe_load(recipe.read_text()).get(section) or {})}
        cfg = resolve_config(cls, section, str(recipe), values)
        assert cfg.target == named, (recipe.name, section, cfg.target)


def test_the_gate_given_the_70b_recipe_runs_the_70b_or_says_why(tmp_path):
    from specfoundry.cli import sf_eval as main

    result = CliRunner().invoke(main, ["gate", "--recipe", str(RECIPES / "llama-3.3-70b-instruct.yaml"),
                                       "-o", str(tmp_path / "gate")])
    assert result.exit_code == 2 and "/models/Llama-3.3-70B-Instruct" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "gate" / "regen").exists()


def recipe(tmp_path, data: dict) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_section_naming_another_target_and_a_recipe_naming_none_are_one_line(tmp_path):
    other = recipe(tmp_path, {"target": "/models/A", "train": {"target": "/models/B"}})
    with pytest.raises(CommandError, match="train: target '/models/B' is not the recipe's target '/models/A'"):
        resolve_config(TrainConfig, "train", other, {"featureset": "f", "output": "o"})
    none = recipe(tmp_path, {"train": {"lr": 1e-3}})
    with pytest.raises(CommandError, match="names no target: add `target: "):
        resolve_config(TrainConfig, "train", none, {"featureset": "f", "output": "o"})
    # sf-export's target defaults to the one the draft records: a recipe without one is no fallback to refuse
    assert resolve_config(ExportConfig, "export", none, {"draft": "d", "output": "o"}).target is None
    with pytest.raises(CommandError, match="a model directory or an embedded target's name"):
        resolve_config(TrainConfig, "train", recipe(tmp_path, {"target": ["a", "b"]}), {"featureset": "f", "output": "o"})


# (command, its recipe section, the recipe's setting, the command line's partner, what the config then holds)
PAIRS = [
    ("sf-train run", {"train": {"epochs": 10}}, ["--max-steps", "2"], {"max_steps": 2, "epochs": None}),
    ("sf-train run", {"train": {"max_steps": 60}}, ["--epochs", "1.5"], {"epochs": 1.5}),
    ("sf-eval run", {"eval": {"tree": "2,1"}}, ["-k", "3"], {"k": 3, "tree": None}),
    ("sf-eval run", {"eval": {"k": 3}}, ["--tree", "2,1"], {"tree": (2, 1), "k": None}),
    ("sf-capture run", {"capture": {"families": ["eagle3", "dflash"]}}, ["--aux-layers", "1,2"],
     {"aux_layers": (1, 2), "families": ("eagle3",)}),
    ("sf-regen run", {"regen": {"synthesize": 5}}, ["SOURCE"], {"synthesize": 0}),
]


@pytest.mark.parametrize(("path", "sections", "argv", "want"), PAIRS, ids=[f"{p[0]} {p[2][0]}" for p in PAIRS])
def test_the_command_line_decides_over_the_recipes_partner_setting(tmp_path, monkeypatch, path, sections, argv, want):
    """With a recipe whose section sets one of two settings that decide one thing (--max-steps and
    --epochs, -k and --tree, --aux-layers and --families, SOURCE and --synthesize), the other given
    on the command line decides: the recipe's is dropped from the resolved config."""
    module, name = RUNNERS[path]

    def run(cfg, *args, **kwargs):
        raise Ran(cfg)

    monkeypatch.setattr(importlib.import_module(module), name, run)
    command, sub = path.split()
    given = [str(tmp_path / "in") if a == "SOURCE" else a for a in argv]
    (tmp_path / "in").write_text("")
    positional = [] if path == "sf-regen run" else [str(tmp_path / "in")]
    result = CliRunner().invoke(COMMANDS[command], [sub, *positional, *given, "-o", str(tmp_path / "out"),
                                                    "--recipe", recipe(tmp_path, {"target": "smollm2", **sections})])
    assert isinstance(result.exception, Ran), result.output
    cfg = result.exception.args[0]
    assert {k: getattr(cfg, k) for k in want} == want


def test_every_command_names_the_target_it_runs_before_loading_it(tiny_llama_dir, capsys, monkeypatch):
    from specfoundry.common import target as target_module

    def refuse(*args, **kwargs):
        raise RuntimeError("loading")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    with pytest.raises(RuntimeError, match="loading"):
        target_module.Target.load(str(tiny_llama_dir), device="cpu", command="sf-capture run")
    assert f"sf-capture run: target {tiny_llama_dir}" in capsys.readouterr().err
