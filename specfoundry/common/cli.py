"""The command-line layer every stage shares (click only).

`config_options` turns a stage config's fields (common/settings.py: each with its default, help
and valid values) into click options, `resolve_config` merges a recipe section under the
command-line values, and `expected_failures` turns the errors a user can cause into one-line
click errors. So a setting, its default, its help and its range are written once, checked when
the config is built (before any model loads or anything is recorded), and the same concept has
the same name, flag, help and range in every command.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import MISSING
from pathlib import Path

import click
import yaml
from click.core import ParameterSource

from specfoundry.common.settings import (
    SHARED,
    SHARED_PARSE,
    Range,
    check_valid,
    config_fields,
    default_of,
    leaf_type,
    long_flag,
    unique_options,
)


class CommandError(click.ClickException):
    """The command could not run (bad input, bad option, a mismatch): exit status 2. Status 1
    is kept for a check that ran and found a problem (the gate failing, verify finding damage)."""

    exit_code = 2


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 110}


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C: 128 + SIGINT, the shell's own, which scripts and
schedulers read as interrupted rather than failed (click's default is 1, a failure's)."""


class ToolGroup(click.Group):
    """A command group of a console script: Ctrl-C ends its command with INTERRUPTED and one line
    on stderr instead of click's 'Aborted!' and status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            command = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
            click.echo(f"\n{command}: interrupted (Ctrl-C)", err=True)
            ctx.exit(INTERRUPTED)


RECIPE_SECTIONS = ("regen", "capture", "train", "export", "eval", "gate")


class _InRange:
    """A click number type checking a Range (finite values only; its range shown in --help)."""

    def __init__(self, valid: Range):
        super().__init__(valid.min, valid.max, min_open=valid.min_open, max_open=valid.max_open)
        self.valid = valid

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        problem = self.valid.problem(value)
        if problem:
            self.fail(problem, param, ctx)
        return value

    def _describe_range(self) -> str:
        return self.valid.describe()


class IntIn(_InRange, click.IntRange):
    name = "integer"


class FloatIn(_InRange, click.FloatRange):
    name = "float"


# ---- options from a config ---------------------------------------------------------------------

class RecipeRequired(click.Option):
    """An option the command needs, from the command line or from the recipe's section: --help
    marks it required, where click's own required=True would refuse a command line that leaves it
    to the recipe (resolve_config names it when neither gives it)."""

    def get_help_extra(self, ctx):
        extra = super().get_help_extra(ctx)
        extra["required"] = "required: here or in the recipe"
        return extra


def _click_default(f: dataclasses.Field, is_tuple: bool):
    """(default click passes, show_default) for a field: the real default where it reads well in
    --help, else None and the field's `shown` text."""
    if f.metadata.get("shown"):
        return None, f.metadata["shown"]
    d = default_of(f)
    if d is MISSING or d is None:
        return None, False
    return (",".join(map(str, d)) if is_tuple else d), True


def _option(f: dataclasses.Field, hint):
    typ, is_tuple = leaf_type(hint)
    meta = f.metadata
    flags = meta.get("flags") or ("--" + f.name.replace("_", "-"),)
    if meta.get("argument"):
        return click.argument(f.name, required=False, type=click.Path() if typ is str else typ)
    default, show = _click_default(f, is_tuple)
    help_text = meta["help"]
    cls = RecipeRequired if default_of(f) is MISSING else click.Option
    if meta.get("repeatable"):
        return click.option(*flags, f.name, multiple=True, type=str, help=help_text, show_default=show, cls=cls)
    if typ is bool:
        long = flags[-1]
        return click.option(*flags[:-1], f"{long}/--no-{long[2:]}", f.name, default=bool(default),
                            help=help_text, show_default=show, cls=cls)
    click_type = click.Choice(meta["choices"]) if meta.get("choices") else (
        str if is_tuple or meta.get("parse") else typ)
    if meta.get("valid") is not None and click_type in (int, float):
        click_type = IntIn(meta["valid"]) if click_type is int else FloatIn(meta["valid"])
    return click.option(*flags, f.name, type=click_type, default=default, help=help_text, show_default=show,
                        metavar="A,B,..." if is_tuple and not meta.get("parse") else None, cls=cls)


def config_options(cls, *, skip: tuple[str, ...] = ()):
    """Decorator: one click option (or the positional argument) per field of `cls` (whose option
    names must not collide: unique_options)."""
    unique_options(cls)

    def decorate(fn):
        for f, hint, _ in reversed(config_fields(cls)):
            if f.metadata.get("cli", True) and f.name not in skip:
                fn = _option(f, hint)(fn)
        return fn

    return decorate


def recipe_option(fn):
    return click.option("--recipe", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="YAML recipe whose section for this command sets its options, which the command "
                             "line overrides (docs/stages.md).")(fn)


def shared_option(concept: str, default=None):
    """A click option for a SHARED concept on a command without a config field for it."""
    flags, help_text, none_shown, _ = SHARED[concept]
    parse = SHARED_PARSE.get(concept)

    def checked(ctx, param, value):
        try:
            return value if value is None or parse is None else parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return click.option(*flags, concept, default=default, help=help_text, callback=checked,
                        show_default=none_shown if default is None else True)


def hide_transformers_bars() -> None:
    """--silent hides transformers' own bars too ("Loading weights", the GGUF conversion)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def silent_option(fn):
    return click.option("--silent", is_flag=True, default=False, show_default=True,
                        help="No progress bars, nor the progress lines a long run prints (sf-train's "
                        "step log among them); errors still print.")(fn)


# ---- config from options and recipe ------------------------------------------------------------

RECIPE_TARGET = "target"
"""A recipe's top-level key naming its target once, for every command that reads the recipe."""


def read_recipe(path: str | None, section: str) -> dict:
    """The `section:` mapping of a recipe file ({} when there is no recipe or no such section).
    An empty recipe, or a section no command reads (a misspelt `Train:`), is an error naming it:
    either would leave the command running with its defaults."""
    return dict(recipe_data(path).get(section) or {})


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (YAML keeps the last one,
    silently: a recipe's earlier value would be dropped unsaid). Merge keys (`<<: *base`) work as
    YAML says: a key the mapping gives itself overrides the merged one's."""


MERGE_TAG = "tag:yaml.org,2002:merge"


def is_anchor_key(key) -> bool:
    """A top-level recipe key beginning with `x-` (Compose files' convention) holds YAML anchors that
    sections merge (`<<: *base`); it is no section, and nothing reads it."""
    return isinstance(key, str) and key.startswith("x-")


def mapping_without_repeats(loader: RecipeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:  # (SafeLoader's construct_mapping merges it)
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice in one mapping (first at line "
                                                    f"{seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping_without_repeats)


def recipe_data(path: str | None) -> dict:
    """A recipe file's mapping of sections (and its `target:`), checked; {} without a recipe."""
    if not path:
        return {}
    try:
        data = yaml.load(Path(path).read_text(), Loader=RecipeLoader)  # a SafeLoader: no tags that run code
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise CommandError(f"{path}: not valid YAML{where}: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise CommandError(f"{path}: not valid YAML: {e}".splitlines()[0]) from e
    if data is None:
        raise CommandError(f"{path}: the recipe is empty (a recipe has {', '.join(s + ':' for s in RECIPE_SECTIONS)} "
                           "sections)")
    if not isinstance(data, dict) or not all(isinstance(data.get(s, {}), dict | None) for s in RECIPE_SECTIONS):
        raise CommandError(f"{path}: a recipe is a mapping of sections ({', '.join(s + ':' for s in RECIPE_SECTIONS)})")
    unknown = [str(k) for k in data if k not in (*RECIPE_SECTIONS, RECIPE_TARGET) and not is_anchor_key(k)]
    if unknown:
        raise CommandError(f"{path}: unknown section{'s' if len(unknown) > 1 else ''} "
                           f"{', '.join(k + ':' for k in unknown)} (a recipe has {RECIPE_TARGET}: and "
                           f"{', '.join(s + ':' for s in RECIPE_SECTIONS)} sections, and x-... keys for YAML anchors)")
    data = {k: v for k, v in data.items() if not is_anchor_key(k)}
    if not isinstance(data.get(RECIPE_TARGET, ""), str):
        raise CommandError(f"{path}: {RECIPE_TARGET}: is a model directory or an embedded target's name, not "
                           f"{data[RECIPE_TARGET]!r}")
    return data


def _optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


class _Invalid(Exception):
    """A value a field cannot take (build_config names where it came from)."""


def _convert(value, f: dataclasses.Field, hint):
    """A given value (a recipe's, or an option's text) as the field's value, checked against its
    declared range; _Invalid says why not."""
    typ, is_tuple = leaf_type(hint)
    if value is None:
        if _optional(hint):
            return None
        raise _Invalid(f"null is not {_a(typ)} (leave the key out for the default)")
    if f.metadata.get("parse"):
        try:
            return f.metadata["parse"](value)
        except (TypeError, ValueError) as e:
            raise _Invalid(str(e) if isinstance(e, ValueError) else f"{value!r} is not a valid value") from e
    if is_tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise _Invalid(f"{value!r} is not a comma-separated list of {typ.__name__}")
        try:
            return tuple(typ(str(x).strip()) for x in items if str(x).strip())
        except ValueError as e:
            raise _Invalid(f"{value!r} is not a comma-separated list of {typ.__name__}") from e
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise _Invalid(f"{value!r} is not one of {', '.join(f.metadata['choices'])}")
    value = _typed(value, typ)
    problem = check_valid(f, value)
    if problem:
        raise _Invalid(problem)
    return value


def _a(typ) -> str:
    name = typ.__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _typed(value, typ):
    """A recipe's value as the field's type: YAML reads 1e-4 as a string and 10 as an int."""
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif typ is str:
        if not isinstance(value, dict | list):
            return str(value)
    else:
        return value
    raise _Invalid(f"{value!r} is not {_a(typ)}")


def resolve_config(cls, section: str, recipe: str | None, options: dict, *, decided_here: tuple[str, ...] = (),
                   **fixed):
    """cls built from its defaults, then the recipe's `section`, then the options given on the
    command line, then `fixed`. Unknown recipe keys, missing required settings and values a
    setting cannot take are one-line errors naming the option, or the recipe file and key. cls's
    DECIDED_TOGETHER maps settings that decide one thing to the line that refuses them both on the
    command line (None: the command judges them itself); from the recipe, the command line's one wins.
    `decided_here` names keys of the section that the command sets itself (sf-eval sweep's serving
    settings, which it varies over the section's k or tree): they are left out, not refused.
    Inside a command, the output folder is then held for the command's life (hold_output)."""
    values = {k: v for k, v in read_recipe(recipe, section).items() if k not in decided_here}
    origins = {k: f"{recipe}: {section}: {k}" for k in values}
    unnamed = target_from_recipe(cls, recipe, section, values, origins)
    ctx = click.get_current_context(silent=True)
    given = {k: v for k, v in options.items()
             if ctx is None or ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    for group, why in getattr(cls, "DECIDED_TOGETHER", {}).items():  # the command line's, not the recipe's partner
        if why and sum(k in given for k in group) > 1:  # both on the command line: one would be dropped unsaid
            raise CommandError(why)
        in_recipe = [k for k in group if k in values]
        if len(in_recipe) > 1 and not any(k in given for k in group):  # one would be dropped unsaid
            raise CommandError(f"{recipe}: {section}: {' and '.join(in_recipe)} both decide one thing (one replaces the "
                               "other): keep one")
        if any(k in given for k in group):
            for k in group:
                if k not in given:
                    values.pop(k, None)
                    origins.pop(k, None)
    values.update(given)
    values.update(fixed)
    for k in (*given, *fixed):
        origins.pop(k, None)
    cfg = build_config(cls, values, source=f"{recipe}: {section}:" if recipe else "options", origins=origins)
    if unnamed and "target" not in given and "target" not in fixed:  # after the section's own values are checked
        raise CommandError(f"{recipe} names no target: add `{RECIPE_TARGET}: <model directory or embedded name>` at "
                           f"its top (a recipe's command never runs the default target {cfg.target!r})")
    if ctx is not None and section in LOCKED and getattr(cfg, "output", None):
        hold_output(ctx, cfg.output, section)
    return cfg


def target_from_recipe(cls, recipe: str | None, section: str, values: dict, origins: dict) -> bool:
    """A recipe names its target once (`target:` at its top) for every command that reads it, its
    section for the command or not: into `values` unless the section names it. A section naming
    another target is one line. Returns whether the recipe names no target for a command that would
    otherwise run a default one (resolve_config refuses that, unless --target is given)."""
    fields = {f.name: f for f, _, _ in config_fields(cls)}
    if not recipe or "target" not in fields:
        return False
    named = recipe_data(recipe).get(RECIPE_TARGET)
    if named is not None and "target" in values and str(values["target"]) != named:
        raise CommandError(f"{recipe}: {section}: target {values['target']!r} is not the recipe's target {named!r}: "
                           f"a recipe names its target once, at its top")
    if named is not None:
        values.setdefault("target", named)
        origins.setdefault("target", f"{recipe}: {RECIPE_TARGET}")
    return named is None and "target" not in values and default_of(fields["target"]) is not None


def given_on_command_line(name: str) -> bool:
    """Whether the running command's option `name` (its parameter name) was given on the command line."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE


LOCKED = ("regen", "capture", "train", "eval", "gate")
"""The commands that hold their output folder for the run's life (sf-export writes its folder
whole and renames it into place)."""


def hold_output(ctx: click.Context, output: str, stage: str) -> None:
    """Inside a command: hold the output folder's lock (shards.output_lock) until the command
    ends, so one run at a time writes into it; once per folder, however often the command
    resolves its config."""
    from specfoundry.common.shards import output_lock  # shards builds on this module

    held = ctx.meta.setdefault("specfoundry.held_outputs", set())
    key = str(Path(output).resolve())
    if key not in held:
        ctx.with_resource(output_lock(output, stage))
        held.add(key)


def build_config(cls, values: dict, source: str = "options", origins: dict[str, str] | None = None):
    """cls from a flat mapping of field names (nested configs' fields flattened into it).
    `origins`: where a value came from, by its key ('recipe.yaml: train: lr'); a value without one
    is named by its option."""
    origins = dict(origins or {})
    aliases = {flag[2:].replace("-", "_"): f.name for f, _, _ in config_fields(cls)
               for flag in f.metadata.get("flags", ()) if flag.startswith("--")}
    for k in list(values):  # a recipe may use the option's name too
        if k in aliases and k in origins:
            origins[aliases[k]] = origins.pop(k)
    values = {aliases.get(k, k): v for k, v in values.items()}
    known = {f.name for f, _, _ in config_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CommandError(f"{source} unknown settings {', '.join(unknown)}")
    nested: dict[tuple[str, ...], dict] = {(): {}}
    for f, hint, path in config_fields(cls):
        if f.name in values:
            try:
                value = _convert(values.pop(f.name), f, hint)
                recorded = f.metadata.get("recorded")
                nested.setdefault(path, {})[f.name] = recorded(value) if recorded and isinstance(value, str) else value
            except _Invalid as e:
                if f.name in origins:  # a recipe's value: the file, its section and the key
                    raise CommandError(f"{origins[f.name]}: {e}") from None
                raise click.BadParameter(str(e), param_hint=f"'{long_flag(f)}'") from None
        elif default_of(f) is MISSING:
            name = f.name.upper() if f.metadata.get("argument") else long_flag(f)
            raise click.UsageError(f"{name} is required (on the command line or in the recipe)")
    hints = typing.get_type_hints(cls)
    kwargs = nested.pop(())
    try:  # a check of several settings together (__post_init__), of a nested group or the whole
        for path, sub in sorted(nested.items(), key=lambda p: -len(p[0])):
            assert len(path) == 1, "configs nest one level deep"
            kwargs[path[0]] = hints[path[0]](**sub)
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CommandError(str(e)) from e


# ---- errors ------------------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    """An error's message in one line. An error re-raised from a DataLoader worker carries the
    worker's traceback in its message; its own message is the traceback's last line."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if len(lines) > 1 and "Original Traceback" in lines[1]:
        return lines[-1].split(": ", 1)[-1]
    return lines[0]


def expected_failures(*errors: type[BaseException]):
    """Decorator for a command: the listed errors (and OSError: permission denied, a full disk,
    a read-only folder) become one-line CommandErrors (exit status 2); no traceback."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except click.ClickException:
                raise
            except OSError as e:
                where = f": {e.filename}" if e.filename else ""
                raise CommandError(f"{e.strerror or e}{where}") from e
            except errors as e:
                raise CommandError(one_line(e)) from e

        return wrapper

    return decorate


def stage_command(group: click.Group | None, name: str, config_cls, *errors: type[BaseException],
                  help: str | None = None):
    """Decorator: `fn(recipe, silent, **options)` as command `name` of `group` (None: a command of
    no group yet, which specfoundry/cli.py puts in one), with one option per field of `config_cls`,
    --recipe, --silent, and `errors` as one-line failures. `help`: the command's help where it is
    generated (else fn's docstring)."""

    def decorate(fn):
        @functools.wraps(fn)
        def quiet_when_silent(**options):  # click passes every parameter by name
            if options.get("silent"):
                hide_transformers_bars()
            return fn(**options)

        cmd = silent_option(expected_failures(*errors)(quiet_when_silent))
        command = click.command if group is None else group.command
        return command(name, context_settings=CONTEXT, help=help)(config_options(config_cls)(recipe_option(cmd)))

    return decorate
