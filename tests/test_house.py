"""Checks of the house that a reader relies on: short functions, and no hardware readings in the
library's comments and docstrings (figures live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.conftest import parse_python

LIBRARY = Path(__file__).resolve().parents[1] / "specfoundry"
READING = re.compile(r"\b\d+(\.\d+)?\s?(ms|s|GiB|GB|MB|GB/s|TB/s|TFLOP/s|tok/s|tokens/s)\b|\b[HA]100\b|\bH200\b")


def sources():
    return sorted(LIBRARY.rglob("*.py"))


def test_no_function_in_the_library_is_over_60_lines():
    long = []
    for f in sources():
        for node in ast.walk(parse_python(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    continue  # Triton kernel bodies are one unit of work on the GPU
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{f.relative_to(LIBRARY.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def comments_and_docstrings(src: str):
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.COMMENT:
            yield t.start[0], t.string
    for node in ast.walk(parse_python(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_no_comment_or_docstring_quotes_a_reading():
    hits = [f"{f.relative_to(LIBRARY.parent)}:{line}: {m.group(0)!r}"
            for f in sources() for line, text in comments_and_docstrings(f.read_text())
            if (m := READING.search(text))]
    assert not hits, hits


def test_the_check_finds_what_it_looks_for():
    src = '"""Runs in 36.4 ms on an H200."""\n# 1.71 GiB peak\ndef f():\n    return 1\n'
    assert [m.group(0) for _, t in comments_and_docstrings(src) if (m := READING.search(t))] == ["1.71 GiB", "36.4 ms"]


def test_every_recipe_section_resolves_to_its_stage_config():
    """A recipe's key that no setting knows (a typo, a renamed option) fails here, not on a GPU
    hours into a pipeline."""
    import pytest
    import yaml

    from specfoundry.capture.stage import CaptureConfig
    from specfoundry.common.cli import resolve_config
    from specfoundry.eval.evaluate import EvalConfig
    from specfoundry.generate.regen import RegenConfig
    from specfoundry.train.trainer import TrainConfig

    stages = {"regen": RegenConfig, "capture": CaptureConfig, "train": TrainConfig, "eval": EvalConfig}
    # the settings a command line gives (a recipe may give them too)
    required = {"regen": {"output": "o", "synthesize": 1}, "capture": {"source": "s", "output": "o"},
                "train": {"featureset": "f", "output": "o"}, "eval": {"draft": "d"}}
    recipes = sorted((LIBRARY.parent / "recipes").glob("*.yaml"))
    checked = 0
    for recipe in recipes:
        sections = yaml.safe_load(recipe.read_text()) or {}
        if "compute_environment" in sections:
            continue  # an accelerate config, not a stage recipe
        for section, cls in stages.items():
            if section in sections:
                values = {**required[section], **{k: v for k, v in sections[section].items()}}
                try:
                    resolve_config(cls, section, str(recipe), values)
                except Exception as e:  # noqa: BLE001 - the message names the recipe and the key
                    pytest.fail(f"{recipe.name}: {section}: {e}")
                checked += 1
    assert checked >= 10, checked
