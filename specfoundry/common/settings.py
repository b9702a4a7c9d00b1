"""Stage settings: the config dataclasses' fields, their valid values and what a config records.

A stage's settings live in one frozen, keyword-only config dataclass; each field carries its
default, its help and, for a number, its valid values (`setting(..., valid=Range(...))`, or
`shared(...)` for a concept that means the same in every command). Settings checks the values
when a config is built, however it is built; config_dict is what a run records beside its
output and resume_settings what a rerun must repeat. The click options are built from these
fields in cli.py; nothing here imports click.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path

from specfoundry.common.embedded import EMBEDDED, EMBEDDED_DEFAULT

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


MAX_TOKENS = 1 << 24
"""The most tokens a length setting takes (16.8M: longer than any target's context)."""
MAX_DRAFT = 256
"""The most tokens a draft proposes per round, and TTT steps trained (a DFlash block: one more)."""
MAX_SEED = 2**32 - 1
"""Seeds go to numpy too (through accelerate), which takes 0..2^32-1."""

# Options that mean the same in every command: (flags, help, how the default is shown when it is
# None, the valid values of a numeric one). A help of None: the command gives it (shared's `help`),
# generated where the command sits above what it describes.
SHARED = {
    "output": (("-o", "--output"), "Output folder: rerunning the same command into it continues the work (sf-eval "
               "repeats it), and a rerun with other settings is refused, naming them.", None, None),
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
    # what -k means differs by family: the commands above the families give its help (the catalogue's)
    "draft_tokens": (("-k", "--draft-tokens"), None, None, Range(1, MAX_DRAFT)),
    "max_length": (("--max-length",), "Tokens per sample after the chat template, at most.", None,
                   Range(1, MAX_TOKENS)),
    "limit": (("--limit",), "Use only the first N inputs.", "all", Range(1)),
    "family": (("--family",), None, None, None),  # its help: the catalogue's (families/)
    "chat_template": (("--chat-template",), "How conversations become text, the same in every stage: a Jinja chat "
                      "template file or 'completion' (plain text); docs/stages.md, \"Targets and chat templates\".",
                      "the target's own; completion for a target without one", None),
    "strict": (("--strict",), "Fail on the first bad input instead of reporting and skipping it.", None, None),
}

TEMPLATE_KWARGS_HELP = ("Arguments to the chat template, a JSON object such as '{\"enable_thinking\": false}' (a "
                        "recipe may give a mapping); docs/stages.md, \"Reasoning targets\".")


def parse_template_kwargs(value) -> dict | None:
    """--chat-template-kwargs: a JSON object (text) or a recipe's mapping -> a dict; a ValueError
    naming what is wrong otherwise."""
    import json

    if value is None or isinstance(value, dict):
        return None if value is None else dict(value)
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {value!r} is not JSON ({e.msg})") from None
    if not isinstance(out, dict):
        raise ValueError(f"--chat-template-kwargs {value!r} is not a JSON object")
    return out


def setting(default=MISSING, *, help: str, factory=None, flags: tuple[str, ...] = (), choices=None,
            shown: str | None = None, resume: bool = True, argument: bool = False, cli: bool = True,
            parse=None, repeatable: bool = False, valid: Range | None = None, before=None, path: bool = False,
            recorded=None):
    """A config field with its help. `shown`: how a None (or computed) default reads in --help.
    `parse`: turns the text of the option (or a recipe's value) into the field's value.
    `resume=False`: where or how fast, not what is written; a resumed run may change it.
    `argument`: the command's positional input. `cli=False`: set by the command, not an option.
    `repeatable`: a tuple field given by repeating its option (a recipe gives a list).
    `valid`: the values a numeric setting takes (every int and float setting declares them); a
    value outside is refused when the config is built, before any work, and --help shows them.
    `before`: the value that does what a run begun before this setting existed did (its record lacks
    the key): such a run resumes while the setting has this value (None where not given).
    `path`: a local file or folder (an `argument` always is one): its recorded form is absolute
    (absolute_path). `recorded`: for another string setting, the function giving its recorded form
    (the target's: recorded_target). A config is built with the recorded form, and a rerun's record
    is compared in it (recorded_forms), so a rerun from another directory, or the same folder
    spelled otherwise, is the same setting."""
    if valid is not None and valid.zero:
        help = f"{help.rstrip()} 0: {valid.zero}."
    meta = {"help": help, "flags": flags, "choices": choices, "shown": shown, "resume": resume,
            "argument": argument, "cli": cli, "parse": parse, "repeatable": repeatable, "valid": valid,
            "before": before, "recorded": recorded or (absolute_path if path or argument else None)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_device(value: str) -> str:
    """--device's value, checked before any work: a torch device this machine has."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"{value!r}: this torch sees no CUDA device (a CPU build, or no GPU here); use cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{value!r}: this machine has {count} CUDA device{'s' * (count > 1)} "
                             f"(cuda:0 to cuda:{count - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{value!r}: this torch has no MPS device; use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{value!r}: specfoundry runs on cpu, cuda or mps")
    return value


def recorded_target(value: str) -> str:
    """--target's recorded form: an embedded target's name as given, a local model directory
    absolute (absolute_path), so that a rerun from another directory resumes and each stage's
    manifest names where the weights are."""
    return value if value in EMBEDDED else absolute_path(value)


SHARED_PARSE = {"device": parse_device}
"""The SHARED concepts whose value is checked (and parsed) when the config is built."""

SHARED_RECORDED = {"target": recorded_target}
"""The SHARED concepts with a recorded form of their own (setting's `recorded`)."""


def shared(concept: str, default=MISSING, *, resume: bool = True, choices=None, shown: str | None = None,
           help: str | None = None):
    """A field for one of the SHARED concepts: its flags, help and valid values are the same in
    every command. `help`: for a concept whose help SHARED leaves to the command (the families'
    options, whose help the catalogue generates), and only for those."""
    flags, help_text, none_shown, valid = SHARED[concept]
    if (help_text is None) == (help is None):
        raise TypeError(f"shared({concept!r}): " + ("give its help (SHARED has none)" if help is None else
                                                    "its help is SHARED's, the same in every command"))
    return setting(default, help=help_text or help, flags=flags, choices=choices, resume=resume, valid=valid,
                   shown=shown if shown is not None else none_shown, parse=SHARED_PARSE.get(concept),
                   recorded=SHARED_RECORDED.get(concept))


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


def leaf_type(hint):
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


def absolute_path(value: str) -> str:
    """A path setting as it is recorded and compared: absolute, `~` expanded, symlinks resolved."""
    return str(Path(value).expanduser().resolve())


def recorded_forms(cfg) -> dict:
    """{name: the function giving its recorded form} of cfg's top-level settings that have one
    (setting's `path` and `recorded`)."""
    return {f.name: f.metadata["recorded"] for f in dataclasses.fields(cfg) if f.metadata.get("recorded")}


def resume_settings(cfg) -> dict:
    """What a rerun into the same output must repeat: the resumable settings, less what the config's
    `unread_groups()` names (settings groups the run never reads: sf-train's other families')."""
    out = config_dict(cfg, resume_only=True)
    unread = cfg.unread_groups() if hasattr(cfg, "unread_groups") else ()
    return {k: v for k, v in out.items() if k not in unread}


class SettingsGroup(dict):
    """as_before's value for a nested group of settings (a dict a setting's own value may be too)."""


def as_before(cfg) -> SettingsGroup:
    """Each setting's value that does what a run begun before it existed did (setting(before=...);
    None where not declared), nested as config_dict nests: common.shards.settings_diff's yardstick
    for a key an earlier run's record lacks."""
    out = SettingsGroup()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = as_before(value) if dataclasses.is_dataclass(value) else f.metadata.get("before")
    return out
