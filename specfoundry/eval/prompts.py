"""sf-eval's prompts: the built-in held-out sets and users' dataset files, rendered with the
target's chat template in each mode the evaluation asks for (chat-template arguments)."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from jinja2 import TemplateError

from specfoundry.conversations.sources import load_conversations
from specfoundry.conversations.templates import prompt_ids, template_bad_input, tools_template_problem
from specfoundry.families.folders import DraftRef, training_record

BUILTIN_SETS = ("chat", "code", "math", "multiturn")


class EvalError(ValueError):
    """A user-facing problem with an evaluation (bad prompt set, draft and target that disagree)."""


def parse_modes(value) -> tuple[dict, ...]:
    """--modes: a JSON list of objects (or a recipe's list of mappings)."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--modes {value!r} is not JSON ({e.msg})") from None
    if not isinstance(items, list) or not items or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"--modes {value!r} is not a non-empty JSON list of objects")
    return tuple(dict(x) for x in items)


def mode_label(kwargs: dict) -> str:
    """A mode as reports name it: 'enable_thinking=false', 'default' for the template's own."""
    return ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(kwargs.items())) or "default"


def eval_modes(modes: tuple[dict, ...], template_kwargs: dict | None, ref: DraftRef) -> tuple[list[dict], str]:
    """(the chat-template arguments of each mode to evaluate, where they came from): --modes,
    else --chat-template-kwargs, else the mode the draft's feature set was rendered in (the most
    common one where it holds several), else the template's defaults."""
    if modes:
        return [dict(m) for m in modes], "--modes"
    if template_kwargs is not None:
        return [dict(template_kwargs)], "--chat-template-kwargs"
    recorded = (training_record(ref) or {}).get("modes") or {}
    if recorded:
        return [recorded_mode(recorded, ref)], "the draft's feature set"
    return [{}], "the template's defaults"


def recorded_mode(recorded, ref: DraftRef) -> dict:
    """The chat-template arguments of the most common mode a training record's `modes` counts
    ({mode JSON: samples}); EvalError naming the record where it is not that (a hand-edited file)."""
    try:
        top = max(recorded, key=lambda m: recorded[m])
        kwargs = json.loads(top).get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise TypeError("chat_template_kwargs is not an object")
        return dict(kwargs)
    except (TypeError, ValueError, AttributeError) as e:
        raise EvalError(f"{ref.path}: the training record's 'modes' is not {{mode JSON: samples}} ({e}): pass "
                        "--modes or --chat-template-kwargs, or restore the file") from None


def prompt_source(name: str) -> Path:
    """A built-in set's file (held out: never used for training), or a user's dataset file."""
    if name in BUILTIN_SETS:
        return Path(str(files("specfoundry.eval") / "prompts" / f"{name}.jsonl"))
    path = Path(name)
    if not path.exists():
        raise EvalError(f"prompt set {name!r} is neither a built-in set {list(BUILTIN_SETS)} nor an existing file")
    return path


def load_prompts(name: str, tokenizer, limit: int | None = None, template_kwargs: dict | None = None
                 ) -> list[tuple[str, list[int]]]:
    """[(id, prompt token ids)] rendered with the target's chat template and generation prompt, in
    the mode `template_kwargs` gives."""
    loaded = load_conversations(prompt_source(name), limit=limit, prompt_only=True)
    if loaded.bad:
        raise EvalError(f"bad prompt: {loaded.bad[0]}")
    if not loaded.conversations:
        raise EvalError(f"prompt set {name!r} has no prompts")
    problem = tools_template_problem(loaded.conversations, tokenizer)  # the check sf-regen and sf-capture apply
    if problem:
        raise EvalError(problem)
    rendered = []
    for conv in loaded.conversations:
        messages = conv.to_messages()
        messages.template_kwargs = dict(template_kwargs or {})
        try:
            rendered.append((conv.id, prompt_ids(tokenizer, messages)))
        except TemplateError as e:  # the template's raise_exception for this prompt ("roles must alternate")
            raise EvalError(f"bad prompt: {template_bad_input(conv, e)}") from None
    return rendered
