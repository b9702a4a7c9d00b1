"""Conversations with tools: the target's calls read from its text, compared with the recorded
ones (conversations/templates.py holds the check that a chat template renders tools at all).

Regeneration is semi-on-policy where tools are involved. The results of a tool exist only for the
calls the record made, so a regenerated assistant turn that calls tools is kept only when its
calls equal the recorded ones (the same functions with the same arguments, in any order; `kept`);
otherwise the recorded turn, calls and text, takes its place (`replaced`) and the conversation
goes on from the recorded exchange. The tool results are always kept as given. A turn where the
record answers in text but the target calls a tool is replaced by the recorded answer too.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from specfoundry.conversations.records import ToolCall, arguments_value
from specfoundry.conversations.templates import template_renders_tools

__all__ = ["calls_in", "parse_tool_calls", "same_calls", "template_renders_tools", "with_recorded_ids"]

CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
MISTRAL_CALLS = "[TOOL_CALLS]"


def calls_in(value) -> list[ToolCall] | None:
    """The calls a parsed JSON value states: {"name", "arguments" | "parameters"} or a list of
    them; None when it is not calls."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        try:
            arguments = arguments_value(item.get("arguments", item.get("parameters")))
        except ValueError:
            return None
        calls.append(ToolCall(item["name"], arguments))
    return calls or None


def json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """(the text outside the calls, the calls) of a generated answer, in the forms chat templates
    teach: `<tool_call>JSON</tool_call>` blocks (Hermes, Qwen, SmolLM3; a block holds one call or a
    list), Mistral's `[TOOL_CALLS]` followed by a JSON list, or an answer that is nothing but a JSON
    call or list of calls (Llama 3.1). A block whose JSON does not parse stays text."""
    calls: list[ToolCall] = []

    def take(match: re.Match) -> str:
        found = calls_in(json_value(match.group(1)))
        if found is None:
            return match.group(0)
        calls.extend(found)
        return ""

    rest = CALL_BLOCK.sub(take, text)
    if calls:
        return rest.strip(), tuple(calls)
    stripped = text.strip()
    if stripped.startswith(MISTRAL_CALLS):
        found = calls_in(json_value(stripped[len(MISTRAL_CALLS):].strip()))
        return ("", tuple(found)) if found else (text, ())
    found = calls_in(json_value(stripped)) if stripped[:1] in "{[" else None
    return ("", tuple(found)) if found else (text, ())


def same_calls(a: tuple[ToolCall, ...], b: tuple[ToolCall, ...]) -> bool:
    """The same functions with the same arguments, in any order (parallel calls have none)."""
    return Counter(c.key() for c in a) == Counter(c.key() for c in b)


def with_recorded_ids(generated: tuple[ToolCall, ...], recorded: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    """The generated calls (equal to the recorded ones) under the recorded calls' ids, so the
    recorded results still name the call they answer."""
    unused = list(recorded)
    out = []
    for call in generated:
        match = next(r for r in unused if r.key() == call.key())
        unused.remove(match)
        out.append(ToolCall(call.name, call.arguments, match.id))
    return tuple(out)
