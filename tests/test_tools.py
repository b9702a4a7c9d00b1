"""Conversations with tool calls: loading, semi-on-policy regeneration (kept, replaced, dropped
exchanges counted in the manifest), and the loss mask over assistant text and calls, never over
tool results."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specfoundry.capture.template import masked_texts, render_with_mask
from specfoundry.common.target import Target, load_tokenizer
from specfoundry.conversations.records import ToolCall
from specfoundry.conversations.sources import load_conversations
from specfoundry.generate.backends.hf import HFBackend
from specfoundry.generate.backends.interface import Generation, SamplingConfig
from specfoundry.generate.regen import RegenConfig, RegenError, run_regen
from specfoundry.generate.tools import parse_tool_calls, template_renders_tools
from tests.conftest import write_jsonl

# A ChatML template with tools in the style of Qwen2.5's: the tools in the system turn, calls as
# <tool_call> JSON blocks, results in a user turn as <tool_response> blocks.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call functions:\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls %}{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
STOCK = {"type": "function", "function": {"name": "get_stock", "description": "A share's price",
                                          "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}}}}


def call(cid, name, **arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


TOOL_CHATS = [
    {"id": "single", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "How warm is it in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("a1", "get_weather", city="Paris")]},
        {"role": "tool", "tool_call_id": "a1", "content": "RESULT-PARIS 18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."}]},
    {"id": "parallel", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris and in London?"},
        {"role": "assistant", "content": "Let me look both up.", "tool_calls": [
            call("b1", "get_weather", city="Paris"), call("b2", "get_weather", city="London")]},
        {"role": "tool", "tool_call_id": "b1", "content": "RESULT-PARIS 18 C"},
        {"role": "tool", "tool_call_id": "b2", "content": "RESULT-LONDON 12 C, rain"},
        {"role": "assistant", "content": "Paris 18 C, London 12 C with rain."}]},
    {"id": "error", "tools": [STOCK], "messages": [
        {"role": "user", "content": "What does XYZ trade at?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_stock", symbol="XYZ")]},
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT-ERROR unknown symbol XYZ"},
        {"role": "assistant", "content": "I could not find the symbol XYZ."}]},
]
RESULTS = ("RESULT-PARIS", "RESULT-LONDON", "RESULT-ERROR")


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    return load_tokenizer(smollm2_dir, str(path))


class ScriptedToolBackend:
    """Answers each request with the scripted text for (conversation id, turn), parsed as the hf
    backend parses the target's text."""

    name = "scripted"

    def __init__(self, tokenizer, script: dict[tuple[str, int], str], ids: list[str]):
        self.tokenizer, self.script, self.ids = tokenizer, script, ids

    def identity(self):
        return {"backend": self.name}

    def generate(self, requests, sampling):
        gens = []
        for r in requests:
            turn = sum(m["role"] == "assistant" for m in r.messages)
            text, calls = parse_tool_calls(self.script[(self.ids[r.tag], turn)])
            gens.append(Generation(text, "stop", (1, 2), 2, tool_calls=calls))
        return gens


def rows(out):
    return [r for p in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_parse_tool_calls_in_the_forms_templates_teach():
    weather = ToolCall("get_weather", {"city": "Paris"})
    assert parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') \
        == ("", (weather,))
    text, calls = parse_tool_calls('Sure. <tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
                                   '"{\\"x\\": 1}"}]</tool_call>')
    assert text == "Sure." and [c.key() for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}') == ("", (weather,))
    assert parse_tool_calls('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')[1] == (weather,)
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", ())
    assert parse_tool_calls("It is sunny.") == ("It is sunny.", ())


def test_tool_conversations_load_and_bad_ones_are_reported(tmp_path):
    bad = [
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"},
                      {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "q", "function": {"name": "f", "arguments": "{oops"}}]}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            call("q", "f")]}, {"role": "tool", "tool_call_id": "other", "content": "r"},
            {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            call("q", "f")]}, {"role": "tool", "tool_call_id": "q", "content": "r"}]},
        {"tools": "[not json", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ]
    src = write_jsonl(tmp_path / "t.jsonl", TOOL_CHATS + bad)
    loaded = load_conversations(src)
    assert [c.id for c in loaded.conversations] == ["single", "parallel", "error"]
    parallel = loaded.conversations[1]
    assert parallel.num_tool_exchanges == 1 and parallel.tools == (WEATHER,)
    assert [c.id for c in parallel.messages[1].tool_calls] == ["b1", "b2"]
    assert parallel.messages[3].tool_call_id == "b2" and parallel.messages[1].tool_calls[1].arguments == {"city": "London"}
    assert [(b.location, b.kind) for b in loaded.bad] == [
        (f"{src}:4", "orphan_tool_result"), (f"{src}:5", "bad_tool_call"), (f"{src}:6", "orphan_tool_result"),
        (f"{src}:7", "ends_on_tool"), (f"{src}:8", "bad_tools")]


def test_regen_keeps_or_replaces_each_exchange_and_the_mask_skips_tool_results(tmp_path, tool_tokenizer):
    src = write_jsonl(tmp_path / "tools.jsonl", TOOL_CHATS)
    script = {  # (conversation, turn) -> what the target writes
        ("single", 0): '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ("single", 1): "Paris: 18 C and sunny.",
        # the same two calls in the other order: parallel calls have no order, so they are kept
        ("parallel", 0): 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "London"}}</tool_call>'
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        ("parallel", 1): "Warmer in Paris.",
        ("error", 0): '<tool_call>{"name": "get_stock", "arguments": {"symbol": "ABC"}}</tool_call>',  # other args
        ("error", 1): "The symbol is unknown.",
    }
    backend = ScriptedToolBackend(tool_tokenizer, script, ["single", "parallel", "error"])
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), sampling=SamplingConfig(temperature=0.0))
    totals = run_regen(cfg, backend, silent=True)["totals"]
    assert (totals["tool_exchanges_kept"], totals["tool_exchanges_replaced"], totals["tool_exchanges_dropped"]) == (2, 1, 0)
    single, parallel, error = rows(tmp_path / "out")
    assert single["messages"][1]["content"] == "" and single["messages"][1]["tool_calls"][0]["id"] == "a1"
    assert json.loads(single["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert single["messages"][3]["content"] == "Paris: 18 C and sunny."
    assert [c["id"] for c in parallel["messages"][1]["tool_calls"]] == ["b2", "b1"]  # the target's order, recorded ids
    assert parallel["messages"][1]["content"] == "Checking."
    assert error["messages"][1]["tool_calls"][0]["function"]["arguments"] == json.dumps({"symbol": "XYZ"})
    assert error["finish_reasons"] == ["recorded", "stop"] and error["flags"] == ["turn 0: recorded tool calls kept"]
    for row, chat in zip((single, parallel, error), TOOL_CHATS, strict=True):  # tool results as given
        assert [m for m in row["messages"] if m["role"] == "tool"] == [
            {"role": "tool", "content": m["content"], "tool_calls": None, "tool_call_id": m["tool_call_id"],
             "name": None, "thinking": None} for m in chat["messages"] if m["role"] == "tool"]

    # sf-capture's mask over the regenerated set: assistant text and calls, no tool result
    for conv in load_conversations(tmp_path / "out").conversations:
        rendered = render_with_mask(tool_tokenizer, conv.to_messages())
        trained = masked_texts(tool_tokenizer, rendered)
        answers = [m for m in conv.messages if m.role == "assistant"]
        assert len(trained) == len(answers)
        for text, m in zip(trained, answers, strict=True):
            assert text.endswith("<|im_end|>") and m.content in text
            assert all(f'"name": "{c.name}"' in text for c in m.tool_calls)
        assert "<tool_call>" in trained[0] and "<tools>" in rendered.text
        assert not any(r in t for r in RESULTS for t in trained)
        assert any(r in rendered.text for r in RESULTS)

    # strictly on-policy instead: a conversation whose calls differ is dropped, its exchange counted
    drop = RegenConfig(output=str(tmp_path / "drop"), source=str(src), on_tool_mismatch="drop",
                       sampling=SamplingConfig(temperature=0.0))
    totals = run_regen(drop, backend, silent=True)["totals"]
    assert (totals["tool_exchanges_kept"], totals["tool_exchanges_replaced"], totals["tool_exchanges_dropped"]) == (2, 0, 1)
    assert totals["dropped_tool_mismatch"] == 1 and [r["id"] for r in rows(tmp_path / "drop")] == ["single", "parallel"]


def test_a_template_without_tools_is_refused_in_one_line(tmp_path, smollm2_dir, tool_tokenizer):
    assert template_renders_tools(tool_tokenizer)
    plain = load_tokenizer(smollm2_dir)  # SmolLM2's own template ignores tools and calls
    assert not template_renders_tools(plain)
    src = write_jsonl(tmp_path / "tools.jsonl", TOOL_CHATS)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src))
    with pytest.raises(RegenError, match=rf"^{src}:1: a conversation with tools, but the chat template \(the "
                                         r"target's own\) does not render tools.*--chat-template FILE"):
        run_regen(cfg, ScriptedToolBackend(plain, {}, []), silent=True)


@pytest.mark.slow
def test_smollm2_regenerates_tool_conversations(tmp_path, smollm2_dir, tool_tokenizer):
    """The real target through the hf backend: every exchange accounted for, the records kept."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    backend = HFBackend(Target.load("smollm2", device="cpu", chat_template=str(template)), batch_size=4)
    src = write_jsonl(tmp_path / "tools.jsonl", TOOL_CHATS)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), chat_template=str(template),
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=32))
    totals = run_regen(cfg, backend, silent=True)["totals"]
    written = rows(tmp_path / "out")
    assert totals["tool_exchanges_kept"] + totals["tool_exchanges_replaced"] + totals["tool_exchanges_dropped"] == 3
    assert totals["tool_exchanges_dropped"] == 3 - len(written)
    for row in written:
        chat = next(c for c in TOOL_CHATS if c["id"] == row["id"])
        assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == [
            m["content"] for m in chat["messages"] if m["role"] == "tool"]
        assert len(row["finish_reasons"]) == 2
