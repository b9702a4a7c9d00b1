"""Conversation records: the shapes accepted, one record normalised, what is wrong with a bad one.

Accepted shapes (one conversation per record):
  OpenAI:   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}]}
            (a content may be a list of text parts, [{"type": "text", "text": "..."}], joined by newlines)
  ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}]}
An optional "id" is kept. Conversations with tools (OpenAI shape): a record-level "tools" list
(the function schemas the chat template is given), assistant messages with "tool_calls"
([{"id", "type": "function", "function": {"name", "arguments"}}], arguments a JSON object or its
text) and "tool" messages with the results ("tool_call_id" naming the call they answer). Bad records are never fatal here: each becomes a ``BadInput`` that
names its file and line (jsonl) or row (json/parquet), and the caller decides (report and
skip, or fail under --strict).
"""


from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
    "function": "tool",  # OpenAI's earlier name of the tool role
}


class ConversationFormatError(ValueError):
    """Raised under --strict for the first bad record."""


@dataclass(frozen=True)
class ToolCall:
    """One function call an assistant message makes."""

    name: str
    arguments: object  # the parsed JSON arguments (an object, as chat templates expect)
    id: str | None = None

    def key(self) -> tuple[str, str]:
        """What identifies the call: its name and its arguments (key order aside)."""
        return self.name, json.dumps(self.arguments, sort_keys=True)

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call answered
    name: str | None = None  # tool messages: the function's name, where the record gives it
    thinking: str | None = None  # assistant messages: the reasoning, where a channel template reads it apart

    def to_dict(self) -> dict:
        """The message as chat templates take it (tool fields and thinking only where set)."""
        out = {"role": self.role, "content": self.content}
        if self.thinking is not None:
            out["thinking"] = self.thinking
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def records_sha256(conversations: list[Conversation]) -> str:
    """What a shard is made from: a hash of its conversations (ids, where each was read, messages,
    tools), recorded in its done mark, so a rerun notices a source that changed since."""
    records = [{"id": c.id, "location": c.location, "messages": [m.to_dict() for m in c.messages],
                "tools": list(c.tools) if c.tools else None, **({"mode": c.mode} if c.mode else {})}
               for c in conversations]
    return hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()


def arguments_value(arguments):
    """Tool-call arguments given as JSON text or as the object itself -> the object (a
    json.JSONDecodeError, a ValueError, when the text is not JSON)."""
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return {} if arguments is None else arguments


def with_json_arguments(message: dict) -> dict:
    """A message dict with its tool calls' arguments as JSON text (the OpenAI API's form, and how
    sf-regen stores them)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


class ChatMessages(list):
    """A list of message dicts that also carries the conversation's `tools` (None when it has
    none) and its chat-template arguments (`template_kwargs`, its mode's: {} for none), so a
    renderer given only the messages renders them as the conversation was generated."""

    def __init__(self, messages, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        super().__init__(messages)
        self.tools = tools
        self.template_kwargs = dict(template_kwargs or {})


REASONING = ("keep", "drop")
"""sf-regen --reasoning: keep the target's reasoning with its answer, or keep the answer only."""


def template_arguments(messages) -> dict:
    """apply_chat_template's keyword arguments for `messages` (a ChatMessages or a plain list):
    the conversation's tools and its mode's template arguments."""
    tools = getattr(messages, "tools", None)
    return {**(getattr(messages, "template_kwargs", None) or {}), **({"tools": list(tools)} if tools else {})}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]
    location: str  # "file.jsonl:12" (line) or "file.parquet:row 3"
    tools: tuple[dict, ...] | None = None  # function schemas given to the chat template
    mode: dict | None = None  # how it was generated: {chat_template_kwargs, reasoning} (sf-regen's rows)

    def to_messages(self) -> ChatMessages:
        return ChatMessages([m.to_dict() for m in self.messages], list(self.tools) if self.tools else None,
                            self.template_kwargs)

    @property
    def template_kwargs(self) -> dict:
        """The chat-template arguments it was generated with ({}: the template's defaults)."""
        return dict((self.mode or {}).get("chat_template_kwargs") or {})

    @property
    def num_assistant_turns(self) -> int:
        return sum(m.role == "assistant" for m in self.messages)

    @property
    def ends_open(self) -> bool:
        """Whether the last turn is a user turn with no answer yet (a prompt: sf-regen answers it)."""
        return self.messages[-1].role == "user"

    @property
    def turns_to_answer(self) -> int:
        """The assistant turns sf-regen writes: every recorded one, and the open last one."""
        return self.num_assistant_turns + self.ends_open

    @property
    def num_tool_exchanges(self) -> int:
        """Assistant messages that call tools (each with the results that answer it: one exchange)."""
        return sum(bool(m.tool_calls) for m in self.messages)


@dataclass(frozen=True)
class BadInput:
    location: str
    kind: str  # malformed_json | invalid_utf8 | bad_mode | missing_role | missing_content | unknown_role | empty_conversation | ends_on_user | ends_on_tool | no_assistant_turn | starts_on_assistant | over_long_prompt | no_user_turn | bad_tool_call | bad_tools | orphan_tool_result | duplicate_id | empty_answer | template
    detail: str

    def __str__(self) -> str:
        return f"{self.location}: {self.kind}: {self.detail}"


@dataclass
class LoadResult:
    conversations: list[Conversation] = field(default_factory=list)
    bad: list[BadInput] = field(default_factory=list)



def normalise(record: dict, location: str, default_id: str, prompt_only: bool = False,
              answer_open: bool = False) -> Conversation | BadInput:
    """One record in any accepted shape -> Conversation, or the first thing wrong with it.

    prompt_only: the record is a prompt to answer (sf-eval): it must end on a user turn, and
    a trailing assistant turn (a reference answer) is dropped. answer_open: a conversation may end
    on a user turn with no answer yet, with or without assistant turns before it (sf-regen answers
    it); without, there must be an answer to learn from (sf-capture)."""
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations", record.get("conversation"))
    if turns is None:
        return BadInput(location, "empty_conversation", "no 'messages' or 'conversations' field")
    if not isinstance(turns, list):
        field = next(k for k in ("messages", "conversations", "conversation") if record.get(k) is turns)
        return BadInput(location, "empty_conversation", f"'{field}' is a {type(turns).__name__}, not a list of turns")
    if not turns:
        return BadInput(location, "empty_conversation", "the conversation has no turns")
    messages = []
    try:
        tools = parse_tools(record.get("tools"))
        mode = parse_mode(record.get("mode"))
        for t, turn in enumerate(turns):
            messages.append(parse_message(turn, t, messages))
    except BadRecord as e:
        return BadInput(location, e.kind, e.detail)
    non_system = [m for m in messages if m.role != "system"]
    if not non_system:
        return BadInput(location, "empty_conversation", "only a system prompt")
    if prompt_only:
        if non_system[-1].role == "assistant":
            messages = messages[:-1]
        if not messages or messages[-1].role != "user":
            return BadInput(location, "no_user_turn", "a prompt must end on a user turn")
        return Conversation(str(record.get("id") or default_id), tuple(messages), location, tools, mode)
    if not any(m.role == "assistant" for m in non_system) and not (answer_open and non_system[-1].role == "user"):
        return BadInput(location, "no_assistant_turn", "no assistant turn to learn from")
    if messages[0].role == "assistant":  # a chat template renders no prompt before it: nothing it answers
        return BadInput(location, "starts_on_assistant", "turn 0 is an assistant turn with nothing before it (a "
                                                         "greeting): no prompt to regenerate or train it from")
    if non_system[-1].role == "user" and not answer_open:
        return BadInput(location, "ends_on_user", "the last turn is a user turn with no answer")
    if non_system[-1].role == "tool":
        return BadInput(location, "ends_on_tool", "the last turn is a tool result with no answer")
    conv_id = str(record.get("id", default_id)) if record.get("id") is not None else default_id
    return Conversation(conv_id, tuple(messages), location, tools, mode)


class BadRecord(Exception):
    """What is wrong with one record (a BadInput's kind and detail, without its location)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def text_of_parts(parts: list, t: int) -> str:
    """OpenAI's content as a list of parts ([{"type": "text", "text": ...}, ...]) as one text, the
    parts joined by newlines (as vLLM's chat front end joins them); a part of another type (an
    image, audio) is refused: the targets here read text."""
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"of type {kind!r}" if kind else f"a {type(part).__name__}"
            raise BadRecord("missing_content", f"turn {t}: content part {i} is {what}, not a text part "
                                               '({"type": "text", "text": ...}): only text is trained on')
        texts.append(part["text"])
    return "\n".join(texts)


def check_unicode(text: str, where: str) -> None:
    """A string JSON decoded with a lone surrogate escape ("\\ud800") is no Unicode text: no tokenizer
    encodes it (each raised a traceback deep in the tokenizer), so its record is bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord("invalid_utf8", f"{where} holds a lone surrogate escape (\\u{ord(text[e.start]):04x} at "
                                        f"character {e.start}): not Unicode text") from None


def parse_message(turn, t: int, before: list[Message]) -> Message:
    """Turn `t` as a Message; `before`: the turns so far (a tool result must answer the last call)."""
    if not isinstance(turn, dict):
        raise BadRecord("missing_role", f"turn {t} is not an object")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role is None:
        raise BadRecord("missing_role", f"turn {t} has no 'role' or 'from'")
    if str(role).lower() not in ROLE_ALIASES:
        raise BadRecord("unknown_role", f"turn {t} has unknown role {role!r}")
    role = ROLE_ALIASES[str(role).lower()]
    if role != "assistant" and turn.get("tool_calls"):
        raise BadRecord("bad_tool_call", f"turn {t} is a {role} message with tool_calls (only an assistant message "
                                         "calls tools)")
    calls = parse_tool_calls(turn.get("tool_calls"), t) if role == "assistant" else ()
    if content is None and calls:
        content = ""  # an assistant message that only calls tools
    if isinstance(content, list):
        content = text_of_parts(content, t)
    if not isinstance(content, str):
        raise BadRecord("missing_content", f"turn {t} has no text content")
    thinking = turn.get("thinking")
    if thinking is not None and (role != "assistant" or not isinstance(thinking, str)):
        raise BadRecord("missing_content", f"turn {t}: 'thinking' (a channel template's reasoning) must be the text "
                                           f"of an assistant message, not a {type(thinking).__name__} in a {role} one")
    for name, text in (("content", content), ("thinking", thinking or "")):
        check_unicode(text, f"turn {t}: {name}")
    if role != "tool":
        return Message(role, content, calls, thinking=thinking)
    call_id, name = turn.get("tool_call_id"), turn.get("name")
    exchange = next((m for m in reversed(before) if m.role != "tool"), None)
    if exchange is None or not exchange.tool_calls:
        raise BadRecord("orphan_tool_result", f"turn {t} is a tool result that follows no assistant tool call")
    if call_id is not None and str(call_id) not in {c.id for c in exchange.tool_calls}:
        raise BadRecord("orphan_tool_result",
                        f"turn {t} answers call {call_id!r}, which the assistant turn before did not make")
    return Message("tool", content, (), None if call_id is None else str(call_id), None if name is None else str(name))


def parse_tool_calls(calls, t: int) -> tuple[ToolCall, ...]:
    """An assistant turn's tool_calls (OpenAI's {"id", "function": {"name", "arguments"}} or the
    flat {"name", "arguments"}), arguments given as JSON text or an object."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise BadRecord("bad_tool_call", f"turn {t}: tool_calls is not a list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRecord("bad_tool_call", f"turn {t} tool call {k} has no function name")
        try:
            arguments = arguments_value(fn.get("arguments"))
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tool_call", f"turn {t} tool call {k}: arguments are not JSON ({e.msg})") from e
        call_id = call.get("id")
        out.append(ToolCall(fn["name"], arguments, None if call_id is None else str(call_id)))
    return tuple(out)


def parse_mode(mode) -> dict | None:
    """A record's mode (sf-regen's rows: {"chat_template_kwargs": {...}, "reasoning": "keep"|"drop"},
    as an object or its JSON text); None where it has none."""
    if mode is None:
        return None
    if isinstance(mode, str):
        try:
            mode = json.loads(mode)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_mode", f"'mode' is not JSON ({e.msg})") from e
    if not isinstance(mode, dict) or not isinstance(mode.get("chat_template_kwargs", {}), dict) \
            or mode.get("reasoning", "keep") not in REASONING:
        raise BadRecord("bad_mode", "'mode' is not {chat_template_kwargs: an object, reasoning: keep or drop}")
    return mode or None


def parse_tools(tools) -> tuple[dict, ...] | None:
    """A record's tools list (a list of objects, or its JSON text)."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tools", f"'tools' is not JSON ({e.msg})") from e
    if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
        raise BadRecord("bad_tools", "'tools' is not a list of objects")
    return tuple(tools) or None
