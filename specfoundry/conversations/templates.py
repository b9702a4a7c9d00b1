"""What a chat template must render for a conversation, checked by every stage that renders one
(regen, capture, eval), and the prompt it renders before an assistant turn."""

from __future__ import annotations

from specfoundry.conversations.records import BadInput, Conversation, ToolCall, template_arguments

PROBE = "specfoundry_probe"


def template_bad_input(conv: Conversation, error: Exception) -> BadInput:
    """A record the chat template refused to render (its raise_exception: Mistral's and Gemma's "roles
    must alternate"), or rendered without its assistant text, as that record's bad input."""
    import jinja2

    detail = f"the chat template raised: {error}" if isinstance(error, jinja2.TemplateError) else str(error)
    return BadInput(conv.location, "template", detail)


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows a tools list, an assistant's tool call and its
    arguments, and a tool result (a template that ignores them would train the draft on text the
    target never saw)."""
    tools = [{"type": "function", "function": {"name": f"{PROBE}_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "?"},
                {"role": "assistant", "content": "", "tool_calls": [ToolCall(
                    f"{PROBE}_call", {f"{PROBE}_argument": f"{PROBE}_value"}, "call_0").to_dict()]},
                {"role": "tool", "tool_call_id": "call_0", "content": f"{PROBE}_result"},
                {"role": "assistant", "content": "!"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may raise on a role or field it does not know
        return False
    return all(f"{PROBE}_{part}" in text for part in ("tool", "call", "argument", "value", "result"))


def uses_tools(conv: Conversation) -> bool:
    return bool(conv.tools) or conv.num_tool_exchanges > 0


def tools_template_problem(conversations: list[Conversation], tokenizer) -> str | None:
    """The check every stage that renders conversations (regen, capture, eval) applies: tool
    conversations need a chat template that renders tools, calls and results. A template that
    drops them (SmolLM2's) would turn each call into an empty assistant turn and lose the tools
    list. The one-line refusal naming the first such conversation, or None."""
    from specfoundry.common.target import chat_template_source

    first = next((c for c in conversations if uses_tools(c)), None)
    if first is None or tokenizer is None or template_renders_tools(tokenizer):
        return None
    source = chat_template_source(tokenizer)
    template = "the target's own" if source == "target" else source
    return (f"{first.location}: a conversation with tools, but the chat template ({template}) does not render "
            "tools, tool calls and tool results: give --chat-template FILE with one that does (docs/stages.md, "
            "Conversations with tools)")


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template up to the assistant's generation prompt (with the conversation's tools
    and template arguments, where it has some), as token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **template_arguments(messages))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # some versions return a BatchEncoding


def template_variables(tokenizer) -> set[str] | None:
    """The names the tokenizer's chat template reads from its context (jinja2.meta's undeclared
    variables: `messages`, `add_generation_prompt`, `enable_thinking`, ...), every named template's
    where it has several; None where it has no template or its source does not parse (rendering
    reports that)."""
    import jinja2
    from jinja2 import meta

    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template] if template else []
    if not sources:
        return None
    env = jinja2.Environment()
    try:
        return set().union(*(meta.find_undeclared_variables(env.parse(source)) for source in sources))
    except jinja2.TemplateSyntaxError:
        return None


def unread_template_kwargs(tokenizer, kwargs: dict | None, option: str = "--chat-template-kwargs") -> str | None:
    """The problem, in one line, of template arguments the chat template never reads (a misspelt
    `enable_thinkng`: rendered as if it were not given, silently), or None."""
    names = template_variables(tokenizer) if kwargs else None
    if names is None:
        return None
    unread = sorted(set(kwargs) - names)
    if not unread:
        return None
    own = sorted(names - {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                          "raise_exception", "strftime_now", "date_string"})
    return (f"{option}: the chat template reads no {', '.join(repr(k) for k in unread)} (it would render as if "
            f"{'they were' if len(unread) > 1 else 'it were'} not given); its own arguments: "
            f"{', '.join(own) or 'none'}")
