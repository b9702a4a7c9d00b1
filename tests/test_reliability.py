"""Cases that used to pass silently or leave a stuck run: each is now refused or reported, with
the message naming what is wrong and where."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.common.cli import build_config
from specfoundry.common.shards import OutputFolderError, ShardedOutput
from specfoundry.conversations.records import ConversationFormatError
from specfoundry.conversations.regen_format import FORMAT, FORMAT_VERSION
from specfoundry.conversations.sources import load_conversations
from specfoundry.families.folders import TARGET_FILE, DraftLoadError, check_trained_for, locate_draft
from specfoundry.featureset.manifest import MANIFEST, FeatureSetError
from specfoundry.featureset.store import ShardReader, write_shard
from specfoundry.train.trainer import TrainConfig, Trainer, run_train
from tests.conftest import CHAT, copies, write_jsonl


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A small safetensors feature set of SmolLM2 (6 samples, 2 shards)."""
    root = tmp_path_factory.mktemp("rel")
    src = write_jsonl(root / "chat.jsonl", CHAT)
    run_capture(CaptureConfig(source=str(src), output=str(root / "fs"), shard_size=3, max_length=64,
                              codec="safetensors"), silent=True)
    return root / "fs"


def tiny_cfg(fs, out, **kw) -> TrainConfig:
    base = dict(featureset=str(fs), output=str(out), draft_vocab_size=256, ttt_length=2, lr=3e-3, warmup_steps=1,
                max_steps=2, max_batch_tokens=256, eval_fraction=0.0, save_every=2, num_workers=0,
                log_every=1000, loss_kernel="reference")
    return build_config(TrainConfig, {**base, **kw})


def copy_set(fs, tmp_path):
    out = tmp_path / "fs"
    shutil.copytree(fs, out)
    return out, json.loads((out / MANIFEST).read_text())


def rewrite_shard(fs, manifest, shard: int, change) -> dict:
    """Shard `shard` of the copied set `fs` written again as a sound file of the rows `change`
    (a function of the list of rows) leaves, its manifest entry updated; returns the entry."""
    entry = manifest["shards"][shard]
    reader = ShardReader(fs / entry["path"], "safetensors", "bfloat16")
    rows = [reader.sample(i) for i in range(len(reader))]
    rows = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask, "aux_hidden": s.aux_hidden.clone(),
             "final_hidden": s.final_hidden} for s in rows]
    del reader
    change(rows)
    entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", "bfloat16")
    (fs / MANIFEST).write_text(json.dumps(manifest))
    return entry


def test_a_nan_in_the_features_stops_training_naming_shard_and_sample(features, tmp_path):
    fs, manifest = copy_set(features, tmp_path)

    def nan(rows):
        rows[2]["aux_hidden"][1, 5] = float("nan")

    entry = rewrite_shard(fs, manifest, 1, nan)  # a sound file of bad values
    with pytest.raises(FeatureSetError, match=rf"shard {entry['path']} sample 2 .*non-finite"):
        run_train(tiny_cfg(fs, tmp_path / "run", max_steps=4), silent=True)
    assert not (tmp_path / "run" / "export").exists()


def test_a_damaged_shard_is_named_not_trained_on(features, tmp_path):
    fs, manifest = copy_set(features, tmp_path)
    victim = fs / manifest["shards"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[-50] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(FeatureSetError, match=rf"{manifest['shards'][0]['path']} is damaged or truncated"):
        run_train(tiny_cfg(fs, tmp_path / "run"), silent=True)


def test_features_of_another_model_are_refused(features, tmp_path):
    for key, words in (("config_sha256", "config hash"), ("weight_fingerprint", "weight fingerprint")):
        fs, manifest = copy_set(features, tmp_path / key)
        manifest["target"][key] = "0" * 64
        (fs / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(FeatureSetError, match=words):
            run_train(tiny_cfg(fs, tmp_path / key / "run"), silent=True)


def test_incomplete_featureset_and_longer_max_length_are_refused(features, tmp_path):
    fs, manifest = copy_set(features, tmp_path)
    with pytest.raises(FeatureSetError, match="--max-length 128 is longer than .* captured for \\(max_length 64\\)"):
        run_train(tiny_cfg(fs, tmp_path / "long", max_length=128), silent=True)
    manifest["complete"] = False
    (fs / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureSetError, match="incomplete"):
        run_train(tiny_cfg(fs, tmp_path / "run"), silent=True)


def test_rerun_with_another_lr_or_featureset_is_refused_naming_each(features, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_cfg(features, out), silent=True)
    recorded = json.loads((out / "train_config.json").read_text())
    with pytest.raises(OutputFolderError, match=r"lr: 0.003 -> 0.001"):
        run_train(tiny_cfg(features, out, lr=1e-3), silent=True)
    other, _ = copy_set(features, tmp_path)
    with pytest.raises(OutputFolderError, match=rf"featureset: '{features}' -> '{other}'"):
        run_train(tiny_cfg(other, out), silent=True)
    assert json.loads((out / "train_config.json").read_text()) == recorded  # the record is the run's own
    assert json.loads((out / "export" / TARGET_FILE).read_text())["config_sha256"]
    # each checkpoint keeps a copy of the record, so a lost train_config.json can be restored
    assert json.loads((out / "checkpoints" / "step-0000002" / "train_config.json").read_text()) == recorded


def test_a_draft_trained_for_another_target_is_refused_by_eval(features, tmp_path, smollm2_dir):
    out = tmp_path / "run"
    run_train(tiny_cfg(features, out), silent=True)
    assert check_trained_for(locate_draft(out), smollm2_dir, allow_other=False) is None
    recorded = json.loads((out / "export" / TARGET_FILE).read_text())
    (out / "export" / TARGET_FILE).write_text(json.dumps({**recorded, "weight_fingerprint": "f" * 64}))
    with pytest.raises(DraftLoadError, match="weight fingerprint differ.*--allow-other-target"):
        check_trained_for(locate_draft(out), smollm2_dir, allow_other=False)
    assert "weight fingerprint" in check_trained_for(locate_draft(out / "export"), smollm2_dir, allow_other=True)


def test_a_checkpoint_before_any_export_names_its_target(features, tmp_path, smollm2_dir):
    """issue 61 item 4: a run killed before its export had checkpoints that sf-eval evaluated against
    any target (its train_config.json names the target and was not read), and `sf-export --target
    OTHER` of one wrote an export without a target record, which sf-eval then accepted against
    anything. The run folder now records its target as it starts, and every reader looks there."""
    from specfoundry.families.folders import complete_checkpoints
    from specfoundry.train.export import ExportConfig, run_export

    out = tmp_path / "run"
    checkpoint = Trainer.checkpoint

    def checkpoint_then_kill(self):
        checkpoint(self)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "checkpoint", checkpoint_then_kill)
        with pytest.raises(KeyboardInterrupt):
            run_train(tiny_cfg(features, out), silent=True)
    assert not (out / "export").exists()
    step = complete_checkpoints(out)[-1]
    other = tmp_path / "other"  # SmolLM2's files, its config edited: another target of the same shapes
    other.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "config.json":
            (other / f.name).symlink_to(f)
    config = json.loads((smollm2_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 2 * config.get("rope_theta", 10000.0)}))
    assert check_trained_for(locate_draft(step), smollm2_dir, allow_other=False) is None
    with pytest.raises(DraftLoadError, match="config sha256 differ.*--allow-other-target"):
        check_trained_for(locate_draft(step), other, allow_other=False)
    exported = run_export(ExportConfig(draft=str(step), output=str(tmp_path / "export"), target=str(other)))
    assert json.loads((exported / TARGET_FILE).read_text()) == json.loads((out / TARGET_FILE).read_text())
    with pytest.raises(DraftLoadError, match="config sha256 differ"):
        check_trained_for(locate_draft(exported), other, allow_other=False)


def test_an_export_records_its_chat_template_and_eval_warns_under_another(features, tmp_path, smollm2_dir):
    """issue 61 item 12: a draft trained on conversations rendered with one template (a --chat-template
    file, or the target's own) was measured by sf-eval with another, unsaid. The export's training
    record now holds the feature set's template hash and source, and sf-eval warns where they differ."""
    from specfoundry.common.target import load_tokenizer, with_chat_template
    from specfoundry.eval.evaluate import other_template
    from specfoundry.families.folders import training_record

    out = tmp_path / "run"
    run_train(tiny_cfg(features, out), silent=True)
    record = training_record(locate_draft(out))
    assert record["chat_template_source"] == "target" and len(record["chat_template_sha256"]) == 64
    assert other_template(locate_draft(out), load_tokenizer(smollm2_dir)) is None
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    warning = other_template(locate_draft(out / "export"), with_chat_template(load_tokenizer(smollm2_dir), str(template)))
    assert "rendered with the target's own template" in warning and str(template) in warning


def test_incomplete_regen_is_refused_unless_partial(tmp_path, chat_file):
    regen = tmp_path / "regen"
    (regen / "data").mkdir(parents=True)
    shutil.copy(chat_file, regen / "data" / "a.jsonl")
    (regen / "manifest.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "num_shards": 2,
                                                     "complete": False, "shards": [{"path": "data/a.jsonl"}]}))
    with pytest.raises(ConversationFormatError, match="regen run is incomplete \\(1 of 2 shards\\).*--partial"):
        load_conversations(regen)
    assert len(load_conversations(regen, partial=True).conversations) == len(CHAT)
    from specfoundry.capture.cli import main

    result = CliRunner().invoke(main, ["run", str(regen), "-o", str(tmp_path / "fs")])
    assert result.exit_code == 2 and "incomplete" in result.output and "Traceback" not in result.output


def test_invalid_utf8_is_one_records_bad_input(tmp_path):
    good = [json.dumps(c).encode() + b"\n" for c in copies(CHAT[:1], 3)]
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    (tmp_path / "a.jsonl").write_bytes(good[0] + bad + good[1])
    (tmp_path / "b.jsonl").write_bytes(good[2])
    loaded = load_conversations(tmp_path)
    assert len(loaded.conversations) == 3
    assert [(b.location, b.kind) for b in loaded.bad] == [(f"{tmp_path / 'a.jsonl'}:2", "invalid_utf8")]


def test_a_renamed_but_unmarked_shard_is_redone_not_stuck(tmp_path):
    out = ShardedOutput(tmp_path)

    def write_dir(path):  # a zarr-like shard: a folder
        path.mkdir()
        (path / "x").write_bytes(b"new")
        from specfoundry.common.files import checksum

        return checksum(path)

    (tmp_path / "shards" / "s.zarr").mkdir(parents=True)  # renamed into place, killed before its mark
    (tmp_path / "shards" / "s.zarr" / "x").write_bytes(b"old")
    assert out.pending(["shards/s.zarr"]) == ["shards/s.zarr"]
    mark = out.commit("shards/s.zarr", write_dir, {"index": 0})
    assert (tmp_path / "shards" / "s.zarr" / "x").read_bytes() == b"new"
    assert out.finished("shards/s.zarr") == mark and out.pending(["shards/s.zarr"]) == []


@pytest.mark.parametrize("argv", [
    ["sf-regen", "run", "SRC", "-o", "FILE"],
    ["sf-capture", "run", "SRC", "-o", "FILE"],
    ["sf-train", "run", "FS", "-o", "FILE"],
    ["sf-eval", "run", "FS", "-o", "FILE"],
    ["sf-eval", "gate", "-o", "FILE"],
])
def test_an_output_path_that_is_a_file_is_one_line_before_any_work(tmp_path, chat_file, features, argv):
    from tests.test_cli_help import COMMANDS

    (tmp_path / "file").write_text("x")
    subs = {"SRC": str(chat_file), "FILE": str(tmp_path / "file"), "FS": str(features)}
    result = CliRunner().invoke(COMMANDS[argv[0]], [subs.get(a, a) for a in argv[1:]])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.output.count("Error:") == 1 and "is a file, not an output folder" in result.output


def test_a_bad_target_is_one_line_for_eval_and_gate(tmp_path, features):
    from specfoundry.cli import sf_eval as main
    from specfoundry.families.eagle3.export import export_draft
    from tests.test_export_formats import small_draft

    draft = small_draft()  # a real export: sf-eval names a folder that holds no draft first
    export = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    for argv in (["run", str(export), "--target", "/nonexistent/model"],
                 ["gate", "-o", str(tmp_path / "g"), "--target", "/nonexistent/model"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2 and "/nonexistent/model" in result.output and "Traceback" not in result.output


def test_a_non_finite_loss_stops_before_any_checkpoint(features, tmp_path):
    # --lr takes no infinite or absurd rate any more: the forward overflows on finite features as
    # large as bf16 holds instead (fc sums 3H of them)
    fs, manifest = copy_set(features, tmp_path)

    def huge(rows):
        for row in rows:
            row["aux_hidden"].fill_(3e38)

    for shard in range(len(manifest["shards"])):
        rewrite_shard(fs, manifest, shard, huge)
    with pytest.raises(ValueError, match=r"step \d: loss_0.* not finite .*diverged"):
        run_train(tiny_cfg(fs, tmp_path / "run"), silent=True)
    assert not list((tmp_path / "run").glob("checkpoints/step-*")) and not (tmp_path / "run" / "export").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only filesystem (a tmpfs mounted ro): root cannot write there either."""
    import subprocess

    where = tmp_path / "ro"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("argv", [
    ["sf-regen", "run", "SRC", "-o", "RO"],
    ["sf-capture", "run", "SRC", "-o", "RO"],
    ["sf-train", "run", "FS", "-o", "RO"],
    ["sf-eval", "run", "FS", "-o", "RO"],
])
def test_a_read_only_output_is_one_line_before_any_work(read_only_dir, chat_file, features, argv):
    from tests.test_cli_help import COMMANDS

    subs = {"SRC": str(chat_file), "RO": str(read_only_dir / "out"), "FS": str(features)}
    result = CliRunner().invoke(COMMANDS[argv[0]], [subs.get(a, a) for a in argv[1:]])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.output.count("Error:") == 1 and f"cannot write in {read_only_dir}" in result.output


def test_greedy_flag_and_recipe_values_reach_the_config(tmp_path, monkeypatch):
    import click

    import specfoundry.generate.cli as regen_cli
    from specfoundry.common.cli import resolve_config
    from specfoundry.eval.evaluate import EvalConfig

    seen = {}

    def record_config(cfg, silent=False):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(regen_cli, "run_regen", record_config)
    CliRunner().invoke(regen_cli.main, ["run", "-o", str(tmp_path / "o"), "--synthesize", "2", "--greedy"])
    assert seen["cfg"].sampling.temperature == 0.0
    recipe = tmp_path / "r.yaml"
    # YAML reads 1e-4 as a string; the option names work as keys too (draft_tokens for k, prompts for prompt_sets)
    recipe.write_text("target: smollm2\neval:\n  draft_tokens: 6\n  prompts: [chat, code]\n  temperature: 1e-4\n")
    with click.Context(click.Command("x")):
        cfg = resolve_config(EvalConfig, "eval", str(recipe), {}, draft="d")
    assert (cfg.k, cfg.prompt_sets, cfg.temperature) == (6, ("chat", "code"), 1e-4)
    recipe.write_text("eval:\n  draft_tokens: 6.5\n")
    with click.Context(click.Command("x")), pytest.raises(click.ClickException,
                                                          match=rf"^{recipe}: eval: draft_tokens: 6.5 is not an int"):
        resolve_config(EvalConfig, "eval", str(recipe), {}, draft="d")


def test_a_resumed_capture_redoes_a_shard_whose_samples_changed(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT[:4])
    cfg = CaptureConfig(source=str(src), output=str(tmp_path / "fs"), shard_size=3, max_length=64,
                        codec="safetensors")
    first = run_capture(cfg, silent=True)
    assert [s["num_samples"] for s in first["shards"]] == [3, 1]
    write_jsonl(src, CHAT)  # the source grew (a --partial regen that has since finished)
    grown = run_capture(cfg, silent=True)
    assert [s["num_samples"] for s in grown["shards"]] == [3, 3]
    assert grown["shards"][0]["sha256"] == first["shards"][0]["sha256"]  # kept
    assert grown["counts"]["samples"] == len(CHAT)


def test_another_chat_template_is_refused(features, tmp_path):
    fs, manifest = copy_set(features, tmp_path)
    manifest["chat_template_sha256"] = "0" * 64
    (fs / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureSetError, match="chat template hash"):
        run_train(tiny_cfg(fs, tmp_path / "run"), silent=True)


def train_args(fs: Path, out: Path, *extra: str) -> list[str]:
    """sf-train run's arguments for tiny_cfg's run of `fs` into `out`."""
    return ["run", str(fs), "-o", str(out), "--draft-vocab-size", "256", "--ttt-length", "2", "--max-steps", "2",
            "--max-batch-tokens", "256", "--eval-fraction", "0", "--loss-kernel", "reference", "--silent", *extra]


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_shard_is_one_line_whether_checked_first_or_read_by_a_loader_worker(features, tmp_path, verify):
    """--verify-shards (the default) names it before the first step; without, the loader worker
    that opens it raises, and the training process still prints one line."""
    from specfoundry.train.cli import main

    fs, manifest = copy_set(features, tmp_path)
    victim = fs / manifest["shards"][1]["path"]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    flag = "--verify-shards" if verify else "--no-verify-shards"
    result = CliRunner().invoke(main, train_args(fs, tmp_path / "run", "--num-workers", "1", flag))
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    words = "is damaged or truncated" if verify else "is unreadable"
    assert len(errors) == 1 and f"{manifest['shards'][1]['path']} {words}" in errors[0], result.output
    assert not (tmp_path / "run" / "checkpoints").exists()  # no step was taken


def test_every_shard_is_checked_once_before_the_first_step_by_threads_not_workers(features, tmp_path, monkeypatch):
    """Each shard's checksum is read once a run, in the training process, before any batch: the
    loader's workers (made anew each epoch) no longer read the set again each."""
    from specfoundry.featureset.store import FeatureSet

    log = tmp_path / "checked.txt"  # a file: a loader worker's checks happen in its own process
    real = FeatureSet.check_shard

    def counted(self, shard):
        with open(log, "a") as f:
            f.write(f"{shard}\n")
        return real(self, shard)

    monkeypatch.setattr(FeatureSet, "check_shard", counted)
    trainer = Trainer(tiny_cfg(features, tmp_path / "run", max_steps=8, num_workers=1), silent=True)
    trainer.train()
    assert trainer.loader.state.epoch >= 2  # the worker was made anew for three epochs or more
    assert sorted(int(x) for x in log.read_text().split()) == [0, 1]


def test_a_damaged_shard_is_the_same_line_on_every_rank_without_a_hang(features, tmp_path):
    """Under torchrun each rank checks its share of the shards (rank 0: shard 0, rank 1: shard 1):
    the rank that finds the damage and the one that does not both stop with the same line."""
    import subprocess
    import sys

    from tests.conftest import free_port

    fs, manifest = copy_set(features, tmp_path)
    victim = fs / manifest["shards"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[-50] ^= 0xFF
    victim.write_bytes(bytes(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "specfoundry.train.cli", *train_args(fs, tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode != 0, done.stderr[-3000:]
    words = f"{manifest['shards'][1]['path']} is damaged or truncated"
    assert len(errors) == 2 and all(words in e for e in errors), done.stderr[-3000:]


@contextmanager
def deadline(seconds: int):
    """Fail a test that is still running after `seconds` (a hang), from the main thread."""
    def hung(*_):
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_training_split_without_a_batch_fails_at_once_naming_the_numbers(features, tmp_path):
    # 6 samples, 95% held out: none left to train on (before: sf-train looped over empty epochs forever)
    with deadline(60), pytest.raises(ValueError, match=r"the training split has no batch: feature set .* holds 6 "
                                                      r"samples, --eval-fraction 0.95 holds out 6, and the 0 samples "
                                                      r"make 0 batches of at most 256 tokens"):
        run_train(tiny_cfg(features, tmp_path / "run", eval_fraction=0.95), silent=True)
    assert not (tmp_path / "run" / "train_config.json").exists()


def test_a_loader_with_more_ranks_than_batches_refuses_at_once(tmp_path):
    from specfoundry.families.eagle3.shapes import SMOL_DRAFT
    from specfoundry.testing import write_random_featureset
    from specfoundry.train.loader import FeatureLoader

    fs = write_random_featureset(tmp_path / "fs", n=2, t=8, cfg=SMOL_DRAFT)
    loader = FeatureLoader(fs, [0, 1], max_tokens=64, seed=0, rank=1, world=4, num_workers=0)
    assert loader.batches_per_epoch() == 0
    with deadline(20), pytest.raises(ValueError, match=r"no batch for rank 1: 2 samples make 1 batches of at most 64 "
                                                       r"tokens, shared by 4 ranks"):
        next(iter(loader))


def test_a_run_folder_that_lost_its_record_says_what_is_missing_and_how_to_go_on(tmp_path):
    from specfoundry.common.shards import check_output_folder

    cfg = build_config(TrainConfig, {"featureset": "f", "output": str(tmp_path / "run")})
    step = tmp_path / "run" / "checkpoints" / "step-0000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    with pytest.raises(OutputFolderError, match=rf"^{tmp_path / 'run'} holds the checkpoints/ of an sf-train run but "
                                                r"not train_config.json, the record of its settings.*: restore "):
        check_output_folder(tmp_path / "run", "train", cfg)
    (step / "train_config.json").write_text("{}")
    with pytest.raises(OutputFolderError, match=rf": copy {step / 'train_config.json'} back to "
                                                rf"{tmp_path / 'run' / 'train_config.json'} and rerun the same command"):
        check_output_folder(tmp_path / "run", "train", cfg)  # before: "is not empty and holds no train run"


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_anything_is_recorded(features, tmp_path):
    # before: cut to the vocabulary's 49152 while train_config.json recorded 60000
    with pytest.raises(FeatureSetError, match=r"--draft-vocab-size 60000 is larger than the target's vocabulary "
                                              r"\(49152 tokens\)"):
        run_train(tiny_cfg(features, tmp_path / "run", draft_vocab_size=60000), silent=True)
    assert not (tmp_path / "run" / "train_config.json").exists()


@pytest.mark.parametrize("argv", [["sf-regen", "run", "SRC", "-o", "LINK"], ["sf-capture", "run", "SRC", "-o", "LINK"],
                                  ["sf-train", "run", "SRC", "-o", "LINK/run"]])
def test_an_output_that_is_a_symlink_to_nothing_is_named_as_such(tmp_path, chat_file, argv):
    from tests.test_cli_help import COMMANDS

    (tmp_path / "link").symlink_to(tmp_path / "gone")
    subs = {"SRC": str(chat_file), "LINK": str(tmp_path / "link"), "LINK/run": str(tmp_path / "link" / "run")}
    result = CliRunner().invoke(COMMANDS[argv[0]], [subs.get(a, a) for a in argv[1:]])
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    # before: "File exists: PATH"
    assert errors == [f"Error: {tmp_path / 'link'} is a symlink to {tmp_path / 'gone'}, which does not exist: create "
                      "that folder, or choose another output"], result.output


def test_specfoundry_cache_empty_is_unset_and_a_file_is_named(tmp_path, monkeypatch, chat_file):
    from specfoundry.capture.cli import main
    from specfoundry.common.embedded import TargetError, cache_root

    monkeypatch.setenv("SPECFOUNDRY_CACHE", "")  # before: the working directory, where a 517 MB model went
    assert cache_root() == Path.home() / ".cache" / "specfoundry"
    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("SPECFOUNDRY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(TargetError, match="is a file, not a folder for converted models"):
        cache_root()
    result = CliRunner().invoke(main, ["run", str(chat_file), "-o", str(tmp_path / "fs")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: SPECFOUNDRY_CACHE={tmp_path / 'cache'} is a file, not a folder for converted models: "
                      "point it at a folder, or unset it for ~/.cache/specfoundry"]  # before: "File exists: PATH"


@pytest.mark.parametrize("argv", [["sf-regen", "run", "SRC", "-o", "OUT"], ["sf-capture", "run", "SRC", "-o", "OUT"],
                                  ["sf-train", "run", "SRC", "-o", "OUT"], ["sf-eval", "run", "SRC", "-o", "OUT"],
                                  ["sf-eval", "gate", "-o", "OUT"]])
def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path, chat_file, argv):
    from specfoundry.common.shards import output_lock
    from tests.test_cli_help import COMMANDS

    out = tmp_path / "out"
    stage = {"sf-regen": "regen", "sf-capture": "capture", "sf-train": "train", "sf-eval": "eval"}[argv[0]]
    stage = "gate" if argv[1] == "gate" else stage
    with output_lock(out, stage):  # the first run, still going (before: the second went on beside it)
        result = CliRunner().invoke(COMMANDS[argv[0]], [{"SRC": str(chat_file), "OUT": str(out)}.get(a, a)
                                                        for a in argv[1:]])
        assert result.exit_code == 2, (result.output, result.exception)
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert errors == [f"Error: {out}: another sf-{stage} run is writing into this folder (it holds {out / '.lock'}); "
                          "wait for it to end, or choose another folder"], result.output
    assert not out.exists()  # the first run wrote nothing: its lock leaves nothing behind


def test_the_lock_of_a_killed_run_never_blocks_a_rerun(tmp_path):
    import subprocess
    import sys

    from specfoundry.common.shards import OutputFolderError, output_lock

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom specfoundry.common.shards import output_lock\n"
                               f"with output_lock({str(out)!r}, 'regen'):\n"
                               "    (__import__('pathlib').Path(sys.argv[1]) / 'shard').write_text('x')\n"
                               "    print('held', flush=True)\n"
                               "    time.sleep(120)\n", str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputFolderError, match="another sf-regen run is writing into this folder"):
            with output_lock(out, "regen"):
                pass
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, its .lock file stays
        holder.wait()
    assert (out / ".lock").is_file()
    with output_lock(out, "regen"):  # the rerun takes the folder over
        assert (out / "shard").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["shard"]  # and leaves no lock file behind


def test_an_edited_manifest_is_caught_by_verify_and_refused_by_readers(features, tmp_path):
    """issue 37 item 4: aux_layer_ids changed by hand in manifest.json passed sf-capture verify (the
    capture's own record still said otherwise), and sf-train trained on it and exported layer ids the
    features do not come from. Also a shard's sample lengths edited in the manifest."""
    from specfoundry.capture.verify import verify_featureset
    from specfoundry.featureset.store import FeatureSet

    fs, manifest = copy_set(features, tmp_path)
    real = manifest["aux_layer_ids"]
    manifest["aux_layer_ids"] = [i + 1 for i in real]  # as many layers, other ids: every width still fits
    (fs / MANIFEST).write_text(json.dumps(manifest))
    problems = verify_featureset(fs)
    assert any(f"aux_layer_ids {manifest['aux_layer_ids']}" in p and str(real) in p for p in problems), problems
    with pytest.raises(FeatureSetError, match=r"aux_layer_ids .* disagrees with"):
        FeatureSet(fs)
    with pytest.raises(FeatureSetError, match=r"aux_layer_ids .* disagrees with"):
        run_train(tiny_cfg(fs, tmp_path / "run"), silent=True)
    manifest["aux_layer_ids"] = real
    lengths = manifest["shards"][0]["sample_lengths"]
    assert lengths[0] != lengths[1]
    manifest["shards"][0]["sample_lengths"] = [lengths[1], lengths[0], *lengths[2:]]  # same total, other samples
    (fs / MANIFEST).write_text(json.dumps(manifest))
    assert any("sample lengths" in p for p in verify_featureset(fs)), verify_featureset(fs)


def swapped_lengths(m):
    lengths = m["shards"][0]["sample_lengths"]
    m["shards"][0]["sample_lengths"] = [lengths[1], lengths[0], *lengths[2:]]


def one_sample_fewer(m):  # a record edited to agree with itself and with the set's counts
    entry = m["shards"][0]
    dropped = entry["sample_lengths"].pop()
    entry["num_samples"] -= 1
    entry["num_tokens"] -= dropped
    m["counts"]["samples"] -= 1
    m["counts"]["tokens"] -= dropped


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["shards"][0].update(num_samples=m["shards"][0]["num_samples"] + 1), "records 4 samples, 3 sample"),
    (lambda m: m["shards"][0].update(num_samples=str(m["shards"][0]["num_samples"])), "are not whole numbers"),
    (lambda m: m["shards"].pop(), "counts samples=6, its shard records hold 3"),
    (lambda m: m["shards"][0].update(sample_lengths=[200, *m["shards"][0]["sample_lengths"][1:]]), "summing to"),
    (swapped_lengths, "its samples' lengths is not what manifest.json records"),
    (one_sample_fewer, "its samples' lengths is not what manifest.json records"),
    (lambda m: m.update(hidden_size=m["hidden_size"] - 64), "its aux_hidden, final_hidden shape or dtype is not"),
    (lambda m: m.update(hidden_size=None), "cannot be read as manifest.json describes it (TypeError"),
])
def test_sf_train_refuses_a_hand_edited_manifest_in_one_line(features, tmp_path, edit, words):
    """A manifest edited by hand crashed sf-train (an IndexError or a TypeError traceback) or trained on
    what sf-capture verify calls damaged: shards dropped, counts and lengths changed, hidden_size.
    sf-train now refuses each in one line naming the manifest, before its first step (the records
    among themselves when the set opens, each shard against its record in the run's checksum pass),
    and sf-capture verify finds each too."""
    from specfoundry.capture.verify import verify_featureset
    from specfoundry.train.cli import main as train_main

    fs, manifest = copy_set(features, tmp_path)
    assert manifest["counts"]["samples"] == 6 and [e["num_samples"] for e in manifest["shards"]] == [3, 3]
    edit(manifest)
    (fs / MANIFEST).write_text(json.dumps(manifest))
    assert verify_featureset(fs)
    result = CliRunner().invoke(train_main, ["run", str(fs), "-o", str(tmp_path / "run"), "--max-steps", "2",
                                             "--num-workers", "0", "--eval-fraction", "0", "--silent"])
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in result.output and len(errors) == 1, result.output
    assert errors[0].startswith(f"Error: {fs}") and words in errors[0], result.output
    assert not (tmp_path / "run" / "export").exists()


def test_an_input_folder_spelled_relative_or_absolute_is_the_same_setting(features, tmp_path, monkeypatch):
    """A rerun that names the feature set relative to another directory, or absolute, resumes;
    so does a run whose record holds the path relative (recorded before paths were made
    absolute); another folder is still another setting."""
    from specfoundry.common.shards import check_output_folder, record_config

    out = tmp_path / "run"
    monkeypatch.chdir(features.parent)
    first = tiny_cfg(features.name, out)
    assert first.featureset == str(features.resolve())  # recorded absolute
    out.mkdir()
    record_config(out, "train", first)
    monkeypatch.chdir(tmp_path)
    check_output_folder(out, "train", tiny_cfg(features, out))  # absolute, from elsewhere: the same
    record = json.loads((out / "train_config.json").read_text())
    (out / "train_config.json").write_text(json.dumps({**record, "featureset": features.name}))
    monkeypatch.chdir(features.parent)
    check_output_folder(out, "train", tiny_cfg(features.name, out))  # an older record's relative path
    with pytest.raises(OutputFolderError, match="featureset"):
        check_output_folder(out, "train", tiny_cfg(tmp_path / "other", out))


def test_a_local_target_spelled_relative_or_absolute_is_the_same_setting(features, tmp_path, monkeypatch):
    """--target naming a local model directory is recorded absolute as the input folders are (a
    record holding it relative is read from the current directory); an embedded name stays a name."""
    from specfoundry.common.shards import check_output_folder, record_config

    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    out = tmp_path / "run"
    monkeypatch.chdir(model.parent)
    first = tiny_cfg(features, out, target="mine")
    assert first.target == str(model.resolve())
    assert tiny_cfg(features, out, target="smollm2").target == "smollm2"
    out.mkdir()
    record_config(out, "train", first)
    monkeypatch.chdir(tmp_path)
    check_output_folder(out, "train", tiny_cfg(features, out, target="models/mine"))
    record = json.loads((out / "train_config.json").read_text())
    (out / "train_config.json").write_text(json.dumps({**record, "target": "mine"}))
    monkeypatch.chdir(model.parent)
    check_output_folder(out, "train", tiny_cfg(features, out, target="mine"))  # an older record's relative one
    with pytest.raises(OutputFolderError, match="target"):
        check_output_folder(out, "train", tiny_cfg(features, out, target="smollm2"))


def test_files_written_whole_get_the_permissions_open_gives_not_mkstemps(tmp_path):
    """An export's weights and records are read by a serving engine that may run as another
    user: they get 0666 less the umask, as any file open() makes, not mkstemp's owner-only 0600."""
    from specfoundry.common.files import UMASK, atomic_write_json

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_json(tmp_path / "record.json", {"a": 1})
    mode = (tmp_path / "record.json").stat().st_mode & 0o777
    assert mode == 0o666 & ~UMASK == plain.stat().st_mode & 0o777, oct(mode)


def test_an_exports_files_get_the_permissions_open_gives(features, tmp_path):
    """safetensors writes its files owner-only (0600); a folder written whole (an export, a
    checkpoint) is given open()'s permissions before it is renamed into place."""
    from specfoundry.common.files import UMASK

    run_train(tiny_cfg(features, tmp_path / "run"), silent=True)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"]
    assert (tmp_path / "run" / "export" / "model.safetensors") in files
    wrong = [f"{p.relative_to(tmp_path)} {oct(p.stat().st_mode & 0o777)}" for p in files
             if p.stat().st_mode & 0o777 != 0o666 & ~UMASK]
    assert not wrong, wrong


def test_a_training_that_learnt_nothing_is_an_error_and_exports_nothing(features, tmp_path):
    """issue 61 item 1: with --max-length 1 no micro-batch holds a position to train (every one is
    skipped, every loss 0): sf-train ended "trained N steps; exported", exit 0. Now one line, exit 2,
    no export and no checkpoint; a run where most micro-batches were skipped says so in its last line."""
    from click.testing import CliRunner

    from specfoundry.train.cli import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(features), "-o", str(out), "--max-length", "1", "--max-steps", "2",
                                       "--draft-vocab-size", "256", "--eval-fraction", "0", "--num-workers", "0",
                                       "--loss-kernel", "reference", "--save-every", "1", "--silent"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "every one of the run's 2 micro-batches had no position to train" in errors[0], errors
    assert not (out / "export").exists()
    # its checkpoints hold the draft as it began: sf-eval once offered the newest as the draft to evaluate
    assert not (out / "checkpoints").exists() and "checkpoints, the draft as it began, removed" in errors[0]
    from specfoundry.train.trainer import skipped_report

    assert skipped_report(0, 8) is None and skipped_report(4, 8) is None
    assert skipped_report(5, 8).startswith("5 of 8 micro-batches had no position to train")


def test_a_resumed_run_counts_each_ranks_own_skips(features, tmp_path):
    """The nothing-learnt check sums every rank's skipped micro-batches: a resume gave every rank the
    main rank's count from the history, so a run in which rank 0 skipped all and rank 1 learnt would,
    resumed, have counted everything skipped and removed a trained run's checkpoints. Each rank's own
    count now travels in the checkpoint beside its loader state (gathered from every rank)."""
    from specfoundry.train.trainer import Trainer

    first = Trainer(tiny_cfg(features, tmp_path / "run", max_steps=2), silent=True).build()
    first.resume()
    first.train_step([next(iter(first.loader))])
    first.skipped = 3  # as if this rank had skipped three micro-batches
    first.checkpoint()
    (state,) = json.loads((tmp_path / "run" / "checkpoints" / "step-0000001" / "trainer_state.json").read_text())[
        "loader"]
    assert state["skipped_micro_batches"] == 3
    second = Trainer(tiny_cfg(features, tmp_path / "run", max_steps=2), silent=True).build()
    second.resume()
    assert (second.step, second.skipped) == (1, 3)


@pytest.mark.parametrize("how", ["target alone", "chain", "tree", "block"])
def test_non_finite_target_logits_stop_the_decode_naming_where(how):
    """issue 61 item 5: a target whose logits are NaN made an untrained draft look perfect (sf-eval
    reported acceptance 5.00 and a 1.6x speedup: the argmax of NaN logits is token 0 on both sides).
    Every decode now refuses non-finite logits at the prefill, and sf-eval names the prompt."""
    from specfoundry.common.target import Target
    from specfoundry.decoding.rounds import NonFiniteLogitsError, target_generate
    from specfoundry.decoding.sampler import Sampler
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.eval.evaluate import EvalConfig, decode_set
    from specfoundry.eval.prompts import EvalError
    from specfoundry.families.dflash.block import BlockDraftRunner, block_generate
    from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
    from specfoundry.families.eagle3.tree import tree_generate
    from tests.test_dflash import TINY, random_draft
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair()
    with torch.no_grad():
        model.lm_head.weight[2, 0] = float("nan")  # one NaN weight: every row's logit of token 2 is NaN
    target = TargetRunner(Target.wrap(model), [0, 1, 2])
    prompt = [1, 2, 3]
    decode = {
        "target alone": lambda: target_generate(target, prompt, max_new_tokens=8, eos=set(), sampler=Sampler()),
        "chain": lambda: speculative_generate(target, DraftRunner(draft), prompt, k=3, max_new_tokens=8, eos=set(),
                                              sampler=Sampler()),
        "tree": lambda: tree_generate(target, DraftRunner(draft), prompt, branching=(2, 1), max_new_tokens=8,
                                      eos=set()),
        "block": lambda: block_generate(target, BlockDraftRunner(random_draft().eval(),
                                                                 torch.randn(TINY.vocab_size, TINY.hidden_size)),
                                        prompt, max_new_tokens=8, eos=set(), sampler=Sampler()),
    }[how]
    with pytest.raises(NonFiniteLogitsError, match="not finite at the prompt's prefill"):
        decode()
    if how == "target alone":
        with pytest.raises(EvalError, match=r"^chat: target alone, prompt p7: the target's logits are not finite"):
            decode_set(target, None, [("p7", prompt)], EvalConfig(draft="d", max_new_tokens=8), set(),
                       "chat: target alone", silent=True)


@pytest.mark.parametrize("damage", ["missing", "truncated", "zeroed", "replaced"])
def test_a_damaged_token_count_file_is_named_by_verify_and_refused_by_sf_train(features, tmp_path, damage):
    """issue 61 item 8: token_counts.safetensors had no checksum: `sf-capture verify` passed a missing,
    truncated, zeroed or replaced file, and sf-train then tracebacked, misreported the vocabulary or
    picked a draft vocabulary from wrong counts. The manifest now records its checksum: verify names
    the file, sf-train refuses it in one line."""
    from safetensors.torch import save_file

    from specfoundry.capture.verify import verify_featureset

    fs, _ = copy_set(features, tmp_path)
    assert verify_featureset(fs) == []
    counts = fs / "token_counts.safetensors"
    if damage == "missing":
        counts.unlink()
    elif damage == "truncated":
        counts.write_bytes(counts.read_bytes()[:-100])
    elif damage == "zeroed":
        counts.write_bytes(bytes(len(counts.read_bytes())))
    else:  # a sound file of other counts: the same vocabulary, every token seen once
        vocab = json.loads((fs / MANIFEST).read_text())["target"]["vocab_size"]
        save_file({"counts": torch.ones(vocab, dtype=torch.int64)}, str(counts))
    problems = verify_featureset(fs)
    assert len(problems) == 1 and str(counts) in problems[0], problems
    assert ("missing" if damage == "missing" else "checksum mismatch") in problems[0]
    with pytest.raises(FeatureSetError, match=r"token_counts\.safetensors: (missing|checksum mismatch)"):
        run_train(tiny_cfg(fs, tmp_path / "run", max_steps=1), silent=True)
    assert not (tmp_path / "run" / "export").exists()


def test_a_users_step_backup_folder_is_no_checkpoint_and_a_damaged_trainer_state_is_named(features, tmp_path):
    """issue 61 item 11: a folder named `step-backup` under checkpoints/ made every rerun fail with
    "invalid literal for int()", and a trainer_state.json that is not JSON was reported without its
    path."""
    out = tmp_path / "run"
    run_train(tiny_cfg(features, out, max_steps=2, save_every=1, keep_last=5), silent=True)
    backup = out / "checkpoints" / "step-backup"
    shutil.copytree(out / "checkpoints" / "step-0000001", backup)
    result = run_train(tiny_cfg(features, out, max_steps=2, save_every=1, keep_last=5), silent=True)
    assert result["steps"] == 2 and backup.is_dir()  # left as it was: not a checkpoint of the run
    state = out / "checkpoints" / "step-0000002" / "trainer_state.json"
    state.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(state))}: not JSON .*remove .*step-0000002 to resume"):
        run_train(tiny_cfg(features, out, max_steps=2, save_every=1, keep_last=5), silent=True)


def test_a_recipe_giving_both_of_two_settings_that_decide_one_thing_is_refused(tmp_path):
    """issue 61 item 12: `epochs` and `max_steps` together in a recipe (epochs silently replaced
    max_steps), as `--max-steps` with `--epochs` on the command line already is; the same for the
    other pairs a command decides together (a source and --synthesize, a chain and a tree, layers and
    families). The command line's one still overrides the recipe's pair."""
    from click.testing import CliRunner

    from specfoundry.train.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: smollm2\ntrain:\n  max_steps: 5\n  epochs: 2\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "fs"), "-o", str(tmp_path / "out"), "--recipe",
                                       str(recipe)])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"{recipe}: train: max_steps and epochs both decide one thing" in errors[0], errors
    from specfoundry.common.cli import resolve_config
    from specfoundry.train.trainer import TrainConfig

    cfg = resolve_config(TrainConfig, "train", str(recipe), {"featureset": "fs", "output": "o", "max_steps": 3})
    assert cfg.max_steps == 3 and cfg.epochs is None  # (outside a command every option counts as given)


def test_a_prompt_set_or_a_mode_named_twice_is_refused():
    """issue 61 item 12: duplicate prompt sets or modes were decoded twice and reported once."""
    from specfoundry.eval.evaluate import EvalConfig

    with pytest.raises(ValueError, match="^--prompts names chat twice$"):
        EvalConfig(draft="d", prompt_sets=("chat", "code", "chat"))
    with pytest.raises(ValueError, match="^--modes names the mode enable_thinking=false twice$"):
        EvalConfig(draft="d", modes=({"enable_thinking": False}, {}, {"enable_thinking": False}))
    EvalConfig(draft="d", prompt_sets=("chat", "code"), modes=({}, {"enable_thinking": True}))


def test_greedy_with_a_temperature_is_refused(tmp_path):
    """issue 61 item 12: sf-regen --greedy --temperature 0.7 ran greedily, the temperature dropped unsaid."""
    from click.testing import CliRunner

    from specfoundry.generate.cli import main

    result = CliRunner().invoke(main, ["run", "--synthesize", "2", "-o", str(tmp_path / "o"), "--greedy",
                                       "--temperature", "0.7"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and errors == ["Error: --greedy is --temperature 0: give one of them"], result.output


@pytest.mark.parametrize("edit, words", [({"hidden_act": "relu"}, "hidden_act is 'relu'"),
                                         ({"hidden_act": "nonsense"}, "hidden_act is 'nonsense'"),
                                         ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a positive"),
                                         ({"rope_theta": -1.0}, "rope_theta is -1.0, not a positive")])
def test_an_edited_export_config_is_refused_where_the_drafts_math_reads_it(features, tmp_path, edit, words):
    """issue 61 item 6: hidden_act set to "relu" or nonsense was written through by sf-export and
    ignored by sf-eval (the SwiGLU is fixed), so the draft measured was not the one served; an
    rms_norm_eps of NaN was exported as NaN (invalid JSON for strict readers)."""
    from specfoundry.families.folders import locate_draft

    out = tmp_path / "run"
    run_train(tiny_cfg(features, out, max_steps=1), silent=True)
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    config.update(edit)
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError, match=re.escape(words)):
        locate_draft(str(export))


def test_a_target_folder_without_its_tokenizer_is_one_line(tmp_path, tiny_llama_dir):
    """issue 61 item 10: a target folder without tokenizer files raised transformers' traceback
    ("Couldn't instantiate the backend tokenizer ..."), after loading the weights."""
    from specfoundry.common.target import TOKENIZER_FILES, TargetError, load_tokenizer

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama_dir, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES, "special_tokens_map.json",
                                                                       "merges.txt"))
    with pytest.raises(TargetError, match=rf"{bare}: no tokenizer \(tokenizer.json, .*copy them from its repository"):
        load_tokenizer(bare)


def test_a_target_without_its_tokenizer_is_refused_before_its_weights_load(tmp_path, tiny_llama_dir, monkeypatch):
    """Target.load reads the tokenizer first: a missing one is the line above, not minutes of a large
    target's weights later."""
    import transformers

    from specfoundry.common.target import TOKENIZER_FILES, Target, TargetError

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama_dir, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES, "special_tokens_map.json",
                                                                       "merges.txt"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the tokenizer was checked"))
    with pytest.raises(TargetError, match="no tokenizer"):
        Target.load(str(bare), device="cpu")


@pytest.mark.parametrize("modes", [["not", "a", "mapping"], {"not JSON": 3}, {'{"chat_template_kwargs": 1}': 2}, "text"])
def test_a_training_records_malformed_modes_are_one_line(tmp_path, modes):
    """issue 61 item 10: a specfoundry_training.json whose 'modes' was hand-edited into another shape
    raised a traceback in sf-eval; it is one line naming the draft and what to pass instead."""
    from specfoundry.eval.prompts import EvalError, eval_modes
    from specfoundry.families.folders import TRAINING_FILE

    export = tmp_path / "export"
    export.mkdir()
    (export / TRAINING_FILE).write_text(json.dumps({"modes": modes}))

    class Ref:  # what eval_modes reads of a located draft: its folder (training_record's way in)
        path, prefix = export, ""

    with pytest.raises(EvalError, match=rf"{export}: the training record's 'modes' is not \{{mode JSON: samples\}}"):
        eval_modes((), None, Ref())


def test_the_gate_names_an_export_of_another_draft_vocabulary(features, tmp_path):
    """issue 61 item 10: `sf-eval gate --export` of a draft whose vocabulary differs from the gate's
    run raised a shape traceback in the checks; it is the export check's failure, naming both sizes."""
    from specfoundry.gate import GateConfig, run_checks

    out = tmp_path / "run"
    run_train(tiny_cfg(features, out), silent=True)  # a draft vocabulary of 256
    (check,) = run_checks(GateConfig(output=str(tmp_path / "gate")), out / "export")
    assert not check.ok and check.name == "export"
    assert "has a draft vocabulary of 256 tokens, the gate's run 1024: pass --draft-vocab-size 256" in check.detail


def test_a_full_disk_in_the_embedded_targets_conversion_is_one_line(tmp_path, monkeypatch):
    """issue 61 item 10: the one-time conversion of the embedded GGUF ran out of space with
    safetensors' traceback; it is one line naming the cache folder and SPECFOUNDRY_CACHE, and the
    partial folder is removed. (The disk is full where safetensors writes: its own error type.)"""
    from safetensors import SafetensorError

    from specfoundry.common import embedded

    def full_disk(gguf_path, tmp, name, package):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })")

    monkeypatch.setattr(embedded, "write_converted", full_disk)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    with pytest.raises(embedded.TargetError, match=r"cache/M: no space left on the disk .*SPECFOUNDRY_CACHE"):
        embedded.convert_gguf(gguf, tmp_path / "cache" / "M")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["M.lock"]
