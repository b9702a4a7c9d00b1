"""The assistant-only loss mask, derived from the template, round-trips to the assistant texts
for templates in the styles of real model families (built locally as template strings)."""

from __future__ import annotations

import pytest

from specfoundry.capture.template import masked_texts, render_with_mask
from specfoundry.common.target import COMPLETION, TargetError, chat_template_source, load_tokenizer
from specfoundry.generate.synth import user_turn_prefix
from specfoundry.testing import QWEN3_STYLE_TEMPLATE

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen3-like: ChatML with a default system prompt and a reasoning block on assistant turns
THINKING = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a careful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3+3 is 6. Also, 2+2 is 4."},
    {"role": "user", "content": "Say 4 again."},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def base_tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.mark.parametrize("style", ["chatml_smollm2", "llama3_headers", "default_system_and_thinking"])
def test_masked_tokens_decode_to_assistant_texts(base_tokenizer, style):
    tok = base_tokenizer
    eot = "<|im_end|>"
    if style == "llama3_headers":
        tok = load_tokenizer(tok.name_or_path)
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
        tok.chat_template = LLAMA3
        eot = "<|eot_id|>"
    elif style == "default_system_and_thinking":
        tok = load_tokenizer(tok.name_or_path)
        tok.chat_template = THINKING
    rendered = render_with_mask(tok, CONVERSATION)
    expected = [m["content"] + eot for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_texts(tok, rendered) == expected
    # nothing of the system / user turns or the headers is trainable
    header_and_user = [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if not m]
    assert "What is 2+2?" in tok.decode(header_and_user)


def test_truncation_keeps_the_prefix(base_tokenizer):
    full = render_with_mask(base_tokenizer, CONVERSATION)
    cut = render_with_mask(base_tokenizer, CONVERSATION, max_length=20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]


def test_reasoning_is_trained_where_the_template_shows_it(base_tokenizer):
    """Qwen3's rules: the turn after the last user message renders its reasoning and answer, an
    earlier turn only its answer; each trains on what the text holds of it."""
    tok = load_tokenizer(base_tokenizer.name_or_path)
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    conversation = [{"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n2+2 is 4."},
                    {"role": "user", "content": "And 3+3?"},
                    {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n3+3 is 6."}]
    rendered = render_with_mask(tok, conversation)
    assert "Add them." not in rendered.text
    assert masked_texts(tok, rendered) == ["2+2 is 4.<|im_end|>", "<think>\nAgain.\n</think>\n\n3+3 is 6.<|im_end|>"]


def test_completion_trains_on_the_continuation_and_its_eos(smollm2_dir, tmp_path):
    tok = load_tokenizer(smollm2_dir, COMPLETION)
    assert chat_template_source(tok) == COMPLETION
    conversation = [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " blue today."}]
    rendered = render_with_mask(tok, conversation)
    assert rendered.text == tok.bos_token + "The sky is blue today." + tok.eos_token
    assert masked_texts(tok, rendered) == [" blue today." + tok.eos_token]
    # a prompt is BOS and the text so far: generation continues the text itself
    assert tok.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False) == \
        tok.bos_token + "The sky is"
    with pytest.raises(ValueError, match="plain-text completion"):
        user_turn_prefix(tok)


def test_a_chat_template_file_replaces_the_targets(smollm2_dir, tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    tok = load_tokenizer(smollm2_dir, str(tmp_path / "t.jinja"))
    assert chat_template_source(tok) == str(tmp_path / "t.jinja")
    assert tok.apply_chat_template(CONVERSATION[:1], tokenize=False) == "[user]What is 2+2?"
    with pytest.raises(TargetError, match="no such file"):
        load_tokenizer(smollm2_dir, str(tmp_path / "missing.jinja"))
    assert chat_template_source(load_tokenizer(smollm2_dir)) == "target"


@pytest.mark.parametrize("template", ["qwen3_style", "r1_style"])
def test_the_mask_is_placed_by_position_never_on_a_users_copy_of_the_answer(base_tokenizer, template):
    """A user message that holds the answer ("Please repeat exactly: X") comes before the assistant
    turn; with a reasoning template the history rendered with a generation prompt is not a prefix of
    the conversation (the last turn's reasoning is rendered, an earlier one's dropped), so a search
    for the answer's text from the start found the user's copy: the user's words were supervised and
    the assistant's turn was not. Each turn is now placed where the template renders it."""
    from specfoundry.testing import R1_STYLE_TEMPLATE

    tok = load_tokenizer(base_tokenizer.name_or_path)
    tok.chat_template = QWEN3_STYLE_TEMPLATE if template == "qwen3_style" else R1_STYLE_TEMPLATE
    conversation = [{"role": "user", "content": "Please repeat exactly: the sky is green"},
                    {"role": "assistant", "content": "<think>\nThe user wants it back.\n</think>\n\nthe sky is green"},
                    {"role": "user", "content": "Say: blue"},
                    {"role": "assistant", "content": "<think>\nOne word.\n</think>\n\nblue"}]
    rendered = render_with_mask(tok, conversation)
    user_end = rendered.text.index("Please repeat exactly: the sky is green") + len("Please repeat exactly: the sky is green")
    second_user = rendered.text.index("Say: blue")
    assert rendered.spans[0][0] > user_end, (rendered.spans, rendered.text)
    assert rendered.spans[1][0] > second_user + len("Say: blue"), (rendered.spans, rendered.text)
    texts = masked_texts(tok, rendered)
    assert len(texts) == 2 and texts[0].startswith(("the sky is green", "<think>")) and texts[1].rstrip().endswith(
        ("blue<|im_end|>", "blue<｜end▁of▁sentence｜>", "blue")), texts
    # no masked token lies inside a user message
    for (a, b), m in zip(base_tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
                         ["offset_mapping"], rendered.loss_mask, strict=True):
        assert not (m and (a < user_end or second_user <= a < second_user + len("Say: blue"))), (a, b)


@pytest.mark.parametrize("a, b, want", [("", "", 0), ("abc", "", 0), ("abc", "abc", 3), ("abc", "abd", 2),
                                        ("abc", "abcdef", 3), ("xbc", "abc", 0), ("aaaa", "aaab", 3)])
def test_common_prefix_length_by_bisection(a, b, want):
    from specfoundry.capture.template import common_prefix_length

    assert common_prefix_length(a, b) == want == common_prefix_length(b, a)


MISTRAL_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set msgs = messages[1:] %}{%- else %}{%- set system = '' %}{%- set msgs = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in msgs %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in msgs %}{%- if m['role'] == 'user' %}"
    "{%- if loop.index0 == ns.last_user and system %}{{- '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- '\n' + m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
)
"""Mistral's rule: the system prompt is rendered inside the last user message, after earlier turns."""


def test_a_message_the_template_renders_later_does_not_hide_the_turns_before_it(base_tokenizer):
    """Placing by position must not overshoot: a system prompt that Mistral's template renders in the
    last user message stands after the first assistant turn, so the first turn is still looked for
    from where the text before it ends (the bound by position is used where the turn is found after it)."""
    tok = load_tokenizer(base_tokenizer.name_or_path)
    tok.chat_template = MISTRAL_LIKE
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
                    {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Repeat exactly: bye"},
                    {"role": "assistant", "content": "bye"}]
    rendered = render_with_mask(tok, conversation)
    assert masked_texts(tok, rendered) == ["hi<|im_end|>", "bye<|im_end|>"]
    assert rendered.spans[1][0] > rendered.text.index("Repeat exactly: bye") + len("Repeat exactly: bye")
