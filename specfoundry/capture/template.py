"""Chat-template rendering with an assistant-only loss mask, derived from the template itself.

The conversation is rendered once with the tokenizer's own template. Each assistant message's
content is located in that text after every message before it, each placed by position
(`message_end`: where a rendering with a probe in its place parts from the text), and after the
template's own rendering of the turns before it with its generation prompt where that is a prefix
of the text: text in earlier turns (a user's "repeat exactly: ...") is never mistaken for the
answer. A turn whose reasoning the template drops is located by its answer (`locate`). The end-of-turn marker is
whatever token the template puts right after the content (ChatML's <|im_end|>, Llama-3's
<|eot_id|>, ...): no hand-list of strings.
Tokens whose characters start inside [content start, end of that token) are trainable. The
result is checked: decoding the masked tokens must give the assistant texts back.

Channel templates (gpt-oss's harmony format): a turn whose `thinking` the template renders (the
analysis channel, then the final one) is supervised from the end of its generation prompt to its
end-of-turn token, every channel and channel header inside; a turn rendered with its final
channel alone (the reasoning dropped from history) on its answer, as above.

Tool conversations: the template is given the conversation's tools. An assistant turn that calls
tools is rendered in the template's own call syntax, so its span is located by rendering: from
the end of the history with its generation prompt to the end of the history with this turn
(trailing whitespace aside, its end-of-turn marker included). Tool results are never inside an
assistant span, so they are never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.conversations.records import template_arguments


class TemplateMaskError(ValueError):
    """The template does not render an assistant message verbatim, so no mask can be derived."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant content + its end-of-turn token
    spans: list[tuple[int, int]]  # character spans of each assistant turn (content + end-of-turn)
    text: str


THINK_END = "</think>"


def locate(text: str, content: str, cursor: int) -> tuple[int, str]:
    """(where the assistant message `content` starts in `text` at or after `cursor`, or -1; the
    part of it found). Reasoning templates (Qwen3's, DeepSeek-R1's) drop the reasoning of every
    turn before the last user message and render only the answer after it,
    `content.split('</think>')[-1].lstrip('\n')`: when the message is not rendered whole, that
    answer is looked for instead, so such a turn trains on its answer (the target never sees its
    reasoning again either), and the last turn, rendered whole, on its reasoning and answer."""
    start = text.find(content, cursor) if content else -1
    if THINK_END in content:
        answer = content.split(THINK_END)[-1].lstrip("\n")
        alone = text.find(answer, cursor) if answer else -1
        # the answer alone before the whole message: this turn was rendered without its reasoning,
        # and the whole message found further on is a later turn's (the same text, reasoned again)
        if alone >= 0 and (start < 0 or alone < start):
            return alone, answer
    return start, content


def render_with_mask(tokenizer, messages: list[dict], max_length: int | None = None) -> Rendered:
    """`messages` may carry the conversation's tools and template arguments (its mode's:
    conversations.records.ChatMessages), which every rendering here is given."""
    extra = template_arguments(messages)

    def render(upto: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(upto, add_generation_prompt=generation_prompt, tokenize=False, **extra)

    messages = list(messages)
    text = render(messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans, cursor, ends = [], 0, []  # ends: where the messages before the turn end, placed by position
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            ends.append(message_end(render, messages, k, text))
            continue
        # The template's own rendering of everything before this turn plus its generation
        # prompt ends at (or just before) where the content starts: search from there, so text
        # in earlier user turns is never taken for the answer.
        prefix = render(messages[:k], generation_prompt=True)
        if text.startswith(prefix):
            cursor = max(cursor, len(prefix))
        if m.get("tool_calls"):
            spans.append(call_span(text, prefix, render(messages[: k + 1])))
            cursor = spans[-1][1]
            continue
        thought = rendered_thinking(render, messages, k, text, cursor)
        if thought >= 0:
            start, content = locate(text, m["content"], thought + len(m["thinking"]))
        else:
            # after the messages before it, placed by position: from the latest end on; a template that
            # renders one of them after the turn (Mistral's system prompt, in the last user message)
            # leaves the turn before that end, so the next latest is tried, down to the cursor
            for after in [*sorted({e for e in ends if e > cursor}, reverse=True), cursor]:
                start, content = locate(text, m["content"], after)
                if start >= 0:
                    break
        if start < 0:
            raise TemplateMaskError("the chat template does not render an assistant message verbatim")
        end = start + len(content)
        if thought >= 0:  # every channel the target wrote, from its generation prompt's end
            start = len(prefix) if text.startswith(prefix) and len(prefix) <= thought else thought
        # extend by the first token the template emits after the content: the end of turn
        after = next((o for o in offsets if o[0] >= end and o[1] > o[0]), None)
        if after is not None and after[0] == end:
            end = after[1]
        spans.append((start, end))
        cursor = end
    mask = [0] * len(ids)
    s = 0
    for t, (a, b) in enumerate(offsets):
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= a < spans[s][1] and b > a:
            mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Rendered(ids, mask, spans, text)


CONTENT_PROBE = "\ue001specfoundry: this message's content\ue001"
"""Text no conversation holds, put in place of a message's content to see where the template renders it."""


def message_end(render, messages: list[dict], k: int, text: str) -> int:
    """Where message k (a user, system or tool message) ends in the conversation's `text`, placed by
    position: its content starts where `text` and the rendering with CONTENT_PROBE in its place part
    (everything the template renders before it is the same in both). The template's copy of the
    content ends it (trimmed, where the template trims); elsewhere that start is all that is known.
    An assistant turn after it is looked for from there on, so a user's words that hold the answer
    ("Please repeat exactly: ...") are never taken for it: the history rendered with a generation
    prompt, the other bound, is no prefix of the text under a reasoning template."""
    content = messages[k].get("content")
    if not isinstance(content, str) or not content:
        return 0
    try:
        probed = render([*messages[:k], {**messages[k], "content": CONTENT_PROBE}, *messages[k + 1:]])
    except Exception:  # noqa: BLE001 - a template that refuses the probe's text: no bound by position here
        return 0
    start = common_prefix_length(text, probed)
    for copy in (content, content.strip()):
        if copy and text.startswith(copy, start):
            return start + len(copy)
    return start


def common_prefix_length(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b, by bisection over slices compared in C
    (log2 of the length comparisons, where a character loop in Python would visit every character)."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; the answer is at most high
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


THINKING_PROBE = "\ue000specfoundry: this turn's thinking\ue000"
"""Text no conversation holds (private-use characters), put in a turn's `thinking` to see where the
template renders it."""


def rendered_thinking(render, messages: list[dict], k: int, text: str, cursor: int) -> int:
    """Where turn k's `thinking` (a channel template's reasoning) starts in the conversation's
    `text`, or -1 where the template does not render it (gpt-oss's renders it for the last message
    alone). Found by rendering the conversation with a probe in its place, so neither the answer
    repeated inside the reasoning nor a short thinking matching a channel header misleads it."""
    thinking = messages[k].get("thinking")
    if not thinking:
        return -1
    probed = [*messages[:k], {**messages[k], "thinking": THINKING_PROBE}, *messages[k + 1:]]
    at = render(probed).find(THINKING_PROBE)
    return at if at >= cursor and text[at: at + len(thinking)] == thinking else -1


def call_span(text: str, prefix: str, upto: str) -> tuple[int, int]:
    """The characters of an assistant turn with tool calls: what rendering the turn adds to the
    history with its generation prompt (`prefix`), up to `upto`, the history with the turn."""
    end = len(upto.rstrip())
    if not (text.startswith(prefix) and text.startswith(upto) and end > len(prefix)):
        raise TemplateMaskError("the chat template does not render an assistant turn with tool calls after its "
                                "generation prompt, as a prefix of the conversation")
    return len(prefix), end


def masked_texts(tokenizer, rendered: Rendered) -> list[str]:
    """Decode each contiguous run of masked tokens (one per assistant turn, untruncated)."""
    runs, current = [], []
    for tok, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]
