"""The command-line layer every stage shares.

A stage's settings live in one frozen, keyword-only config dataclass; each field carries its
default, its help and, for a number, its valid values (`setting(..., valid=Range(...))`, or
`shared(...)` for a concept that means the same in every command). `config_options` turns those
fields into click options, `resolve_config` merges a recipe section under the command-line
values, and `expected_failures` turns the errors a user can cause into one-line click errors. So
a setting, its default, its help and its range are written once, checked when the config is
built (before any model loads or anything is recorded), and the same concept has the same name,
flag, help and range in every command.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path

import click
import yaml
from click.core import ParameterSource

from specfoundry.common.embedded import EMBEDDED_DEFAULT
from specfoundry.families import FAMILIES


class CommandError(click.ClickException):
    """The command could not run (bad input, bad option, a mismatch): exit status 2. Status 1
    is kept for a check that ran and found a problem (the gate failing, verify finding damage)."""

    exit_code = 2


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 110}

RECIPE_SECTIONS = ("regen", "capture", "train", "export", "eval", "gate")


# ---- valid values ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: from `min` to `max` (None: unbounded; `*_open`: the
    bound itself excluded), always finite. `zero`: what 0 means where it is a switch rather than
    an ordinary value ('off', 'greedy', ...); --help shows it and the range."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    zero: str | None = None

    def describe(self) -> str:
        """The range as --help shows it: 'x>=1', '0<=x<1', '1<=x<=16,777,216', 'any finite number'."""
        lo, hi = _number(self.min), _number(self.max)
        if self.min is None and self.max is None:
            return "any finite number"
        if self.min is None:
            return f"x{'<' if self.max_open else '<='}{hi}"
        if self.max is None:
            return f"x{'>' if self.min_open else '>='}{lo}"
        return f"{lo}{'<' if self.min_open else '<='}x{'<' if self.max_open else '<='}{hi}"

    def problem(self, value) -> str | None:
        """Why `value` is not in the range, or None when it is."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a finite number"
        below = self.min is not None and (value <= self.min if self.min_open else value < self.min)
        above = self.max is not None and (value >= self.max if self.max_open else value > self.max)
        return f"{value} is not in the range {self.describe()}" if below or above else None


def _number(x) -> str:
    return f"{int(x):,}" if x is not None and float(x).is_integer() else f"{x}"


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


MAX_TOKENS = 1 << 24
"""The most tokens a length setting takes (16.8M: longer than any target's context)."""
MAX_DRAFT = 256
"""The most tokens a draft proposes per round, and TTT steps trained (a DFlash block: one more)."""
MAX_SEED = 2**32 - 1
"""Seeds go to numpy too (through accelerate), which takes 0..2^32-1."""

# Options that mean the same in every command: (flags, help, how the default is shown when it is
# None, the valid values of a numeric one).
SHARED = {
    "output": (("-o", "--output"), "Output folder. Rerunning the same command into it continues the work (sf-eval "
               "repeats it); a rerun with other settings is refused, naming them.", None, None),
    "target": (("--target",), f"Target model: a local model directory, or an embedded one: '{EMBEDDED_DEFAULT}' "
               "(SmolLM2-135M-Instruct) or 'gemma3-270m' (Gemma-3-270M, a base model).", None, None),
    "device": (("--device",), "Torch device of the target.", "cuda if available, else cpu", None),
    "dtype": (("--dtype",), "Torch dtype of the target (and the draft).", "bfloat16 on GPU, float32 on CPU", None),
    "seed": (("--seed",), "Seed: the same command with the same seed writes the same output.", None,
             Range(0, MAX_SEED)),
    "max_new_tokens": (("--max-new-tokens",), "Tokens generated per answer, at most.", None, Range(1, MAX_TOKENS)),
    "max_batch_tokens": (("--max-batch-tokens",), "Token budget of one batch (padded tokens).", None,
                         Range(1, 1 << 30)),
    "max_steps": (("--max-steps",), "Optimizer steps of the training run.", None, Range(1)),
    "draft_tokens": (("-k", "--draft-tokens"), "Tokens the draft proposes per round: EAGLE-3's chain of k; "
                     "P-EAGLE's first k depths (at most its trained K). A DFlash, Domino or DSpark draft "
                     "proposes its trained block (sf-eval warns that -k is ignored); the gate trains it blocks of "
                     "about k+1.", None,
                     Range(1, MAX_DRAFT)),
    "max_length": (("--max-length",), "Tokens per sample after the chat template, at most.", None,
                   Range(1, MAX_TOKENS)),
    "limit": (("--limit",), "Use only the first N inputs.", "all", Range(1)),
    "family": (("--family",), "Draft family: " + "; ".join(f"{f.name}: {f.summary}" for f in FAMILIES.families.values())
               + ".", None, None),
    "chat_template": (("--chat-template",), "How conversations become text: a Jinja chat template file (for a base "
                      "model without one, or to replace the target's), or 'completion' (plain text: the messages back "
                      "to back after BOS, each assistant text, then EOS, the loss region). Give the same one to every "
                      "stage that renders (regen, capture, eval, gate).",
                      "the target's own; completion for a target without one", None),
    "strict": (("--strict",), "Fail on the first bad input instead of reporting and skipping it.", None, None),
}


def setting(default=MISSING, *, help: str, factory=None, flags: tuple[str, ...] = (), choices=None,
            shown: str | None = None, resume: bool = True, argument: bool = False, cli: bool = True,
            parse=None, repeatable: bool = False, valid: Range | None = None):
    """A config field with its help. `shown`: how a None (or computed) default reads in --help.
    `parse`: turns the text of the option (or a recipe's value) into the field's value.
    `resume=False`: where or how fast, not what is written; a resumed run may change it.
    `argument`: the command's positional input. `cli=False`: set by the command, not an option.
    `repeatable`: a tuple field given by repeating its option (a recipe gives a list).
    `valid`: the values a numeric setting takes (every int and float setting declares them); a
    value outside is refused when the config is built, before any work, and --help shows them."""
    if valid is not None and valid.zero:
        help = f"{help.rstrip()} 0: {valid.zero}."
    meta = {"help": help, "flags": flags, "choices": choices, "shown": shown, "resume": resume,
            "argument": argument, "cli": cli, "parse": parse, "repeatable": repeatable, "valid": valid}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def shared(concept: str, default=MISSING, *, resume: bool = True, choices=None, shown: str | None = None):
    """A field for one of the SHARED concepts: its flags, help and valid values are the same in
    every command."""
    flags, help_text, none_shown, valid = SHARED[concept]
    return setting(default, help=help_text, flags=flags, choices=choices, resume=resume, valid=valid,
                   shown=shown if shown is not None else none_shown)


def long_flag(f: dataclasses.Field) -> str:
    """The option a field is given with on the command line: '--shard-size', '--draft-tokens'."""
    return next((x for x in f.metadata.get("flags", ()) if x.startswith("--")), "--" + f.name.replace("_", "-"))


def check_valid(f: dataclasses.Field, value) -> str | None:
    """Why a field's value is outside its declared range, or None (None values and non-numeric
    fields are not numbers to check)."""
    valid = f.metadata.get("valid")
    if valid is None or value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return valid.problem(value)


class Settings:
    """The base of every stage config: each numeric field is checked against its declared range
    when the config is built, however it is built (build_config checks given values first, naming
    the option or recipe key they came from)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            problem = check_valid(f, getattr(self, f.name))
            if problem:
                raise ValueError(f"{long_flag(f)}: {problem}")


# ---- options from a config ---------------------------------------------------------------------

def _leaf_type(hint):
    """(python type, is a tuple) of a field's annotation, None stripped."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def config_fields(cls) -> list[tuple[dataclasses.Field, type, tuple[str, ...]]]:
    """(field, its annotation, the path of nested config fields above it), nested configs flattened."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += [(g, h, (f.name, *p)) for g, h, p in config_fields(hint)]
        else:
            out.append((f, hint, ()))
    return out


def unique_options(cls):
    """Class decorator: refuse, when the class is defined, a config whose options collide: two fields
    (nested groups flattened: a family's options) of one name, or one flag given twice. A recipe
    key and an option name one field each, so a key can never reach another group's setting."""
    seen: dict[str, str] = {}
    for f, _, path in config_fields(cls):
        where = ".".join((*path, f.name))
        keys = {f.name, *(x.lstrip("-").replace("-", "_") for x in f.metadata.get("flags", ()) if x.startswith("--"))}
        keys |= {x for x in f.metadata.get("flags", ()) if not x.startswith("--")}  # short flags as given
        for key in keys:
            if key in seen and seen[key] != where:
                raise TypeError(f"{cls.__name__}: option {key!r} of {where} collides with {seen[key]}'s: every "
                                "option name is one setting (a family reads its parent's group, never redefines it)")
            seen[key] = where
    return cls


def default_of(f: dataclasses.Field):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


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
    typ, is_tuple = _leaf_type(hint)
    meta = f.metadata
    flags = meta.get("flags") or ("--" + f.name.replace("_", "-"),)
    if meta.get("argument"):
        return click.argument(f.name, required=False, type=click.Path() if typ is str else typ)
    default, show = _click_default(f, is_tuple)
    if meta.get("repeatable"):
        return click.option(*flags, f.name, multiple=True, type=str, help=meta["help"], show_default=show)
    if typ is bool:
        long = flags[-1]
        return click.option(*flags[:-1], f"{long}/--no-{long[2:]}", f.name, default=bool(default),
                            help=meta["help"], show_default=show)
    click_type = click.Choice(meta["choices"]) if meta.get("choices") else (
        str if is_tuple or meta.get("parse") else typ)
    if meta.get("valid") is not None and click_type in (int, float):
        click_type = IntIn(meta["valid"]) if click_type is int else FloatIn(meta["valid"])
    return click.option(*flags, f.name, type=click_type, default=default, help=meta["help"], show_default=show,
                        metavar="A,B,..." if is_tuple else None)


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
                        help="YAML recipe with regen:, capture:, train:, export:, eval: and gate: sections (keys: "
                             "the options' names with underscores); the command reads its own section, and "
                             "command-line options override it.")(fn)


def shared_option(concept: str, default=None):
    """A click option for a SHARED concept on a command without a config field for it."""
    flags, help_text, none_shown, _ = SHARED[concept]
    return click.option(*flags, concept, default=default, help=help_text,
                        show_default=none_shown if default is None else True)


def silent_option(fn):
    return click.option("--silent", is_flag=True, default=False, show_default=True,
                        help="No progress bars.")(fn)


# ---- config from options and recipe ------------------------------------------------------------

def read_recipe(path: str | None, section: str) -> dict:
    """The `section:` mapping of a recipe file ({} when there is no recipe or no such section).
    An empty recipe, or a section no command reads (a misspelt `Train:`), is an error naming it:
    either would leave the command running with its defaults."""
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise CommandError(f"{path}: not valid YAML: {e}".splitlines()[0]) from e
    if data is None:
        raise CommandError(f"{path}: the recipe is empty (a recipe has {', '.join(s + ':' for s in RECIPE_SECTIONS)} "
                           "sections)")
    if not isinstance(data, dict) or not isinstance(data.get(section, {}), dict | None):
        raise CommandError(f"{path}: a recipe is a mapping of sections ({', '.join(s + ':' for s in RECIPE_SECTIONS)})")
    unknown = [str(k) for k in data if k not in RECIPE_SECTIONS]
    if unknown:
        raise CommandError(f"{path}: unknown section{'s' if len(unknown) > 1 else ''} "
                           f"{', '.join(k + ':' for k in unknown)} (a recipe has "
                           f"{', '.join(s + ':' for s in RECIPE_SECTIONS)} sections)")
    return dict(data.get(section) or {})


def _optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


class _Invalid(Exception):
    """A value a field cannot take (build_config names where it came from)."""


def _convert(value, f: dataclasses.Field, hint):
    """A given value (a recipe's, or an option's text) as the field's value, checked against its
    declared range; _Invalid says why not."""
    typ, is_tuple = _leaf_type(hint)
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


def resolve_config(cls, section: str, recipe: str | None, options: dict, **fixed):
    """cls built from its defaults, then the recipe's `section`, then the options given on the
    command line, then `fixed`. Unknown recipe keys, missing required settings and values a
    setting cannot take are one-line errors naming the option, or the recipe file and key.
    Inside a command, the output folder is then held for the command's life (hold_output)."""
    values = read_recipe(recipe, section)
    origins = {k: f"{recipe}: {section}: {k}" for k in values}
    ctx = click.get_current_context(silent=True)
    given = {k: v for k, v in options.items()
             if ctx is None or ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    values.update(given)
    values.update(fixed)
    for k in (*given, *fixed):
        origins.pop(k, None)
    cfg = build_config(cls, values, source=f"{recipe}: {section}:" if recipe else "options", origins=origins)
    if ctx is not None and section in LOCKED and getattr(cfg, "output", None):
        hold_output(ctx, cfg.output, section)
    return cfg


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
                nested.setdefault(path, {})[f.name] = _convert(values.pop(f.name), f, hint)
            except _Invalid as e:
                if f.name in origins:  # a recipe's value: the file, its section and the key
                    raise CommandError(f"{origins[f.name]}: {e}") from None
                raise click.BadParameter(str(e), param_hint=f"'{long_flag(f)}'") from None
        elif default_of(f) is MISSING:
            name = f.name.upper() if f.metadata.get("argument") else long_flag(f)
            raise click.UsageError(f"{name} is required (on the command line or in the recipe)")
    hints = typing.get_type_hints(cls)
    kwargs = nested.pop(())
    for path, sub in sorted(nested.items(), key=lambda p: -len(p[0])):
        assert len(path) == 1, "configs nest one level deep"
        kwargs[path[0]] = hints[path[0]](**sub)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a check of several settings together (__post_init__)
        raise CommandError(str(e)) from e


# ---- what a config records -------------------------------------------------------------------

def config_dict(cfg, resume_only: bool = False) -> dict:
    """Every field of a config, as JSON reads it back; with resume_only, only the fields that
    decide what a run writes (those a resumed run must repeat, not those marked resume=False)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if resume_only and not f.metadata.get("resume", True):
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = config_dict(value, resume_only)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def resume_settings(cfg) -> dict:
    """What a rerun into the same output must repeat."""
    return config_dict(cfg, resume_only=True)


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


def stage_command(group: click.Group, name: str, config_cls, *errors: type[BaseException]):
    """Decorator: `fn(recipe, silent, **options)` as command `name` of `group`, with one option
    per field of `config_cls`, --recipe, --silent, and `errors` as one-line failures."""

    def decorate(fn):
        cmd = silent_option(expected_failures(*errors)(fn))
        return group.command(name, context_settings=CONTEXT)(config_options(config_cls)(recipe_option(cmd)))

    return decorate
