"""The commands read as one tool: every option has help, one concept has one name, one short
flag and one help text in every command, every default is shown, and expected failures are
one-line errors."""

from __future__ import annotations

import re
from collections import defaultdict

import click
import pytest
from click.testing import CliRunner

from specfoundry.cli import TOOLS as COMMANDS


def walk(cmd: click.Command, path: str):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from walk(sub, f"{path} {name}")


def leaf_commands() -> dict[str, click.Command]:
    return {path: cmd for name, top in COMMANDS.items() for path, cmd in walk(top, name)
            if not isinstance(cmd, click.Group)}


def options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option) and p.name != "help"]


def test_every_tool_is_a_group_of_commands():
    assert all(isinstance(c, click.Group) for c in COMMANDS.values())
    assert sorted(leaf_commands()) == ["sf-capture run", "sf-capture verify", "sf-eval gate", "sf-eval run",
                                       "sf-eval sweep", "sf-export run", "sf-regen run", "sf-train run"]


def test_every_console_script_is_a_group_of_the_one_cli_module():
    """pyproject.toml's scripts all name specfoundry/cli.py's groups, one per tool; sf-eval, whose
    commands come from eval/cli.py and gate.py, is assembled there alone (the gate once added itself
    to eval's group when imported)."""
    import tomllib
    from pathlib import Path

    import specfoundry.cli
    import specfoundry.eval.cli
    import specfoundry.gate

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: target.partition(":")[0] for name, target in scripts.items()} == {
        name: "specfoundry.cli" for name in COMMANDS}
    assert {name: getattr(specfoundry.cli, target.partition(":")[2]) for name, target in scripts.items()} == COMMANDS
    for module in (specfoundry.eval.cli, specfoundry.gate):  # sf-eval's parts: commands, no group of their own
        assert not [v for v in vars(module).values() if isinstance(v, click.Group)], module.__name__


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help(name):
    for path, cmd in walk(COMMANDS[name], name):
        assert cmd.help, f"{path} has no help text"
        for param in options(cmd):
            assert param.help, f"{path} {param.opts[0]} has no help text"


SENTENCE_BREAK = re.compile(r"[.!?]\s+[A-Z]")
"""One sentence's end and the next one's start ('off. Greedy'); not 'e.g. 4,2,2,1', '0.5' or '0: off.'."""
HELP_MAX = 200
# -k's help is the catalogue's list of what k means for each family, in sf-eval and in the gate
# (families/__init__.py PROPOSALS), rendered one part a family: four meanings that do not fit in
# HELP_MAX characters. It is exempt from the length only: it is one sentence too.
LONG_HELP = {"--draft-tokens"}


def help_problems(texts) -> list[str]:
    """Why each (command, option, help) is not one short sentence: a second sentence, or more than
    HELP_MAX characters (LONG_HELP's options excepted from the length)."""
    out = []
    for path, option, text in texts:
        if m := SENTENCE_BREAK.search(text):
            out.append(f"{path} {option}: a second sentence at {m.group(0)!r}")
        if len(text) > HELP_MAX and option not in LONG_HELP:
            out.append(f"{path} {option}: {len(text)} characters")
    return out


def test_every_options_help_is_one_short_sentence():
    """--help says what an option does in one sentence; the detail is in docs/, which the help names
    where the reader needs it (issue 60). What a Range appends ('0: off.') is part of the text."""
    texts = [(path, next(o for o in p.opts if o.startswith("--")), p.help or "")
             for path, cmd in leaf_commands().items() for p in options(cmd)]
    assert len(texts) > 100 and not help_problems(texts), help_problems(texts)


def test_the_one_sentence_check_finds_what_it_looks_for():
    assert help_problems([
        ("sf-x", "--a", "Does one thing. Then another."),
        ("sf-x", "--b", "One sentence, " + "long " * 40 + "."),
        ("sf-x", "--c", "A tree such as 4,2,2,1, weighted 0.5 (e.g. smollm2; docs/stages.md, \"sf-eval run\"). 0: off."),
        ("sf-x", "--draft-tokens", "By family: " + "eagle3: a chain of k; " * 20),
        ("sf-x", "--draft-tokens", "By family! Eagle3 drafts a chain."),
    ]) == ["sf-x --a: a second sentence at '. T'", "sf-x --b: 215 characters",
           "sf-x --draft-tokens: a second sentence at '! E'"]


def test_one_concept_has_one_name_flag_and_help_across_commands():
    by_long: dict[str, set] = defaultdict(set)
    by_dest: dict[str, set] = defaultdict(set)
    for cmd in leaf_commands().values():
        for p in options(cmd):
            long = next(o for o in p.opts if o.startswith("--"))
            by_long[long].add((tuple(sorted(p.opts)), p.help if long not in DEST_HELP_VARIES else ""))
            by_dest[p.name].add(long)
    spelled_twice = {long: forms for long, forms in by_long.items() if len(forms) > 1}
    assert not spelled_twice, spelled_twice
    # the same setting never goes by two option names
    assert not {dest: longs for dest, longs in by_dest.items() if len(longs) > 1}


# options whose help must say what that command does with them (a command's own setting that
# happens to share a name); the shared concepts are not among them
DEST_HELP_VARIES = {"--temperature", "--lr", "--draft-vocab-size", "--shard-size", "--prompt"}


def test_shared_concepts_are_where_they_apply():
    cmds = leaf_commands()
    for path, cmd in cmds.items():
        flags = {o for p in options(cmd) for o in p.opts}
        if path != "sf-capture verify":  # verify writes nothing
            assert {"-o", "--output", "--target", "--recipe"} <= flags, path
        # Accelerate places sf-train; sf-export only rewrites files
        if path not in ("sf-capture verify", "sf-train run", "sf-export run"):
            assert "--device" in flags, path
    for path in ("sf-regen run", "sf-capture run", "sf-train run", "sf-eval run", "sf-eval gate"):
        assert "--silent" in {o for p in options(cmds[path]) for o in p.opts}, path
    for path in ("sf-regen run", "sf-train run", "sf-eval run"):
        assert "--seed" in {o for p in options(cmds[path]) for o in p.opts}, path
    for path in ("sf-regen run", "sf-eval run", "sf-eval gate"):
        assert "--max-new-tokens" in {o for p in options(cmds[path]) for o in p.opts}, path
    for path in ("sf-capture run", "sf-train run"):
        assert "--max-batch-tokens" in {o for p in options(cmds[path]) for o in p.opts}, path
    for path in ("sf-eval run", "sf-eval gate"):
        assert {"-k", "--draft-tokens"} <= {o for p in options(cmds[path]) for o in p.opts}, path


def test_every_default_is_shown_in_help():
    for path, cmd in leaf_commands().items():
        ctx = click.Context(cmd, info_name=path)
        for p in options(cmd):
            if p.is_flag and not p.secondary_opts:
                continue  # a plain on/off switch: off unless given
            record = p.get_help_record(ctx)
            if p.default is not None or p.show_default:
                assert record and "[default:" in record[1], f"{path} {p.opts[0]} hides its default"


def test_an_option_without_a_default_is_marked_required_and_the_others_not():
    """--help shows which options a command cannot run without (no default: the command line or the
    recipe's section must give them), though click itself does not refuse a command line without
    them: a recipe may hold them. sf-train's -o is one; sf-eval's -o has a default."""
    from specfoundry.common.cli import RecipeRequired

    marked = set()
    for path, cmd in leaf_commands().items():
        ctx = click.Context(cmd, info_name=path)
        for p in options(cmd):
            record = p.get_help_record(ctx)
            assert ("required: here or in the recipe" in record[1]) == isinstance(p, RecipeRequired), (path, p.opts)
            if isinstance(p, RecipeRequired):
                assert not p.required and p.default is None  # click leaves it to resolve_config
                marked.add((path, p.opts[0]))
    assert ("sf-train run", "-o") in marked and ("sf-eval run", "-o") not in marked


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_ends_a_command_with_status_130_and_one_line(monkeypatch, name):
    """128 + SIGINT, as the shell reports an interrupted program: a scheduler or a script reads it as
    stopped, not failed (click alone says 'Aborted!' and exits 1)."""

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS[name].commands, "probe", click.Command("probe", callback=interrupted))
    result = CliRunner().invoke(COMMANDS[name], ["probe"], prog_name=name)
    assert result.exit_code == 130, (result.output, result.exception)
    assert result.output.strip().splitlines() == [f"{name} probe: interrupted (Ctrl-C)"]


@pytest.mark.parametrize("argv, words", [
    (["sf-train", "run", "/nonexistent/fs", "-o", "OUT"], "/nonexistent/fs does not exist"),
    (["sf-eval", "run", "/nonexistent/draft"], "/nonexistent/draft does not exist"),
    # a run killed before it wrote its output: named as unfinished, with what to do
    (["sf-eval", "run", "UNFINISHED_RUN"], "is an sf-train run that has not finished (no export/ yet): rerun"),
    (["sf-capture", "verify", "UNFINISHED_SET"], "whose sf-capture has not finished (no manifest.json yet): rerun"),
    (["sf-export", "run", "/nonexistent/draft", "-o", "OUT"], "/nonexistent/draft"),
    (["sf-capture", "verify", "/nonexistent/fs"], "/nonexistent/fs"),
    (["sf-regen", "run", "-o", "OUT"], "no source given"),
    (["sf-capture", "run", "SRC", "-o", "OUT", "--recipe", "RECIPE"], "unknown settings bogus"),
    # a device that is no torch device, or one this machine lacks: named before any work
    (["sf-capture", "run", "SRC", "-o", "OUT", "--device", "gpu"], "'gpu' is not a torch device"),
    (["sf-capture", "verify", "/nonexistent/fs", "--device", "gpu"], "'gpu' is not a torch device"),
    (["sf-regen", "run", "-o", "OUT", "--synthesize", "2", "--device", "cuda:99"], "--device': 'cuda:99'"),
    (["sf-eval", "run", "/nonexistent/draft", "--device", "cuda:99"], "--device': 'cuda:99'"),
    (["sf-train", "run", "SRC", "-o", "OUT", "--max-steps", "3", "--epochs", "1"], "--max-steps and --epochs"),
    (["sf-eval", "run", "/nonexistent/draft", "-k", "5", "--tree", "2,1"], "-k drafts a chain, --tree a tree"),
    (["sf-export", "run", "/nonexistent/draft", "-o", "OUT", "-k", "6"], "written only into a speculators export"),
])
def test_expected_failures_are_one_line_errors_with_status_2(tmp_path, argv, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("capture:\n  bogus: 1\n")
    for folder, record in (("UNFINISHED_RUN", "train_config.json"), ("UNFINISHED_SET", "capture_config.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / record).write_text("{}")
    argv = [str(recipe) if a == "RECIPE" else str(tmp_path / a) if a in ("OUT", "SRC") or a.startswith("UNFINISHED")
            else a for a in argv]
    result = CliRunner().invoke(COMMANDS[argv[0]], argv[1:])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.output


@pytest.mark.parametrize("text, words", [
    ("train:\n  lr: 0.1\n  lr: 0.2\n", "not valid YAML at line 3, column 3: 'lr' is given twice in one mapping "
                                       "(first at line 2)"),
    ("train:\n  lr: 0.1\n bad: : x\n", "not valid YAML at line 3, column 2:"),
])
def test_a_recipe_that_yaml_would_misread_is_named_with_its_line(tmp_path, text, words):
    """A key given twice (YAML keeps the last, silently) and a syntax error are named with the
    line and column, before any work."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    result = CliRunner().invoke(COMMANDS["sf-train"], ["run", str(tmp_path / "fs"), "-o", str(tmp_path / "out"),
                                                       "--recipe", str(recipe)])
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"Error: {recipe}: {words}" in errors[0], result.output
    assert not (tmp_path / "out").exists()


def test_a_recipes_merge_keys_merge_and_its_own_keys_override_them(tmp_path):
    """issue 61 item 11: a YAML merge key (`<<: *base`) was refused as invalid YAML (the loader that
    refuses a repeated key built the merge key as a key). It merges as YAML says, a key the mapping
    gives itself overriding the merged one's, the anchors held under a top-level x-... key; a key given
    twice by the mapping itself is still refused."""
    from specfoundry.common.cli import CommandError, recipe_data

    recipe = tmp_path / "r.yaml"
    recipe.write_text("x-base: &base\n  lr: 0.001\n  epochs: 2\ntrain:\n  <<: *base\n  lr: 0.002\n")
    assert recipe_data(str(recipe)) == {"train": {"lr": 0.002, "epochs": 2}}  # (the anchors' key is no section)
    recipe.write_text("x-base: &base\n  lr: 0.001\ntrain:\n  <<: *base\n  epochs: 1\n  epochs: 2\n")
    with pytest.raises(CommandError, match="'epochs' is given twice in one mapping"):
        recipe_data(str(recipe))
