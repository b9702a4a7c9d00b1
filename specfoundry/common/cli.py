"""The command-line layer every stage shares.

A stage's settings live in one frozen, keyword-only config dataclass; each field carries its
default and its help (`setting(...)`, or `shared(...)` for a concept that means the same in
every command). `config_options` turns those fields into click options, `resolve_config`
merges a recipe section under the command-line values, and `expected_failures` turns the
errors a user can cause into one-line click errors. So a setting, its default and its help are
written once, and the same concept has the same name, flag and help in every command.
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

from specfoundry.common.embedded import EMBEDDED_DEFAULT


class CommandError(click.ClickException):
    """The command could not run (bad input, bad option, a mismatch): exit status 2. Status 1
    is kept for a check that ran and found a problem (the gate failing, verify finding damage)."""

    exit_code = 2


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 110}

# Options that mean the same in every command: (flags, help, how the default is shown when it is None).
SHARED = {
    "output": (("-o", "--output"), "Output folder. Rerunning the same command into it continues the work (sf-eval "
               "repeats it); a rerun with other settings is refused, naming them.", None),
    "target": (("--target",), f"Target model: a local model directory, or an embedded one: '{EMBEDDED_DEFAULT}' "
               "(SmolLM2-135M-Instruct) or 'gemma3-270m' (Gemma-3-270M, a base model).", None),
    "device": (("--device",), "Torch device of the target.", "cuda if available, else cpu"),
    "dtype": (("--dtype",), "Torch dtype of the target (and the draft).", "bfloat16 on GPU, float32 on CPU"),
    "seed": (("--seed",), "Seed: the same command with the same seed writes the same output.", None),
    "max_new_tokens": (("--max-new-tokens",), "Tokens generated per answer, at most.", None),
    "max_batch_tokens": (("--max-batch-tokens",), "Token budget of one batch (padded tokens).", None),
    "max_steps": (("--max-steps",), "Optimizer steps of the training run.", None),
    "draft_tokens": (("-k", "--draft-tokens"), "Tokens the draft proposes per round (a chain of k).", None),
    "max_length": (("--max-length",), "Tokens per sample after the chat template, at most.", None),
    "limit": (("--limit",), "Use only the first N inputs.", "all"),
    "family": (("--family",), "Draft family: eagle3 (EAGLE-3 and its 3.1 options, Training-Time Test) or dflash "
               "(block-parallel).", None),
    "chat_template": (("--chat-template",), "How conversations become text: a Jinja chat template file (for a base "
                      "model without one, or to replace the target's), or 'completion' (plain text: the messages back "
                      "to back after BOS, each assistant text, then EOS, the loss region). Give the same one to every "
                      "stage that renders (regen, capture, eval, gate).",
                      "the target's own; completion for a target without one"),
    "strict": (("--strict",), "Fail on the first bad input instead of reporting and skipping it.", None),
}


def setting(default=MISSING, *, help: str, factory=None, flags: tuple[str, ...] = (), choices=None,
            shown: str | None = None, resume: bool = True, argument: bool = False, cli: bool = True,
            parse=None, repeatable: bool = False):
    """A config field with its help. `shown`: how a None (or computed) default reads in --help.
    `parse`: turns the text of the option (or a recipe's value) into the field's value.
    `resume=False`: where or how fast, not what is written; a resumed run may change it.
    `argument`: the command's positional input. `cli=False`: set by the command, not an option.
    `repeatable`: a tuple field given by repeating its option (a recipe gives a list)."""
    meta = {"help": help, "flags": flags, "choices": choices, "shown": shown, "resume": resume,
            "argument": argument, "cli": cli, "parse": parse, "repeatable": repeatable}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def shared(concept: str, default=MISSING, *, resume: bool = True, choices=None, shown: str | None = None):
    """A field for one of the SHARED concepts: its flags and help are the same in every command."""
    flags, help_text, none_shown = SHARED[concept]
    return setting(default, help=help_text, flags=flags, choices=choices, resume=resume,
                   shown=shown if shown is not None else none_shown)


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
    return click.option(*flags, f.name, type=click_type, default=default, help=meta["help"], show_default=show,
                        metavar="A,B,..." if is_tuple else None)


def config_options(cls, *, skip: tuple[str, ...] = ()):
    """Decorator: one click option (or the positional argument) per field of `cls`."""

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
    flags, help_text, none_shown = SHARED[concept]
    return click.option(*flags, concept, default=default, help=help_text,
                        show_default=none_shown if default is None else True)


def silent_option(fn):
    return click.option("--silent", is_flag=True, default=False, show_default=True,
                        help="No progress bars.")(fn)


# ---- config from options and recipe ------------------------------------------------------------

def read_recipe(path: str | None, section: str) -> dict:
    """The `section:` mapping of a recipe file ({} when there is no recipe or no such section)."""
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise CommandError(f"{path}: not valid YAML: {e}".splitlines()[0]) from e
    if not isinstance(data, dict) or not isinstance(data.get(section, {}), dict):
        raise CommandError(f"{path}: a recipe is a mapping of sections (regen:, capture:, train:, eval:)")
    return dict(data.get(section) or {})


def _convert(value, f: dataclasses.Field, hint):
    typ, is_tuple = _leaf_type(hint)
    hint_name = f"--{f.name.replace('_', '-')}"
    if value is None:
        return None
    if f.metadata.get("parse"):
        try:
            return f.metadata["parse"](value)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=hint_name) from e
    if is_tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        try:
            return tuple(typ(str(x).strip()) for x in items if str(x).strip())
        except ValueError as e:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {typ.__name__}",
                                     param_hint=hint_name) from e
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(f.metadata['choices'])}", param_hint=hint_name)
    return _typed(value, typ, hint_name)


def _typed(value, typ, hint_name: str):
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
        return str(value)
    else:
        return value
    raise click.BadParameter(f"{value!r} is not a {typ.__name__}", param_hint=hint_name)


def resolve_config(cls, section: str, recipe: str | None, options: dict, **fixed):
    """cls built from its defaults, then the recipe's `section`, then the options given on the
    command line, then `fixed`. Unknown recipe keys and missing required settings are one-line
    errors naming them."""
    values = read_recipe(recipe, section)
    ctx = click.get_current_context(silent=True)
    given = {k: v for k, v in options.items()
             if ctx is None or ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    values.update(given)
    values.update(fixed)
    return build_config(cls, values, source=f"{recipe}: {section}:" if recipe else "options")


def build_config(cls, values: dict, source: str = "options"):
    """cls from a flat mapping of field names (nested configs' fields flattened into it)."""
    aliases = {flag[2:].replace("-", "_"): f.name for f, _, _ in config_fields(cls)
               for flag in f.metadata.get("flags", ()) if flag.startswith("--")}
    values = {aliases.get(k, k): v for k, v in values.items()}  # a recipe may use the option's name too
    known = {f.name for f, _, _ in config_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CommandError(f"{source} unknown settings {', '.join(unknown)}")
    nested: dict[tuple[str, ...], dict] = {(): {}}
    for f, hint, path in config_fields(cls):
        if f.name in values:
            nested.setdefault(path, {})[f.name] = _convert(values.pop(f.name), f, hint)
        elif default_of(f) is MISSING:
            name = f.name.upper() if f.metadata.get("argument") else f"--{f.name.replace('_', '-')}"
            raise click.UsageError(f"{name} is required (on the command line or in the recipe)")
    hints = typing.get_type_hints(cls)
    kwargs = nested.pop(())
    for path, sub in sorted(nested.items(), key=lambda p: -len(p[0])):
        assert len(path) == 1, "configs nest one level deep"
        kwargs[path[0]] = hints[path[0]](**sub)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CommandError(f"{source} {e}") from e


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
