"""A reasoning target's answer: its reasoning and its final answer, and what sf-regen keeps.

Reasoning templates (Qwen3's, DeepSeek-R1's) mark the reasoning as <think> ... </think> before the
answer. Where it starts:
- the target writes the opening tag itself (Qwen3 with enable_thinking: its generation prompt ends
  at "<|im_start|>assistant\\n"), or
- the generation prompt opens the block (DeepSeek-R1's template ends it with "<think>\\n"; Qwen3's
  non-thinking mode renders a closed, empty block "<think>\\n\\n</think>\\n\\n" there instead, which
  opens nothing): the text generated starts inside it.
A server with a reasoning parser (vLLM's, SGLang's --reasoning-parser) returns the two apart, the
reasoning in the message's `reasoning_content`.

--reasoning keep: the message's content is what the target wrote after the assistant header,
"<think>\\n{reasoning}\\n</think>\\n\\n{answer}" (a server's parts joined in that shape), which the
template renders back whole for the last turn and as the answer alone for earlier ones
(capture/template.py). drop: the content is the answer alone.
A reasoning without its closing tag (cut by --max-new-tokens, or a turn ended inside it) has no
answer: it is reported and the conversation dropped, never kept as if it had ended.

Channel templates (gpt-oss's harmony format) mark no <think> block: after the generation prompt
"<|start|>assistant" the target writes "<|channel|>analysis<|message|>{reasoning}<|end|>", then
"<|start|>assistant<|channel|>final<|message|>{answer}". Their template takes the reasoning in the
message's `thinking` field and refuses channel tags in the content, so sf-regen parses the channels:
keep: content is the final channel's text and `thinking` the analysis channel's; drop: content alone.
A turn with no final channel has no answer (unclosed); a channel other than analysis and final
(commentary: harmony's tool calls and preambles), or two messages in one channel (the template
renders back one of each), is not read here and makes the turn unusable.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>")  # a channel message's end; <|return|> ends the turn
CHANNELS = ("analysis", "final")


@dataclass(frozen=True)
class Answer:
    content: str  # the message's content under the run's --reasoning
    reasoning: str | None  # the reasoning found (None: the answer had none)
    unclosed: bool  # a reasoning was opened and never closed: no answer
    thinking: str | None = None  # a channel template's reasoning kept, for the message's `thinking` field
    unreadable: str | None = None  # why the text is no answer this module reads (an unknown channel)


def channel_template(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders harmony channels (gpt-oss's)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return isinstance(template, str) and CHANNEL in template


def split_channels(text: str, reasoning: str, reasoning_content: str | None = None) -> Answer:
    """A channel template's generated `text` (or a server parser's final text and its
    `reasoning_content`) -> the final answer and the analysis, kept in `thinking` or dropped."""
    if reasoning_content is not None:
        answer, thought = text, reasoning_content
    else:
        parts: dict[str, str] = {}
        for segment in text.split(START):
            if not segment.strip() or segment.strip() == "assistant":
                continue
            header, sep, body = segment.partition(MESSAGE)
            name = header.split(CHANNEL, 1)[-1].strip() if CHANNEL in header else ""
            if not sep or name not in CHANNELS:
                return Answer(text, None, False, unreadable=f"a message in channel {name or '(none)'!r}, not "
                                                            f"{' or '.join(CHANNELS)}")
            if name in parts:  # the template renders one message of each: the turn cannot be rendered back
                return Answer(text, None, False, unreadable=f"several {name} messages in one turn")
            for end in MESSAGE_ENDS:  # a message ends at its marker; what follows it, before <|start|>, is no text
                body = body.split(end, 1)[0]
            parts[name] = body
        if "final" not in parts:  # cut inside the analysis, or ended without an answer
            return Answer(text, parts.get("analysis") or None, True)
        answer, thought = parts["final"], parts.get("analysis")
    kept = thought if reasoning == "keep" and thought else None
    return Answer(answer, thought, False, thinking=kept)


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered generation prompt leaves a <think> block open."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def split_answer(text: str, reasoning: str = "keep", *, opened: bool = False,
                 reasoning_content: str | None = None, channels: bool = False) -> Answer:
    """The content sf-regen keeps for the generated `text` under `reasoning` (keep or drop).
    opened: the generation prompt opened the block; reasoning_content: a server parser's part;
    channels: the template renders harmony channels (channel_template)."""
    if reasoning not in ("keep", "drop"):
        raise ValueError(f"--reasoning {reasoning!r}: choose keep or drop")
    if channels:
        return split_channels(text, reasoning, reasoning_content)
    if reasoning_content is not None:  # a server's parser split them already
        thought, answer = reasoning_content.strip("\n"), text.lstrip("\n")
        if reasoning == "drop":
            return Answer(answer, thought, False)
        return Answer(f"{THINK_START}\n{thought}\n{THINK_END}\n\n{answer}", thought, False)
    body = text
    started = opened or body.lstrip().startswith(THINK_START)
    if not started:
        return Answer(text, None, False)
    if THINK_END not in body:
        return Answer(text, body.split(THINK_START, 1)[-1].strip("\n"), True)
    thought, answer = body.split(THINK_END, 1)
    thought = thought.split(THINK_START, 1)[-1].strip("\n")
    answer = answer.lstrip("\n")
    if reasoning == "drop":
        return Answer(answer, thought, False)
    return Answer(text if not opened else f"{THINK_START}\n{text.lstrip(chr(10))}", thought, False)
