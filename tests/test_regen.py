"""sf-regen on the embedded SmolLM2: greedy equality, seeded reproducibility, kill and resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from specfoundry.conversations.regen_format import FORMAT_VERSION
from specfoundry.generate.backends.hf import HFBackend
from specfoundry.generate.backends.interface import Generation, Request, SamplingConfig
from specfoundry.generate.cli import main as regen_cli
from specfoundry.generate.regen import RegenConfig, RegenError, run_regen
from specfoundry.generate.repetition import loop_cut
from tests.conftest import CHAT, write_jsonl


@pytest.fixture(scope="module")
def backend(smollm2_target):
    return HFBackend(smollm2_target, batch_size=4)


def rows(out):
    return [r for p in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_greedy_regen_equals_model_generate(tmp_path, chat_file, backend):
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(chat_file), shard_size=4,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=16))
    manifest = run_regen(cfg, backend, silent=True)
    assert manifest["complete"] and manifest["totals"]["conversations_written"] == len(CHAT)
    model, tok = backend.model, backend.tokenizer
    checked = 0
    for row in rows(tmp_path / "out"):
        history = []
        turn = 0
        for m in row["messages"]:
            if m["role"] == "assistant":
                ids = torch.tensor([backend.render(Request(tag=0, seed=0, messages=tuple(history)))])
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                     eos_token_id=backend.stop_ids, pad_token_id=backend.pad_id)
                ref_new = ref[0, ids.shape[1]:].tolist()
                if ref_new and ref_new[-1] in backend.stop_ids:
                    ref_new = ref_new[:-1]
                assert row["gen_token_ids"][turn] == ref_new, f"{row['id']} turn {turn}"
                assert m["content"] == tok.decode(ref_new)
                turn += 1
                checked += 1
            history.append(m)
    assert checked == 7  # c1 has two assistant turns


def test_sampled_regen_is_reproducible_and_seed_sensitive(tmp_path, chat_file, backend):
    def run(name, seed):
        cfg = RegenConfig(output=str(tmp_path / name), source=str(chat_file), shard_size=3,
                          sampling=SamplingConfig(temperature=0.8, max_new_tokens=8, seed=seed))
        run_regen(cfg, backend, silent=True)
        return rows(tmp_path / name)

    a, b, c = run("a", 7), run("b", 7), run("c", 8)
    assert a == b
    assert [r["gen_token_ids"] for r in a] != [r["gen_token_ids"] for r in c]


def test_synthesised_prompts_are_recorded(tmp_path, backend):
    cfg = RegenConfig(output=str(tmp_path / "s"), synthesize=3, shard_size=2,
                      sampling=SamplingConfig(temperature=0.8, max_new_tokens=12, seed=1))
    # prompts that hit the cap are not finished questions: allow a longer prompt phase
    manifest = run_regen(cfg, backend, silent=True)
    assert manifest["synthetic_prompts"] is True
    t = manifest["totals"]
    assert t["conversations_in"] + t["synthetic_prompts_empty"] == 3
    for r in rows(tmp_path / "s"):
        assert r["id"].startswith("synth-") and r["messages"][0]["role"] == "user" and r["messages"][0]["content"]


def test_synthesised_prompts_begin_with_their_openings(tmp_path, backend):
    # prompt i is seeded with opening i mod len and the target writes the rest of the request
    starters = ("Why", "Write a", "Compare")
    cfg = RegenConfig(output=str(tmp_path / "o"), synthesize=6, shard_size=4, prompt_starters=starters,
                      sampling=SamplingConfig(temperature=0.8, max_new_tokens=40, seed=3))
    run_regen(cfg, backend, silent=True)
    written = {int(r["id"].split("-")[1]): r["messages"][0]["content"] for r in rows(tmp_path / "o")}
    assert len(written) >= 3
    for i, text in written.items():
        assert text.startswith(starters[i % 3]) and len(text) > len(starters[i % 3])
    # the openings are part of the settings: another list does not resume into this folder
    with pytest.raises(ValueError, match="prompt_starters"):
        run_regen(replace(cfg, prompt_starters=("How",)), backend, silent=True)


def test_what_synthesis_needs_is_one_line_before_anything_is_written(tmp_path, backend):
    """A target rendered as plain completion has no user turn to synthesise from, and a chat-template
    argument the template never reads is a typo: each is refused in one line, the folder left without
    a record, so that the corrected command runs into it."""
    out = tmp_path / "o"
    result = CliRunner().invoke(regen_cli, ["run", "--synthesize", "2", "--chat-template", "completion", "-o", str(out)])
    assert result.exit_code == 2 and "prompt synthesis needs a chat template" in result.output, result.output
    assert "Traceback" not in result.output and not (out / "regen_config.json").exists()
    cfg = RegenConfig(output=str(out), synthesize=2, chat_template_kwargs={"enable_thinkng": False},
                      sampling=SamplingConfig(temperature=0.8, max_new_tokens=4))
    with pytest.raises(RegenError, match="reads no 'enable_thinkng'"):
        run_regen(cfg, backend, silent=True)
    assert not (out / "regen_config.json").exists() and not (out / "manifest.json").exists()


def test_a_missing_source_is_named_before_the_target_loads(tmp_path, monkeypatch):
    import specfoundry.generate.regen as regen

    monkeypatch.setattr(regen, "make_backend", lambda cfg: pytest.fail("the target loaded first"))
    with pytest.raises(RegenError, match="no such file or folder: .*missing.jsonl"):
        run_regen(RegenConfig(output=str(tmp_path / "o"), source=str(tmp_path / "missing.jsonl")))


def test_an_empty_source_is_refused_before_the_target_loads_and_writes_nothing(tmp_path, monkeypatch):
    """An empty file once gave an output whose manifest said complete, then 'no conversation written'."""
    import specfoundry.generate.regen as regen

    monkeypatch.setattr(regen, "make_backend", lambda cfg: pytest.fail("the target loaded first"))
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(RegenError, match=r"empty.jsonl: empty: no conversation to regenerate$"):
        run_regen(RegenConfig(output=str(tmp_path / "o"), source=str(tmp_path / "empty.jsonl")))
    assert not (tmp_path / "o" / "manifest.json").exists()
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n  \n")  # blank lines only
    (folder / "b.jsonl").touch()
    with pytest.raises(RegenError, match=r"data: every file empty: no conversation to regenerate$"):
        run_regen(RegenConfig(output=str(tmp_path / "o"), source=str(folder)))


def test_prompt_starters_option(tmp_path):
    from specfoundry.generate.synth import DEFAULT_STARTERS, read_starters

    assert read_starters("default") == DEFAULT_STARTERS and read_starters("none") == ()
    f = tmp_path / "openings.txt"
    f.write_text("Why\n\n  Explain \n")
    assert read_starters(str(f)) == ("Why", "Explain")
    f.write_text("\n")
    with pytest.raises(ValueError, match="no openings"):
        read_starters(str(f))
    result = CliRunner().invoke(regen_cli, ["run", "--synthesize", "1", "--prompt-starters", str(tmp_path / "missing"),
                                            "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and "neither 'default', 'none' nor a file" in result.output


def test_a_run_that_writes_no_conversation_fails_naming_why(tmp_path, monkeypatch):
    """Every synthesised prompt unfinished within --max-new-tokens: the run says so and fails,
    instead of a success that the capture would only reject later."""
    import specfoundry.generate.cli as cli_module

    totals = {"conversations_in": 0, "conversations_written": 0, "synthetic_prompts_empty": 3}
    monkeypatch.setattr(cli_module, "run_regen", lambda cfg, silent=False: {"bad_inputs": [], "totals": totals})
    out = tmp_path / "o"
    args = ["run", "--synthesize", "3", "--max-new-tokens", "12", "-o", str(out)]
    result = CliRunner().invoke(regen_cli, args)
    assert result.exit_code == 2, result.output
    assert "synthesised prompts unfinished or empty 3" in result.output
    assert f"{out}: no conversation written: no synthesised prompt ended within --max-new-tokens (12)" in result.output
    # prompts that did end, and answers lost for another reason: the counts say which
    totals.update(conversations_in=2, synthetic_prompts_empty=1, turns_empty=2)
    result = CliRunner().invoke(regen_cli, args)
    assert result.exit_code == 2 and f"{out}: no conversation written: see the counts above" in result.output
    totals["conversations_written"] = 2
    assert CliRunner().invoke(regen_cli, args).exit_code == 0
    # answers whose reasoning never closed: counted among the truncated, the reason said in a line of its own
    totals.update(conversations_written=0, turns_truncated=2, turns_reasoning_unclosed=2)
    result = CliRunner().invoke(regen_cli, args)
    assert ("2 answers' reasoning never closed (cut by --max-new-tokens 12, or the turn ended in it): those turns "
            "were dropped") in result.output and result.exit_code == 2


def test_greedy_answers_still_get_sampled_prompts(tmp_path, backend):
    # greedy prompts from the same Magpie prefix would all be one text: prompts stay sampled
    cfg = RegenConfig(output=str(tmp_path / "g"), synthesize=4, shard_size=4,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=24, seed=2))
    assert cfg.prompt_sampling().temperature == 1.0
    prompts = [backend.generate([Request(tag=0, seed=seed, text="x")], cfg.prompt_sampling())[0].token_ids
               for seed in (1, 2)]
    assert prompts[0] != prompts[1]
    run_regen(cfg, backend, silent=True)
    users = [r["messages"][0]["content"] for r in rows(tmp_path / "g")]
    assert len(set(users)) == len(users) >= 2
    with pytest.raises(ValueError, match="prompt-temperature"):
        RegenConfig(output="x", synthesize=1, prompt_temperature=0.0).prompt_sampling()


def test_rerun_with_other_settings_is_refused(tmp_path, chat_file, backend):
    out = tmp_path / "o"
    run_regen(RegenConfig(output=str(out), source=str(chat_file), limit=1,
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=4)), backend, silent=True)
    with pytest.raises(ValueError, match="other settings.*sampling"):
        run_regen(RegenConfig(output=str(out), source=str(chat_file), limit=1,
                              sampling=SamplingConfig(temperature=0.5, max_new_tokens=4)), backend, silent=True)


def test_resume_of_a_folder_written_in_another_format_is_refused(tmp_path, chat_file, backend):
    """Finished shards are never rewritten, so resuming an older format's folder would leave one
    dataset with two row schemas: refused in one line naming the manifest and both versions."""
    out = tmp_path / "o"
    cfg = RegenConfig(output=str(out), source=str(chat_file), limit=2,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    run_regen(cfg, backend, silent=True)
    manifest = json.loads((out / "manifest.json").read_text())
    run_regen(cfg, backend, silent=True)  # the same format resumes (nothing left to do)
    manifest["format_version"] = FORMAT_VERSION - 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"manifest.json: its shards are regen format {FORMAT_VERSION - 1}, "
                                         f"this sf-regen writes format {FORMAT_VERSION}"):
        run_regen(cfg, backend, silent=True)


def test_the_resume_refusal_is_one_line_before_the_target_loads(tmp_path, chat_file, backend, monkeypatch):
    """sf-regen rerun into a folder another format version began: one line naming both versions,
    given before the backend (the target) is loaded."""
    out = tmp_path / "o"
    run_regen(RegenConfig(output=str(out), source=str(chat_file), limit=2,
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=4)), EchoBackend(backend.tokenizer),
              silent=True)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    import specfoundry.generate.regen as regen_module

    monkeypatch.setattr(regen_module, "make_backend", lambda cfg: pytest.fail("the target was loaded"))
    result = CliRunner().invoke(regen_cli, ["run", str(chat_file), "-o", str(out), "--limit", "2", "--greedy",
                                            "--max-new-tokens", "4", "--silent"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert [x for x in result.output.splitlines() if x.strip()] == [
        f"Error: {out / 'manifest.json'}: its shards are regen format 99, this sf-regen writes format {FORMAT_VERSION} "
        f"(rows with another schema); regenerate into a new folder, or remove {out / 'data'} and its done marks to "
        "start this one again"]


def test_cli_reports_bad_input_and_keeps_good(tmp_path):
    src = tmp_path / "mixed.jsonl"
    # (a user turn alone is a prompt sf-regen answers; an assistant turn with nothing before it is not)
    src.write_text(json.dumps(CHAT[0]) + "\n{oops\n" + json.dumps({"messages": [{"role": "assistant", "content": "x"}]})
                   + "\n" + json.dumps(CHAT[5]) + "\n")
    result = CliRunner().invoke(regen_cli, ["run", str(src), "-o", str(tmp_path / "out"), "--greedy",
                                            "--max-new-tokens", "4", "--silent"])
    assert result.exit_code == 0, result.output
    assert f"{src}:2: malformed_json" in result.output and f"{src}:3: starts_on_assistant" in result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["bad_input_counts"] == {"malformed_json": 1, "starts_on_assistant": 1}
    assert [r["id"] for r in rows(tmp_path / "out")] == ["c0", "c5"]
    strict = CliRunner().invoke(regen_cli, ["run", str(src), "-o", str(tmp_path / "s"), "--strict", "--silent"])
    assert strict.exit_code != 0 and f"{src}:2: malformed_json" in strict.output


def test_over_long_prompt_is_bad_input(tmp_path, backend):
    src = write_jsonl(tmp_path / "long.jsonl", [
        CHAT[0], {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}])
    cfg = RegenConfig(output=str(tmp_path / "o"), source=str(src), max_prompt_tokens=100,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    manifest = run_regen(cfg, backend, silent=True)
    assert manifest["bad_input_counts"] == {"over_long_prompt": 1}
    assert manifest["bad_inputs"][0]["location"] == f"{src}:2"
    assert manifest["totals"]["conversations_written"] == 1


# the default run keeps tests/test_faults.py's SIGKILL-and-rerun of sf-regen
@pytest.mark.slow
def test_sigkill_midway_then_resume_gives_identical_shards(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    # batch 1: groups of 4 one-conversation shards, so the kill lands in a group, with a later one to come
    args = [sys.executable, "-m", "specfoundry.generate.cli", "run", str(src), "--shard-size", "1", "--batch-size", "1",
            "--max-new-tokens", "20", "--seed", "3", "--silent"]
    subprocess.run(args + ["-o", str(tmp_path / "whole")], check=True, capture_output=True)

    killed = tmp_path / "killed"
    # SIGKILLed just after the manifest lists its second shard, its third write (the first lists
    # none) (tests/faults.py: at that moment, not whenever a polling loop gets the CPU, which could
    # be after the last shard)
    fault = [str(Path(__file__).parent / "faults.py"), "--kill-at", "after-rename", "--match", "*/killed/manifest.json",
             "--nth", "3", "--"]
    run = subprocess.run([sys.executable, *fault, *args[2:], "-o", str(killed)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL and "faults: killed at" in run.stderr, run.stderr[-2000:]
    partial = json.loads((killed / "manifest.json").read_text())
    assert not partial["complete"] and len(partial["shards"]) == 2 < len(CHAT)

    subprocess.run(args + ["-o", str(killed)], check=True, capture_output=True)
    whole_files = sorted(p.name for p in (tmp_path / "whole" / "data").iterdir())
    assert whole_files == sorted(p.name for p in (killed / "data").iterdir())  # shards and done marks, no leftovers
    assert len([f for f in whole_files if f.endswith(".parquet")]) == len(CHAT)
    for name in whole_files:
        assert (killed / "data" / name).read_bytes() == (tmp_path / "whole" / "data" / name).read_bytes(), name


# ---- repetition loops (--on-truncated trim) --------------------------------------------------

@pytest.mark.parametrize("period", [1, 3, 17, 64])
def test_loop_cut_keeps_the_block_and_one_repeat(period):
    intro = list(range(1000, 1040))  # 40 distinct tokens of ordinary text
    block = list(range(2000, 2000 + period))
    ids = intro + block * (200 // period + 3)
    cut = loop_cut(ids)
    assert cut == len(intro) + 2 * period
    assert ids[:cut] == intro + block + block


def test_loop_cut_leaves_text_without_a_long_loop_alone():
    intro = list(range(1000, 1100))
    assert loop_cut(intro) is None
    assert loop_cut(intro + [7] * 31) is None  # 30 tokens repeated: under the 32-token threshold
    assert loop_cut(intro + list(range(5000, 5065)) * 2) is None  # a 65-token block: longer than the longest period
    assert loop_cut(intro + [7] * 2) is None  # cutting would remove nothing
    assert loop_cut([]) is None


class ScriptedBackend:
    """Answers every turn with the next scripted token ids; 'length' when they fill the cap."""

    name = "scripted"

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.prompts = tokenizer, list(answers), []

    def identity(self):
        return {"backend": self.name}

    def generate(self, requests, sampling):
        gens = []
        for r in requests:
            self.prompts.append(r.messages)
            ids = tuple(self.answers.pop(0))
            reason = "length" if len(ids) >= sampling.max_new_tokens else "stop"
            gens.append(Generation(self.tokenizer.decode(ids), reason, ids, len(ids)))
        return gens


def test_trim_cuts_looping_answers_and_later_turns_see_the_cut(tmp_path, backend):
    tok = backend.tokenizer
    text_ids = tok("A loop starts here.", add_special_tokens=False)["input_ids"]
    block = tok(" I hope this helps!", add_special_tokens=False)["input_ids"]
    looping = (text_ids + block * 40)[:96]
    plain = tok(" This answer ends before the cap.", add_special_tokens=False)["input_ids"]
    wordy = list(range(300, 396))  # hits the cap without a loop
    convs = [{"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "x"},
                           {"role": "user", "content": "q2"}, {"role": "assistant", "content": "y"}]},
             {"messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "z"}]}]
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    scripted = ScriptedBackend(tok, [looping, wordy, plain])  # turn 0 of both, then turn 1 of the first
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), on_truncated="trim",
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=96))
    manifest = run_regen(cfg, scripted, silent=True)
    t = manifest["totals"]
    kept = text_ids + block + block
    assert (t["turns_loop_trimmed"], t["turns_truncated"], t["loop_tokens_removed"]) == (1, 1, 96 - len(kept))
    first, second = sorted(rows(tmp_path / "out"), key=lambda r: r["id"])
    assert first["gen_token_ids"][0] == kept and first["messages"][1]["content"] == tok.decode(kept)
    assert first["finish_reasons"] == ["loop", "stop"] and first["flags"] == ["turn 0: loop trimmed"]
    assert scripted.prompts[2][1]["content"] == tok.decode(kept)  # turn 1 was generated on the trimmed answer
    assert second["finish_reasons"] == ["length"] and second["flags"] == ["turn 0: truncated"]


class EchoBackend:
    """Answers every turn with the token ids of its prompt's last message; records each call."""

    name = "echo"

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def identity(self):
        return {"backend": self.name}

    def generate(self, requests, sampling):
        self.calls.append([r.messages[-1]["content"] for r in requests])
        return [Generation(r.messages[-1]["content"][::-1], "stop", (1,), 1) for r in requests]


@pytest.mark.parametrize("batch_size", [1, 32])
def test_small_shards_are_generated_in_groups_and_written_in_order(tmp_path, backend, batch_size):
    # batch 1, shards of 1: groups of 4 shards (4 batches of conversations in flight), 2 groups
    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    echo = EchoBackend(backend.tokenizer)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(src), shard_size=1, batch_size=batch_size,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    manifest = run_regen(cfg, echo, silent=True)
    assert [s["index"] for s in manifest["shards"]] == list(range(6))
    # rounds: the first turns of a group's conversations together, then c1's second turn
    assert [len(c) for c in echo.calls] == ([4, 1, 2] if batch_size == 1 else [6, 1])
    written = rows(tmp_path / "out")
    assert [r["id"] for r in written] == [c["id"] for c in CHAT]
    assert written[1]["messages"][1]["content"] == "Name a colour."[::-1]


def test_a_prompt_list_is_answered_and_its_rows_end_on_the_targets_answer(tmp_path, backend):
    """Conversations that end on a user turn with no answer yet (a list of prompts, the commonest
    regen input; issue 37 item 7: refused as no_assistant_turn / ends_on_user, nothing written): the
    final user turn is answered, after the earlier assistant turns are regenerated as always; the
    answer is the target's own greedy one. Capture still refuses a conversation without an answer."""
    from specfoundry.capture.stage import CaptureConfig, prepare_samples

    prompts = [{"id": "p1", "messages": [{"role": "user", "content": "Name a colour."}]},
               {"id": "p2", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hi."}]},
               {"id": "p3", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                         {"role": "user", "content": "And a number?"}]}]
    source = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(source), shard_size=4,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=16))
    manifest = run_regen(cfg, backend, silent=True)
    assert manifest["complete"] and manifest["totals"]["conversations_written"] == 3 and not manifest["bad_inputs"]
    written = {r["id"]: r for r in rows(tmp_path / "out")}
    for p in prompts:
        row = written[p["id"]]
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in p["messages"]] + ["assistant"]
        assert len(row["gen_token_ids"]) == sum(m["role"] == "assistant" for m in p["messages"]) + 1
        history = row["messages"][:-1]
        ids = torch.tensor([backend.render(Request(tag=0, seed=0, messages=tuple(history)))])
        ref = backend.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                     eos_token_id=backend.stop_ids, pad_token_id=backend.pad_id)[0, ids.shape[1]:].tolist()
        if ref and ref[-1] in backend.stop_ids:
            ref = ref[:-1]
        assert row["gen_token_ids"][-1] == ref, p["id"]
    samples, bad, _, _ = prepare_samples(CaptureConfig(source=str(source), output="o"), backend.tokenizer)
    assert not samples and {b.kind for b in bad} == {"no_assistant_turn", "ends_on_user"}


def test_a_rerun_after_the_source_shrank_leaves_only_the_shards_its_manifest_lists(tmp_path, backend):
    """issue 61 item 7: the rerun's manifest listed the right shards, but data/ kept the old source's
    later shards, which datasets.load_dataset(folder) (docs/stages.md) read as conversations too."""
    source = tmp_path / "chat.jsonl"
    write_jsonl(source, CHAT * 3)
    out = tmp_path / "o"
    cfg = RegenConfig(output=str(out), source=str(source), shard_size=2,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    echo = EchoBackend(backend.tokenizer)
    run_regen(cfg, echo, silent=True)
    assert len(list((out / "data").glob("*.parquet"))) == 3
    write_jsonl(source, CHAT[:2])  # the source shrank to its first shard
    manifest = run_regen(cfg, echo, silent=True)
    listed = sorted(s["path"] for s in manifest["shards"])
    assert listed == ["data/shard-00000.parquet"]
    assert sorted(f"data/{p.name}" for p in (out / "data").glob("*.parquet")) == listed
    assert sorted(p.name for p in (out / "data").iterdir()) == ["shard-00000.parquet", "shard-00000.parquet.done.json"]
