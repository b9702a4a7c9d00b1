"""What the stages make of their inputs: tool conversations under a template that drops tools, a
conversation that opens with a greeting, empty answers, tool calls on a user message, duplicate
ids, an output folder inside its source, and a source that changed under a resumed run. These run
on SmolLM2's tokenizer and scripted backends: no model is loaded."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specfoundry import __version__
from specfoundry.capture.stage import CaptureConfig, CaptureError, prepare_samples
from specfoundry.capture.template import masked_texts, render_with_mask
from specfoundry.common.target import load_tokenizer
from specfoundry.conversations.records import ConversationFormatError
from specfoundry.conversations.regen_format import FORMAT_VERSION, READS_VERSIONS
from specfoundry.conversations.sources import load_conversations
from specfoundry.eval.prompts import EvalError, load_prompts
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.regen import RegenConfig, RegenError, run_regen
from tests.conftest import CHAT, write_jsonl
from tests.test_regen import EchoBackend
from tests.test_tools import TOOL_CHATS, TOOL_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    """SmolLM2's own tokenizer and template (ChatML; it ignores tools and tool calls)."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    return load_tokenizer(smollm2_dir, str(path))


def rows(out):
    return [r for p in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def capture_cfg(src, tmp_path, **kw) -> CaptureConfig:
    return CaptureConfig(source=str(src), output=str(tmp_path / "fs"), max_length=256, **kw)


# ---- item 1: every stage that renders conversations checks the template renders tools ---------------

def test_capture_refuses_tool_conversations_whose_template_drops_the_tools(tmp_path, tokenizer, tool_tokenizer):
    src = write_jsonl(tmp_path / "tools.jsonl", TOOL_CHATS)
    conv = load_conversations(src).conversations[0]
    # what sf-capture stored before: the call turn rendered as an empty assistant turn, its loss mask
    # on <|im_end|> alone (the draft learnt to end the turn where the target calls a tool), no tools list
    dropped = render_with_mask(tokenizer, conv.to_messages())
    assert masked_texts(tokenizer, dropped)[0] == "<|im_end|>" and "get_weather" not in dropped.text
    with pytest.raises(CaptureError, match=rf"^{src}:1: a conversation with tools, but the chat template \(the "
                                           r"target's own\) does not render tools.*--chat-template FILE"):
        prepare_samples(capture_cfg(src, tmp_path), tokenizer)
    # with a template that renders them: the call is trained on, the tools are in the text
    samples, bad, _, _ = prepare_samples(capture_cfg(src, tmp_path), tool_tokenizer)
    assert [s["id"] for s in samples] == ["single", "parallel", "error"] and bad == []
    first = tool_tokenizer.decode([t for t, m in zip(samples[0]["input_ids"], samples[0]["loss_mask"], strict=True)
                                   if m])
    assert first.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert "<tools>" in tool_tokenizer.decode(samples[0]["input_ids"])


def test_eval_refuses_tool_prompts_whose_template_drops_the_tools_and_renders_them_otherwise(
        tmp_path, tokenizer, tool_tokenizer):
    prompts = [{"id": c["id"], "tools": c["tools"], "messages": c["messages"][:1]} for c in TOOL_CHATS]
    src = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    with pytest.raises(EvalError, match=rf"^{src}:1: a conversation with tools, but the chat template"):
        load_prompts(str(src), tokenizer)
    (_, ids), *_ = load_prompts(str(src), tool_tokenizer)
    assert '"name": "get_weather"' in tool_tokenizer.decode(ids)  # before: the tools list was left out


# ---- item 12: a conversation that opens with an assistant greeting --------------------------------

GREETING = {"id": "greet", "conversations": [{"from": "gpt", "value": "Hi! How can I help?"},
                                             {"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]}


def test_a_conversation_opening_with_a_greeting_is_one_bad_input_not_a_lost_run(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "chat.jsonl", [GREETING, CHAT[0]])
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), sampling=SamplingConfig(temperature=0.0))
    manifest = run_regen(cfg, EchoBackend(tokenizer), silent=True)  # before: a ValueError traceback, no output
    assert manifest["complete"] and [r["id"] for r in rows(tmp_path / "out")] == ["c0"]
    assert [(b["location"], b["kind"]) for b in manifest["bad_inputs"]] == [(f"{src}:1", "starts_on_assistant")]
    samples, bad, _, _ = prepare_samples(capture_cfg(src, tmp_path), tokenizer)  # sf-capture: the same report
    assert [s["id"] for s in samples] == ["c0"] and [(b.location, b.kind) for b in bad] == [
        (f"{src}:1", "starts_on_assistant")]
    with_system = {"messages": [{"role": "system", "content": "Be brief."}, *GREETING["conversations"]]}
    assert load_conversations(write_jsonl(tmp_path / "s.jsonl", [with_system])).bad == []  # it has a prompt


def test_sf_capture_s_summary_counts_the_bad_inputs_it_left_out(tmp_path, tiny_llama_dir):
    """The last line once said "0 skipped" under a bad input's report, as though nothing was left out."""
    from specfoundry.capture.cli import main as capture_main

    src = write_jsonl(tmp_path / "chat.jsonl", [GREETING, CHAT[0]])
    result = CliRunner().invoke(capture_main, ["run", str(src), "-o", str(tmp_path / "fs"), "--target",
                                               str(tiny_llama_dir), "--max-length", "256", "--silent"])
    assert result.exit_code == 0, (result.output, result.exception)
    (report,) = [line for line in result.output.splitlines() if line.startswith("bad input: ")]
    (summary,) = [line for line in result.output.splitlines() if line.startswith("feature set ")]
    assert report == f"bad input: {src}:1: starts_on_assistant: " + report.split("starts_on_assistant: ")[1]
    assert summary.startswith(f"feature set {tmp_path / 'fs'}: 1 samples, ")
    assert summary.endswith("loss tokens; left out: 1 bad inputs (above)")
    long_question = {"id": "long", "conversations": [{"from": "human", "value": "Why? " * 200},
                                                     {"from": "gpt", "value": "Because."}]}
    src = write_jsonl(tmp_path / "long.jsonl", [long_question, CHAT[0]])
    result = CliRunner().invoke(capture_main, ["run", str(src), "-o", str(tmp_path / "fs2"), "--target",
                                               str(tiny_llama_dir), "--max-length", "256", "--silent"])
    assert result.exit_code == 0, (result.output, result.exception)
    (summary,) = [line for line in result.output.splitlines() if line.startswith("feature set ")]
    assert summary.endswith("loss tokens; left out: 1 with no assistant token within --max-length 256"), summary


# ---- item 17: an empty answer is named as one, not as a template problem ---------------------------

def test_an_empty_assistant_message_is_reported_as_such(tmp_path, tokenizer):
    empty = {"id": "e", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                                     {"role": "user", "content": "Still there?"},
                                     {"role": "assistant", "content": "Yes."}]}
    src = write_jsonl(tmp_path / "chat.jsonl", [CHAT[0], empty])
    samples, bad, _, _ = prepare_samples(capture_cfg(src, tmp_path), tokenizer)
    assert [s["id"] for s in samples] == ["c0"]
    assert [str(b) for b in bad] == [f"{src}:2: empty_answer: turn 1 is an empty assistant message: nothing to learn"]


# ---- item 8: tool calls on a user message, duplicate ids --------------------------------------------

def test_tool_calls_on_a_user_message_and_a_duplicate_id_are_reported(tmp_path, tokenizer):
    user_calls = {"id": "u", "messages": [
        {"role": "user", "content": "x", "tool_calls": [{"id": "q", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "y"}]}
    again = {**CHAT[5], "messages": [{"role": "user", "content": "Say it again."},
                                     {"role": "assistant", "content": "Again."}]}
    src = write_jsonl(tmp_path / "chat.jsonl", [CHAT[0], user_calls, CHAT[5], again])
    loaded = load_conversations(src)
    assert [c.id for c in loaded.conversations] == ["c0", "c5"]
    assert [str(b) for b in loaded.bad] == [
        f"{src}:2: bad_tool_call: turn 0 is a user message with tool_calls (only an assistant message calls tools)",
        f"{src}:4: duplicate_id: id 'c5' is used already, by {src}:3"]
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), sampling=SamplingConfig(temperature=0.0))
    run_regen(cfg, EchoBackend(tokenizer), silent=True)
    assert [r["id"] for r in rows(tmp_path / "out")] == ["c0", "c5"]  # before: c5 twice, and u without its call
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["bad_input_counts"] == {
        "bad_tool_call": 1, "duplicate_id": 1}


# ---- item 2: an output inside its source; a folder holding a run -----------------------------------

@pytest.mark.parametrize("command", ["sf-regen", "sf-capture"])
def test_an_output_inside_its_source_folder_is_refused_before_any_work(tmp_path, command):
    from tests.test_cli_help import COMMANDS

    src = tmp_path / "chats"
    src.mkdir()
    write_jsonl(src / "chat.jsonl", CHAT)
    for out in (src / "out", src):
        quick = ["--limit", "1", "--silent"] + (["--max-new-tokens", "1"] if command == "sf-regen" else [])
        result = CliRunner().invoke(COMMANDS[command], ["run", str(src), "-o", str(out), *quick])
        assert result.exit_code == 2, (result.output, result.exception)
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert errors == [f"Error: --output {out} is inside the source folder {src}: a rerun would read the "
                          "output's own files as new input; choose an output folder outside it"]
        assert sorted(p.name for p in src.iterdir()) == ["chat.jsonl"]


def test_a_folder_holding_a_run_is_read_through_its_contract_only(tmp_path, tokenizer):
    data = tmp_path / "data"
    (data / "raw").mkdir(parents=True)
    write_jsonl(data / "raw" / "a.jsonl", CHAT[:2])
    regen = data / "regen"  # an sf-regen output beside the raw files: its manifest lists its shards
    run_regen(RegenConfig(output=str(regen), source=str(write_jsonl(tmp_path / "b.jsonl", CHAT[2:4])),
                          sampling=SamplingConfig(temperature=0.0)), EchoBackend(tokenizer), silent=True)
    (regen / "data" / ".partial-shard-00001.parquet").write_bytes((regen / "data" / "shard-00000.parquet").read_bytes())
    fs = data / "fs"  # another stage's run: no conversations in it
    fs.mkdir()
    (fs / "capture_config.json").write_text("{}")
    (fs / "manifest.json").write_text(json.dumps({"format": "specfoundry.featureset", "shards": []}))
    loaded = load_conversations(data)
    # before: the regen run's config, done mark and manifest were 3 bad inputs, its partial shard data
    assert loaded.bad == [] and [c.id for c in loaded.conversations] == ["c0", "c1", "c2", "c3"]
    assert [c.location.removeprefix(f"{tmp_path}/") for c in loaded.conversations] == [
        "data/raw/a.jsonl:1", "data/raw/a.jsonl:2", "data/regen/data/shard-00000.parquet:row 0",
        "data/regen/data/shard-00000.parquet:row 1"]
    (regen / "manifest.json").unlink()
    with pytest.raises(ConversationFormatError, match=rf"^{regen} holds an sf-regen run without its manifest.json"):
        load_conversations(data)
    with pytest.raises(ConversationFormatError, match=rf"^{fs} holds an sf-capture run, not conversations"):
        load_conversations(fs)


def test_a_regen_folder_of_a_version_not_read_is_refused_by_every_reader(tmp_path, tokenizer):
    """Before: the reader never read format_version, so rows of another schema were read as if they
    were this one's. Now each reader (loading, sf-capture, sf-regen's source, sf-eval's prompts)
    refuses the folder in one line naming the manifest, the version found and the versions read."""
    regen = tmp_path / "regen"
    run_regen(RegenConfig(output=str(regen), source=str(write_jsonl(tmp_path / "a.jsonl", CHAT[:2])),
                          sampling=SamplingConfig(temperature=0.0)), EchoBackend(tokenizer), silent=True)
    manifest = json.loads((regen / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION and FORMAT_VERSION in READS_VERSIONS
    (regen / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    line = (f"{regen / 'manifest.json'}: regen format version 99 (written by specfoundry {__version__}) is not one "
            f"this specfoundry reads (versions {', '.join(map(str, READS_VERSIONS))})")
    with pytest.raises(ConversationFormatError) as e:
        load_conversations(regen)
    assert str(e.value) == line
    with pytest.raises(ConversationFormatError, match=re.escape(line)):
        load_conversations(tmp_path)  # a folder holding it
    with pytest.raises(ConversationFormatError, match=re.escape(line)):
        load_prompts(str(regen), tokenizer)
    with pytest.raises(RegenError, match=re.escape(line)):
        run_regen(RegenConfig(output=str(tmp_path / "again"), source=str(regen)), EchoBackend(tokenizer), silent=True)
    from specfoundry.capture.cli import main as capture_main

    result = CliRunner().invoke(capture_main, ["run", str(regen), "-o", str(tmp_path / "fs"), "--silent"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert [x for x in result.output.splitlines() if x.strip()] == [f"Error: {line}"]


# ---- item 3: a rerun notices a source that changed ---------------------------------------------------

def regen_files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "data").iterdir())}


def test_regen_rerun_after_the_source_changed_equals_a_fresh_run(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)

    def regen(out):  # shards of 1 at batch 1: groups of 4 shards, [0-3] and [4-5]
        cfg = RegenConfig(output=str(out), source=str(src), shard_size=1, batch_size=1,
                          sampling=SamplingConfig(temperature=0.0))
        return run_regen(cfg, EchoBackend(tokenizer), silent=True)

    regen(tmp_path / "out")
    inserted = {"id": "new", "messages": [{"role": "user", "content": "A line inserted."},
                                          {"role": "assistant", "content": "-"}]}
    edited = {**CHAT[5], "messages": [{"role": "user", "content": "Capital of Spain?"},
                                      {"role": "assistant", "content": "Madrid."}]}
    write_jsonl(src, [CHAT[0], inserted, *CHAT[1:5], edited])  # shifts shards 1-5, edits the last (same id)
    capsys.readouterr()
    manifest = regen(tmp_path / "out")
    # every shard of a group whose records changed (groups of 4: shards 0-3 and 4-5) is written again
    assert f"{tmp_path / 'out'}: {src} changed since data/shard-00000.parquet and 5 more were written: writing them " \
           "again" in capsys.readouterr().err
    # before: shards 0-5 were kept as marked, so "new" was missing, c4 was written twice and c5 kept
    # its old question
    assert [r["id"] for r in rows(tmp_path / "out")] == ["c0", "new", "c1", "c2", "c3", "c4", "c5"]
    assert rows(tmp_path / "out")[-1]["messages"][1]["content"] == "Capital of Spain?"[::-1]
    regen(tmp_path / "fresh")
    assert regen_files(tmp_path / "out") == regen_files(tmp_path / "fresh")
    assert manifest["shards"][0]["source_sha256"] == json.loads(
        (tmp_path / "fresh" / "data" / "shard-00000.parquet.done.json").read_text())["source_sha256"]


@pytest.fixture(scope="module")
def tiny_target(smollm2_dir, tmp_path_factory):
    """A random 8-layer Llama of width 64 with SmolLM2's tokenizer: a capture of it takes no time."""
    from specfoundry.testing import write_tiny_target

    return write_tiny_target("llama", tmp_path_factory.mktemp("tiny") / "llama", smollm2_dir)


def test_capture_rerun_after_the_source_changed_recaptures_the_changed_shard(tmp_path, tiny_target, capsys):
    from specfoundry.capture.stage import run_capture

    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)

    def capture(out):
        cfg = CaptureConfig(source=str(src), output=str(out), target=str(tiny_target), shard_size=2, max_length=64,
                            codec="safetensors", device="cpu")
        return {s["path"]: s["sha256"] for s in run_capture(cfg, silent=True)["shards"]}

    first = capture(tmp_path / "fs")
    edited = {**CHAT[3], "messages": [CHAT[3]["messages"][0], {"role": "assistant", "content": "Rain on the roof."}]}
    write_jsonl(src, [*CHAT[:3], edited, *CHAT[4:]])  # the same ids: only the answer of c3 differs
    capsys.readouterr()
    again = capture(tmp_path / "fs")
    assert f"{tmp_path / 'fs'}: {src} changed since shards/shard-000001.safetensors was written: writing it again" \
        in capsys.readouterr().err
    fresh = capture(tmp_path / "fresh")
    assert again == fresh  # before: shard 1 was kept, holding the features of the old answer
    assert again["shards/shard-000001.safetensors"] != first["shards/shard-000001.safetensors"]
    assert [again[k] for k in again if "000001" not in k] == [first[k] for k in first if "000001" not in k]
