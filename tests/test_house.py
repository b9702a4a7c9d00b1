"""Checks of the house that a reader relies on: short functions, no hardware readings in the
library's comments and docstrings (figures live in benchmarks/RESULTS.md), and the one dependency
rule over every import, with no import circle between files."""

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


HELP_READING = re.compile(r"(?<![=,])" + READING.pattern.replace("|", r"|(?<![=,])"))
"""READING in an option's help, where a value after '=' is an example of the option's syntax (0=70GiB)."""


def help_readings(texts) -> list[str]:
    return [f"{where}: {m.group(0)!r}" for where, text in texts if (m := HELP_READING.search(text))]


def test_no_options_help_quotes_a_reading():
    """A measured figure ages in --help as in a docstring: figures live in benchmarks/RESULTS.md."""
    from tests.test_cli_help import leaf_commands, options

    texts = [(f"{path} {p.opts[-1]}", p.help or "") for path, cmd in leaf_commands().items() for p in options(cmd)]
    texts += [(path, cmd.help or "") for path, cmd in leaf_commands().items()]
    assert len(texts) > 100 and not help_readings(texts), help_readings(texts)


def test_the_check_finds_what_it_looks_for():
    assert help_readings([("sf-x --a", "a step 3.6 -> 1.9 ms on an H100"), ("sf-x --b", "e.g. 0=70GiB,cpu=200GiB"),
                          ("sf-x --c", "about a minute")]) == ["sf-x --a: '1.9 ms'"]
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


# ---- the one dependency rule (../shared/DESIGN.md) ----------------------------------------------
# common <- conversations, featureset, kernels <- decoding <- families <- {train, eval, capture, generate}
# <- gate <- cli. `common` is what everything may use; conversations, featureset and kernels are peers
# above it; a stage imports no other stage, and capture reads the catalogue alone (specfoundry.families
# itself), never a family's modules; cli.py, which assembles every command group, sits on top.
# Imports inside functions count.
RANK = {"common": 0, "conversations": 1, "featureset": 1, "kernels": 1, "decoding": 2, "families": 3,
        "train": 4, "eval": 4, "capture": 4, "generate": 4, "gate": 5, "testing": 5, "summary": 5, "cli": 6}
STAGES = ("train", "eval", "capture", "generate")


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "specfoundry" else None


def module_name(f: Path) -> str:
    parts = f.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports():
    """(file, line, importing module, imported module) for every import of specfoundry in the library,
    `from a import b` as a.b where b is a module, else as a."""
    modules = {module_name(f) for f in sources()}
    for f in sources():
        me = module_name(f)
        for node in ast.walk(parse_python(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("specfoundry"):
                    yield f.relative_to(LIBRARY.parent), node.lineno, me, name


PRIVATE = {"specfoundry.decoding.graphs": "decoding"}
"""Modules only their own package imports: the CUDA-graph primitives under decoding/steps.py's kit."""


def rule_breaks(imports) -> list[str]:
    out = []
    for where, line, me, theirs in imports:
        mine, pkg = package_of(me), package_of(theirs)
        owner = next((p for m, p in PRIVATE.items() if theirs == m or theirs.startswith(m + ".")), None)
        if owner and mine != owner:
            out.append(f"{where}:{line} {mine} imports {theirs}, private to {owner}/ (its steps go through the kit)")
            continue
        if pkg is None or mine == pkg:
            continue
        assert mine in RANK and pkg in RANK, f"{where}: package {mine or pkg} has no place in the rule"
        if mine in STAGES and pkg in STAGES:
            out.append(f"{where}:{line} stage {mine} imports stage {pkg} ({theirs})")
        elif mine == "capture" and pkg == "families" and theirs != "specfoundry.families":
            out.append(f"{where}:{line} capture imports {theirs}: capture reads the catalogue alone")
        elif RANK[pkg] >= RANK[mine]:
            out.append(f"{where}:{line} {mine} imports {pkg} ({theirs}), which sits at or above it")
    return out


def import_circles(imports) -> list[list[str]]:
    modules = {module_name(f) for f in sources()}

    def resolve(name):  # the module a name lives in: the longest prefix that is a file
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for _, _, me, theirs in imports:
        if resolve(theirs) != me:
            graph.setdefault(me, set()).add(resolve(theirs))
    circles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return circles


def family_of_module(module: str) -> str | None:
    from specfoundry.families import FAMILIES

    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "families" and parts[2] in FAMILIES.names() else None


def undeclared_family_uses(imports) -> list[str]:
    """Imports from one family's folder into another's that the catalogue does not declare (the
    importer neither extends nor builds on the imported family: families/__init__.py Family.builds_on)."""
    from specfoundry.families import FAMILIES

    out = []
    for where, line, me, theirs in imports:
        mine, used = family_of_module(me), family_of_module(theirs)
        if mine and used and mine != used and used not in FAMILIES.uses(mine):
            out.append(f"{where}:{line} family {mine} imports {theirs} without declaring that it builds on {used}")
    return out


def test_every_use_of_another_familys_code_is_declared():
    undeclared = undeclared_family_uses(list(library_imports()))
    assert not undeclared, "\n".join(undeclared)


def test_the_dependency_rule_holds_over_every_import():
    breaks = rule_breaks(list(library_imports()))
    assert not breaks, "\n".join(breaks)


def test_no_import_circle_between_library_files():
    circles = import_circles(list(library_imports()))
    assert not circles, [" -> ".join(c) for c in circles]


def test_the_rule_checks_find_what_they_look_for():
    fake = [("specfoundry/families/eagle3/gate.py", 9, "specfoundry.families.eagle3.gate", "specfoundry.eval.evaluate"),
            ("specfoundry/decoding/rounds.py", 3, "specfoundry.decoding.rounds", "specfoundry.families.eagle3.chain"),
            ("specfoundry/eval/cli.py", 15, "specfoundry.eval.cli", "specfoundry.gate"),
            ("specfoundry/gate.py", 40, "specfoundry.gate", "specfoundry.cli"),
            ("specfoundry/cli.py", 16, "specfoundry.cli", "specfoundry.gate"),
            ("specfoundry/eval/x.py", 2, "specfoundry.eval.x", "specfoundry.train.trainer"),
            ("specfoundry/capture/stage.py", 7, "specfoundry.capture.stage", "specfoundry.families.dflash.options"),
            ("specfoundry/capture/stage.py", 8, "specfoundry.capture.stage", "specfoundry.families"),
            ("specfoundry/featureset/store.py", 30, "specfoundry.featureset.store", "specfoundry.common.files"),
            ("specfoundry/conversations/sources.py", 3, "specfoundry.conversations.sources",
             "specfoundry.featureset.store"),
            ("specfoundry/capture/stage.py", 9, "specfoundry.capture.stage", "specfoundry.conversations.sources"),
            ("specfoundry/families/peagle/decode.py", 4, "specfoundry.families.peagle.decode",
             "specfoundry.decoding.graphs"),
            ("specfoundry/decoding/steps.py", 5, "specfoundry.decoding.steps", "specfoundry.decoding.graphs")]
    found = rule_breaks(fake)
    assert [b.split()[0] for b in found] == ["specfoundry/families/eagle3/gate.py:9", "specfoundry/decoding/rounds.py:3",
                                             "specfoundry/eval/cli.py:15", "specfoundry/gate.py:40",
                                             "specfoundry/eval/x.py:2",
                                             "specfoundry/capture/stage.py:7",
                                             "specfoundry/conversations/sources.py:3",
                                             "specfoundry/families/peagle/decode.py:4"], found
    assert undeclared_family_uses([
        ("specfoundry/families/dspark/decode.py", 3, "specfoundry.families.dspark.decode", "specfoundry.families.eagle3.chain"),
        ("specfoundry/families/dspark/decode.py", 4, "specfoundry.families.dspark.decode", "specfoundry.families.dflash.block"),
        ("specfoundry/families/peagle/model.py", 5, "specfoundry.families.peagle.model", "specfoundry.families.eagle3.model"),
    ]) == ["specfoundry/families/dspark/decode.py:3 family dspark imports specfoundry.families.eagle3.chain without "
           "declaring that it builds on eagle3"]
    assert import_circles([("a", 1, "specfoundry.common.cli", "specfoundry.common.shards"),
                           ("b", 2, "specfoundry.common.shards", "specfoundry.common.cli.config_dict")]) == [
        ["specfoundry.common.cli", "specfoundry.common.shards", "specfoundry.common.cli"]]
