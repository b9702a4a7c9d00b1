"""Synthesise user prompts from the target alone (the Magpie recipe).

An aligned chat model, given its chat template up to the start of a user turn, writes a
plausible user message. We take the rendered template of a one-turn conversation with a
marker as the user's text and keep everything before the marker: that is the exact prefix the
model saw before real user messages in its own fine-tuning (including any default system
prompt the template inserts).
"""

from __future__ import annotations

MARKER = "\x00SPECFOUNDRY_USER\x00"


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user message's text begins."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt synthesis needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if MARKER not in text:
        raise ValueError("the chat template does not render the user's text verbatim; cannot synthesise")
    return text[: text.index(MARKER)]
