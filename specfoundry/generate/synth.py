"""Synthesise user prompts from the target alone (the Magpie recipe).

An aligned chat model, given its chat template up to the start of a user turn, writes a
plausible user message. We take the rendered template of a one-turn conversation with a
marker as the user's text and keep everything before the marker: that is the exact prefix the
model saw before real user messages in its own fine-tuning (including any default system
prompt the template inserts).

Left alone, a small model writes the same few kinds of request (SmolLM2-135M: mostly "I'm
planning ... Can you help me"). So each prompt is seeded with an opening word or two, which the
model then continues: the openings cover the kinds of request people type (questions, how-to,
explanations, writing, lists, comparisons, code, rewriting, advice). The model still writes every
request itself; the opening only picks which kind.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "\x00SPECFOUNDRY_USER\x00"


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user message's text begins."""
    from specfoundry.common.target import COMPLETION, chat_template_source

    if not getattr(tokenizer, "chat_template", None) or chat_template_source(tokenizer) == COMPLETION:
        raise ValueError("prompt synthesis needs a chat template (a user turn to start); this target renders as "
                         "plain-text completion: give a SOURCE of prompts, or --chat-template FILE")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if MARKER not in text:
        raise ValueError("the chat template does not render the user's text verbatim; cannot synthesise")
    return text[: text.index(MARKER)]


# Openings of the requests people type, one kind of request each; prompt i gets opening
# i mod len (a fixed, balanced assignment, so a rerun synthesises the same prompts).
DEFAULT_STARTERS: tuple[str, ...] = (
    "What", "What is", "What are", "Why", "Why do", "How", "How do I", "How can I", "How does",
    "Explain", "Describe", "Write", "Write a", "Give me", "Tell me", "Can you", "Could you", "Please",
    "Recommend", "Suggest", "List", "Compare", "Summarize", "Create", "Generate", "Help me", "I need",
    "I want to", "I'm", "My", "Which", "Who", "When", "Where", "Is it", "Should I", "Do you", "Plan",
    "Translate", "Rewrite", "Classify", "Find", "Calculate", "Solve", "Design", "Make", "Imagine", "Name",
    "Identify", "In what ways",
)


def read_starters(spec: str) -> tuple[str, ...]:
    """'default' -> DEFAULT_STARTERS, 'none' -> () (plain Magpie), else a text file with one
    opening per line (blank lines ignored)."""
    if spec == "default":
        return DEFAULT_STARTERS
    if spec == "none":
        return ()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompt-starters: {spec} is neither 'default', 'none' nor a file")
    starters = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not starters:
        raise ValueError(f"--prompt-starters: {spec} has no openings (one per line)")
    return starters


def starter_for(starters: tuple[str, ...], index: int) -> str:
    """The opening of synthesised prompt `index` ('' when prompts are not seeded)."""
    return starters[index % len(starters)] if starters else ""
