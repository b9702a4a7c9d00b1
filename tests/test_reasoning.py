"""Reasoning targets in their serving mode (issue 39): sf-regen's --chat-template-kwargs and
--reasoning, the mode each row records, and sf-capture rendering every sample in its own mode.

Templates: the reasoning rules of Qwen3's (enable_thinking; the reasoning of earlier turns dropped)
and of DeepSeek-R1's (the generation prompt opens the <think> block), in ChatML so that SmolLM2's
tokenizer renders them (specfoundry/testing.py). A scripted backend plays the target: what it
writes is fixed, so the tests check what sf-regen and sf-capture make of it.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from specfoundry.capture.stage import CaptureConfig, CaptureError, prepare_samples
from specfoundry.capture.template import masked_texts, render_with_mask
from specfoundry.common.target import resolve_target
from specfoundry.generate.backends.interface import Generation, SamplingConfig
from specfoundry.generate.backends.openai import OpenAIBackend
from specfoundry.generate.reasoning import opens_reasoning, split_answer
from specfoundry.generate.regen import RegenConfig, run_regen
from specfoundry.testing import (
    HARMONY_STYLE_TEMPLATE,
    HARMONY_TOKENS,
    QWEN3_THINKING_TEMPLATE,
    R1_STYLE_TEMPLATE,
)
from tests.conftest import write_jsonl

THOUGHT = "<think>\nLet me think.\n</think>\n\nThe answer."
PROMPTS = [{"id": "p0", "messages": [{"role": "user", "content": "Why?"}]},
           {"id": "p1", "messages": [{"role": "user", "content": "How?"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "And then?"}]}]


@pytest.fixture
def tokenizer():
    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2"))
    tok.chat_template = QWEN3_THINKING_TEMPLATE
    return tok


@pytest.fixture
def harmony():
    """SmolLM2's tokenizer with gpt-oss's channel rules (testing.HARMONY_STYLE_TEMPLATE) and tokens."""
    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2"))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_STYLE_TEMPLATE
    return tok


class ScriptedTarget:
    """A backend whose every answer is `answer(request)` (text, finish reason); records the requests."""

    name = "scripted"

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.requests = tokenizer, answer, []

    def identity(self):
        return {"backend": self.name}

    def generate(self, requests, sampling):
        self.requests += requests
        out = []
        for r in requests:
            text, reason = self.answer(r)
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(Generation(text, reason, ids, len(ids)))
        return out


def rows(folder):
    return {r["id"]: r for p in sorted((folder / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()}


def regen(tmp_path, backend, name="out", **kw):
    cfg = RegenConfig(output=str(tmp_path / name), source=str(write_jsonl(tmp_path / "p.jsonl", PROMPTS)),
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=64), **kw)
    return run_regen(cfg, backend, silent=True), rows(tmp_path / name)


# ---- what a generated answer becomes ------------------------------------------------------------------

def test_split_answer_keeps_or_drops_the_reasoning_and_never_keeps_an_unclosed_one():
    assert split_answer(THOUGHT, "keep").content == THOUGHT
    dropped = split_answer(THOUGHT, "drop")
    assert dropped.content == "The answer." and dropped.reasoning == "Let me think."
    # the prompt opened the block (DeepSeek-R1): the text starts inside it
    opened = split_answer("Hmm.\n</think>\n\nYes.", "keep", opened=True)
    assert opened.content == "<think>\nHmm.\n</think>\n\nYes." and not opened.unclosed
    assert split_answer("Hmm.\n</think>\n\nYes.", "drop", opened=True).content == "Yes."
    assert split_answer("<think>\nstill going", "keep").unclosed
    assert split_answer("still going", "drop", opened=True).unclosed
    plain = split_answer("No reasoning here.", "drop")
    assert plain.content == "No reasoning here." and plain.reasoning is None and not plain.unclosed
    # a server's reasoning parser gave the two apart
    assert split_answer("Yes.", "keep", reasoning_content="Hmm.").content == "<think>\nHmm.\n</think>\n\nYes."
    assert split_answer("Yes.", "drop", reasoning_content="Hmm.").content == "Yes."
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("<think>\n\n</think>\n\n")


# ---- sf-regen ------------------------------------------------------------------------------------------

def test_the_template_arguments_reach_the_prompt_and_every_row_records_its_mode(tmp_path, tokenizer):
    target = ScriptedTarget(tokenizer, lambda r: ("The answer.", "stop"))
    manifest, written = regen(tmp_path, target, chat_template_kwargs={"enable_thinking": False})
    assert {json.dumps(r.template_kwargs) for r in target.requests} == {'{"enable_thinking": false}'}
    mode = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning": "keep"}
    assert all(json.loads(r["mode"]) == mode for r in written.values())
    assert manifest["modes"] == {json.dumps(mode, sort_keys=True): 2}
    assert written["p0"]["messages"][-1]["content"] == "The answer."


@pytest.mark.parametrize("reasoning,content", [("keep", THOUGHT), ("drop", "The answer.")])
def test_reasoning_is_kept_or_dropped(tmp_path, tokenizer, reasoning, content):
    manifest, written = regen(tmp_path, ScriptedTarget(tokenizer, lambda r: (THOUGHT, "stop")), reasoning=reasoning)
    assert written["p0"]["messages"][-1]["content"] == content
    assert json.loads(written["p0"]["mode"]) == {"chat_template_kwargs": {}, "reasoning": reasoning}
    # the next turn is generated on the history as kept
    assert manifest["totals"]["turns_ok"] == 3


def test_a_reasoning_cut_before_it_closes_drops_its_conversation(tmp_path, tokenizer):
    def answer(r):
        return ("<think>\nstill thinking", "length") if r.messages[-1]["content"] == "Why?" else (THOUGHT, "stop")

    manifest, written = regen(tmp_path, ScriptedTarget(tokenizer, answer))
    assert set(written) == {"p1"}
    t = manifest["totals"]
    assert (t["turns_reasoning_unclosed"], t["dropped_truncated"], t["turns_truncated"]) == (1, 1, 1)


def test_an_r1_style_prompt_opens_the_block_and_the_kept_answer_closes_it(tmp_path, tokenizer):
    tokenizer.chat_template = R1_STYLE_TEMPLATE
    _, written = regen(tmp_path, ScriptedTarget(tokenizer, lambda r: ("Let me think.\n</think>\n\nThe answer.", "stop")))
    assert written["p0"]["messages"][-1]["content"] == THOUGHT


def test_the_openai_backend_sends_the_arguments_and_merges_the_parsers_reasoning():
    backend = OpenAIBackend("http://127.0.0.1:1/v1", model=None, target=None)
    from specfoundry.generate.backends.interface import Request

    path, body = backend.body(Request(tag=0, seed=1, messages=({"role": "user", "content": "q"},),
                                      template_kwargs={"enable_thinking": True}), SamplingConfig())
    assert path == "/chat/completions" and body["chat_template_kwargs"] == {"enable_thinking": True}
    g = backend.to_generation({"choices": [{"message": {"content": "Yes.", "reasoning_content": "Hmm."},
                                            "finish_reason": "stop"}]}, completion=False)
    assert (g.text, g.reasoning) == ("Yes.", "Hmm.")
    assert split_answer(g.text, "keep", reasoning_content=g.reasoning).content == "<think>\nHmm.\n</think>\n\nYes."


def test_regen_through_a_server_with_a_reasoning_parser(tmp_path):
    """A fake OpenAI-compatible server that splits the reasoning out (vLLM's --reasoning-parser)."""
    from tests.test_fleet import FAST, FakeServer

    seen = []

    class ReasoningServer(FakeServer):
        def answer(self, body):
            seen.append(body.get("chat_template_kwargs"))
            return 200, {"choices": [{"message": {"role": "assistant", "content": "Yes.",
                                                  "reasoning_content": "Hmm."}, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 3}}

    server = ReasoningServer()
    try:
        backend = OpenAIBackend([server.url], model=None, target=None, fleet=FAST)
        cfg = RegenConfig(output=str(tmp_path / "out"), source=str(write_jsonl(tmp_path / "p.jsonl", PROMPTS)),
                          backend="openai", openai_url=(server.url,), chat_template_kwargs={"enable_thinking": True},
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=64))
        run_regen(cfg, backend, silent=True)
        written = rows(tmp_path / "out")
    finally:
        server.close()
    assert seen and all(k == {"enable_thinking": True} for k in seen)
    assert written["p0"]["messages"][-1]["content"] == "<think>\nHmm.\n</think>\n\nYes."
    # no local tokenizer saw the template: counted (sf-regen says so; a channel template reads `thinking`)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["totals"]["turns_reasoning_joined_unseen"] == 3


# ---- sf-capture ----------------------------------------------------------------------------------------

def test_capture_renders_each_row_in_its_mode_and_refuses_a_contradicting_option(tmp_path, tokenizer):
    """Thinking off: the empty block is the template's generation prompt, not the target's text, so
    it is not supervised; thinking on and kept: the reasoning of the turn is. Rows of both modes in
    one source render each in its own."""
    regen(tmp_path, ScriptedTarget(tokenizer, lambda r: ("The answer.", "stop")), name="off",
          chat_template_kwargs={"enable_thinking": False})
    regen(tmp_path, ScriptedTarget(tokenizer, lambda r: (THOUGHT, "stop")), name="on")
    mixed = tmp_path / "mixed.jsonl"
    both = [{**r, "id": f"{name}-{r['id']}"} for name in ("off", "on") for r in rows(tmp_path / name).values()]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in both))
    samples, bad, _, modes = prepare_samples(CaptureConfig(source=str(mixed), output="o"), tokenizer)
    assert not bad and len(samples) == 4 and sum(modes.values()) == 4 and len(modes) == 2
    texts = {}
    for s in samples:
        runs = [tokenizer.decode([t for t, m in zip(s["input_ids"], s["loss_mask"], strict=True) if m])]
        texts[s["id"]] = runs[0]
    assert texts["off-p0"] == "The answer.<|im_end|>"  # not "<think>\n\n</think>\n\n": the template's prompt
    assert texts["on-p0"] == THOUGHT + "<|im_end|>"  # the reasoning of the supervised turn
    # p1's first answer ("x" replaced by the target's) is an earlier turn: its reasoning not rendered
    assert texts["on-p1"] == "The answer.<|im_end|>" + THOUGHT + "<|im_end|>"
    with pytest.raises(CaptureError, match=r'mixed.jsonl:1: generated with chat-template arguments '
                                           r'\{"enable_thinking": false\}, not --chat-template-kwargs \{\}'):
        prepare_samples(CaptureConfig(source=str(mixed), output="o", chat_template_kwargs={}), tokenizer)


def test_a_source_without_modes_renders_with_the_option(tmp_path, tokenizer):
    """An answer without a <think> block: the template shows it after an empty one, which the
    target did not write, so in neither mode is it supervised; the mode is recorded as given."""
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                              {"role": "assistant", "content": "A."}]}])
    for kwargs in ({"enable_thinking": False}, None):
        samples, _, _, modes = prepare_samples(CaptureConfig(source=str(source), output="o",
                                                             chat_template_kwargs=kwargs), tokenizer)
        s = samples[0]
        assert tokenizer.decode(s["input_ids"]).endswith("<think>\n\n</think>\n\nA.<|im_end|>\n")
        assert tokenizer.decode([t for t, m in zip(s["input_ids"], s["loss_mask"], strict=True) if m]) == \
            "A.<|im_end|>"
        assert json.loads(next(iter(modes)))["chat_template_kwargs"] == (kwargs or {})


def test_masked_texts_of_a_thinking_turn_decode_back(tokenizer):
    from specfoundry.conversations.records import ChatMessages

    messages = ChatMessages([{"role": "user", "content": "q"}, {"role": "assistant", "content": THOUGHT}],
                            template_kwargs={"enable_thinking": True})
    assert masked_texts(tokenizer, render_with_mask(tokenizer, messages)) == [THOUGHT + "<|im_end|>"]


# ---- sf-eval -------------------------------------------------------------------------------------------

def test_eval_prompts_render_in_the_mode_asked_and_the_default_is_the_feature_sets(tmp_path, tokenizer):
    from types import SimpleNamespace

    from specfoundry.eval.prompts import eval_modes, load_prompts, mode_label, parse_modes

    off = dict(load_prompts("chat", tokenizer, 1, {"enable_thinking": False}))
    on = dict(load_prompts("chat", tokenizer, 1, {}))
    assert tokenizer.decode(next(iter(off.values()))).endswith("<think>\n\n</think>\n\n")
    assert tokenizer.decode(next(iter(on.values()))).endswith("<|im_start|>assistant\n")
    export = tmp_path / "export"
    export.mkdir()
    mode = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning": "keep"}
    (export / "specfoundry_training.json").write_text(json.dumps({"modes": {json.dumps(mode): 5}}))
    ref = SimpleNamespace(path=export, prefix="")  # an export (a checkpoint has the prefix "draft.")
    assert eval_modes((), None, ref) == ([{"enable_thinking": False}], "the draft's feature set")
    assert eval_modes((), {}, ref) == ([{}], "--chat-template-kwargs")
    assert eval_modes(({}, {"a": 1}), None, ref)[0] == [{}, {"a": 1}]
    assert mode_label({"enable_thinking": False}) == "enable_thinking=false" and mode_label({}) == "default"
    with pytest.raises(ValueError, match="not a non-empty JSON list of objects"):
        parse_modes('{"enable_thinking": true}')


# ---- the gate ------------------------------------------------------------------------------------------

# A two-mode template that renders back what a target that never thinks wrote, in either mode: the
# non-thinking mode's empty block in the generation prompt and before the last answer, nothing in
# thinking mode. (Qwen3's own puts the empty block before every last answer without one: a random
# target, which writes no <think> block in thinking mode, would be trained on a context it never
# saw, and the gate's fit check says so.)
MODES_TEMPLATE = (
    "{%- set off = enable_thinking is defined and enable_thinking is false %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + ('<think>\\n\\n</think>\\n\\n' if off and loop.last else '') + m.content"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' + ('<think>\\n\\n</think>\\n\\n' if off else '') }}"
    "{%- endif %}")


def test_the_gate_checks_one_conversation_in_each_mode_of_the_template(tmp_path, tokenizer):
    """A target whose template has a non-thinking mode: the gate regenerates, captures, trains and
    decodes its prompt in both modes, each check named by its mode; SmolLM2's template has none."""
    from specfoundry.gate import GateConfig, run_gate, template_modes
    from specfoundry.testing import write_tiny_target

    assert template_modes(AutoTokenizer.from_pretrained(resolve_target("smollm2"))) == [{}]
    assert template_modes(tokenizer) == [{}, {"enable_thinking": False}]
    target = write_tiny_target("qwen3", tmp_path / "qwen3", resolve_target("smollm2"))
    (tmp_path / "modes.jinja").write_text(MODES_TEMPLATE)
    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(target), chat_template=str(tmp_path / "modes.jinja"),
                     max_steps=200, max_new_tokens=24, device="cpu")
    checks, ok, message = run_gate(cfg)
    assert ok, message
    assert {c.name for c in checks} >= {"decode [default]", "decode [enable_thinking=false]"}
    written = rows(tmp_path / "gate" / "regen")
    assert json.loads(written["gate [enable_thinking=false]"]["mode"])["chat_template_kwargs"] == \
        {"enable_thinking": False}
    manifest = json.loads((tmp_path / "gate" / "features" / "manifest.json").read_text())
    assert len(manifest["modes"]) == 2


# ---- channel templates (gpt-oss's harmony format) -------------------------------------------------------

CHANNELS = "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>The answer."


def test_split_answer_reads_the_analysis_and_final_channels():
    kept = split_answer(CHANNELS, "keep", channels=True)
    assert (kept.content, kept.thinking, kept.unclosed) == ("The answer.", "Let me think.", False)
    dropped = split_answer(CHANNELS, "drop", channels=True)
    assert (dropped.content, dropped.thinking, dropped.reasoning) == ("The answer.", None, "Let me think.")
    assert split_answer("<|channel|>final<|message|>Only this.<|return|>", "keep", channels=True).thinking is None
    # cut inside the analysis: no final channel, no answer
    assert split_answer("<|channel|>analysis<|message|>Still think", "keep", channels=True).unclosed
    # harmony's tool calls and preambles (the commentary channel) are not read: the turn is unusable
    call = split_answer("<|channel|>commentary to=functions.f<|message|>{}", "keep", channels=True)
    assert "commentary" in call.unreadable
    # what follows a message's end marker before the next <|start|> is no text of it
    spaced = split_answer("<|channel|>analysis<|message|>T<|end|>\n<|start|>assistant<|channel|>final<|message|>A"
                          "<|return|>\n", "keep", channels=True)
    assert (spaced.content, spaced.thinking) == ("A", "T")
    # two analysis messages: the template renders back one, so the turn cannot be trained as written
    twice = CHANNELS.replace("<|start|>assistant<|channel|>final", "<|start|>assistant<|channel|>analysis<|message|>"
                             "More.<|end|><|start|>assistant<|channel|>final")
    assert "several analysis messages" in split_answer(twice, "keep", channels=True).unreadable
    # a server's parser split them already (vLLM's harmony parser): the thinking field, not a <think> block
    served = split_answer("Yes.", "keep", reasoning_content="Hmm.", channels=True)
    assert (served.content, served.thinking) == ("Yes.", "Hmm.")


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_a_channel_template_is_regenerated_and_captured_with_every_channel_supervised(tmp_path, harmony, reasoning):
    """Regen: the answer in content, the analysis in `thinking` (keep) or nowhere (drop), the
    reasoning effort a template argument recorded with the mode. Capture: the last turn supervised
    from its generation prompt's end, both channels and their headers, to <|return|> (drop: its answer
    and <|return|>); an earlier turn
    (rendered as its final channel alone) on its answer and <|end|>."""
    target = ScriptedTarget(harmony, lambda r: (CHANNELS, "stop"))
    manifest, written = regen(tmp_path, target, reasoning=reasoning, chat_template_kwargs={"reasoning_effort": "low"})
    assert all(r.template_kwargs == {"reasoning_effort": "low"} for r in target.requests)
    last = written["p0"]["messages"][-1]
    assert last["content"] == "The answer."
    assert last["thinking"] == ("Let me think." if reasoning == "keep" else None)
    assert manifest["totals"]["turns_ok"] == 3
    assert json.loads(written["p1"]["mode"]) == {"chat_template_kwargs": {"reasoning_effort": "low"},
                                                 "reasoning": reasoning}

    samples, bad, _, _ = prepare_samples(CaptureConfig(source=str(tmp_path / "out"), output="o"), harmony)
    assert not bad
    by_id = {s["id"]: s for s in samples}
    rendered = harmony.decode(by_id["p0"]["input_ids"])
    assert rendered.startswith("<|start|>system<|message|>Reasoning: low<|end|>")
    # drop: the final channel's header is the template's scaffold of a turn without its analysis (the
    # target, which reasons first, never writes it right after its generation prompt): not supervised
    last_turn = (CHANNELS if reasoning == "keep" else "The answer.") + "<|return|>"
    runs = masked_texts(harmony, render_with_mask(harmony, rows_messages(written["p1"])))
    assert runs == ["The answer.<|end|>", last_turn]  # p1's first turn is history: its final channel alone
    masked = [t for t, m in zip(by_id["p0"]["input_ids"], by_id["p0"]["loss_mask"], strict=True) if m]
    assert harmony.decode(masked) == last_turn


def rows_messages(row):
    from specfoundry.conversations.records import normalise

    return normalise(row, "row", "r").to_messages() if isinstance(row, dict) else row


def test_a_turn_in_an_unknown_channel_drops_its_conversation(tmp_path, harmony):
    def answer(r):
        if r.messages[-1]["content"] == "Why?":
            return "<|channel|>commentary to=functions.f<|message|>{}", "stop"
        return CHANNELS, "stop"

    manifest, written = regen(tmp_path, ScriptedTarget(harmony, answer))
    assert set(written) == {"p1"} and manifest["totals"]["turns_failed"] == 1


def test_the_channel_span_holds_when_the_answer_is_repeated_in_the_reasoning(harmony):
    """The answer found inside the analysis first, or a short thinking inside a channel header of a
    turn rendered without it, must not move the span: where the template renders a turn's thinking
    is found by rendering it (capture/template.rendered_thinking)."""
    from specfoundry.conversations.records import ChatMessages

    last = ChatMessages([{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4", "thinking": "2+2 is 4, so say it."}])
    assert masked_texts(harmony, render_with_mask(harmony, last)) == [
        "<|channel|>analysis<|message|>2+2 is 4, so say it.<|end|><|start|>assistant<|channel|>final<|message|>4"
        "<|return|>"]
    earlier = ChatMessages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "X", "thinking": "n"},
                            {"role": "user", "content": "b"}, {"role": "assistant", "content": "Y"}])
    assert masked_texts(harmony, render_with_mask(harmony, earlier)) == ["X<|end|>", "Y<|return|>"]



def test_template_arguments_the_template_never_reads_are_named(tmp_path, tokenizer):
    """issue 61 item 12: a misspelt --chat-template-kwargs key (`enable_thinkng`) rendered as if no
    argument were given, silently, in sf-regen, sf-capture and sf-eval. The keys the template does
    not read (jinja2.meta's undeclared variables) are now one line naming them and the template's own."""
    from specfoundry.conversations.templates import template_variables, unread_template_kwargs
    from specfoundry.generate.regen import RegenError

    assert "enable_thinking" in template_variables(tokenizer)
    assert unread_template_kwargs(tokenizer, {"enable_thinking": False}) is None
    problem = unread_template_kwargs(tokenizer, {"enable_thinkng": False, "enable_thinking": False})
    assert "reads no 'enable_thinkng'" in problem and "enable_thinking" in problem.split("own arguments:")[1]
    with pytest.raises(RegenError, match="--chat-template-kwargs: the chat template reads no 'enable_thinkng'"):
        regen(tmp_path, ScriptedTarget(tokenizer, lambda r: ("x", "stop")), chat_template_kwargs={"enable_thinkng": False})
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                              {"role": "assistant", "content": "a"}]}])
    from specfoundry.capture.stage import plan_capture
    from specfoundry.common.target import target_identity

    with pytest.raises(CaptureError, match="the chat template reads no 'enable_thinkng'"):
        plan_capture(CaptureConfig(source=str(source), output=str(tmp_path / "fs"),
                                   chat_template_kwargs={"enable_thinkng": True}), tokenizer,
                     target_identity("smollm2", resolve_target("smollm2")))


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Mistral's and Gemma's rule: the roles alternate, user first, or the template raises."""


def test_a_template_that_raises_for_one_record_makes_that_record_bad_input(tmp_path, tokenizer):
    """issue 61 item 10: a template raising for one record ("roles must alternate") killed the whole
    capture, regen or eval with Jinja's traceback. sf-capture and sf-regen report the record as bad
    input and go on; sf-eval, which refuses any bad prompt, names it in one line."""
    from specfoundry.eval.evaluate import EvalError
    from specfoundry.eval.prompts import load_prompts

    tokenizer.chat_template = ALTERNATING
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "ok"}]}
    fine = {"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "yes"}]}
    source = write_jsonl(tmp_path / "alt.jsonl", [twice, fine])
    samples, bad, _, _ = prepare_samples(CaptureConfig(source=str(source), output="o"), tokenizer)
    assert len(samples) == 1 and [(b.location, b.kind) for b in bad] == [(f"{source}:1", "template")]
    assert "the chat template raised: Conversation roles must alternate" in bad[0].detail
    cfg = RegenConfig(output=str(tmp_path / "regen"), source=str(source),
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=8))
    manifest = run_regen(cfg, ScriptedTarget(tokenizer, lambda r: ("x", "stop")), silent=True)
    assert [b["kind"] for b in manifest["bad_inputs"]] == ["template"]
    assert manifest["totals"]["conversations_written"] == 1
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": twice["messages"][:2]}])
    with pytest.raises(EvalError, match=r"bad prompt: .*prompts.jsonl:1: template: the chat template raised"):
        load_prompts(str(prompts), tokenizer)


def test_a_chat_template_file_jinja_cannot_parse_is_one_line(tmp_path, tokenizer):
    """issue 61 item 10: a --chat-template with a Jinja syntax error raised Jinja's traceback at the
    first rendering; it is one line naming the file and the line."""
    from specfoundry.common.target import TargetError, with_chat_template

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(TargetError, match=rf"--chat-template {bad}: not a valid Jinja template at line 2: "):
        with_chat_template(tokenizer, str(bad))
