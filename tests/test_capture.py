"""sf-capture on SmolLM2: features equal a plain forward, resume, verify, target mismatch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specfoundry.capture.cli import main as capture_cli
from specfoundry.capture.runner import HFCaptureRunner
from specfoundry.capture.stage import CaptureConfig, auto_shard_size, run_capture
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import Target
from specfoundry.featureset.manifest import FeatureSetError, check_matches_target
from specfoundry.featureset.store import FeatureSet
from specfoundry.testing import assert_close_scaled
from tests.conftest import CHAT, copies, free_port, run_command, write_jsonl


@pytest.fixture
def target(smollm2_target):
    return smollm2_target


def row_close(x: torch.Tensor, ref: torch.Tensor) -> None:
    """x equals ref up to fp32 rounding of a differently blocked computation, relative to each row's
    scale. A padded batch and a lone sample run the same layers through GEMMs of other shapes, so
    each dot product (K <= 1536 terms) sums in another order: about sqrt(K) * eps = 39 * 1.2e-7 =
    5e-6 of the row's scale per layer, over 30 layers about sqrt(30) times that, 3e-5. SmolLM2's rows
    hold massive activations (|x| ~ 2e4 beside entries near 0), so an element's error follows its
    row's largest entry, not its own size: a per-element rtol fails on small entries on one machine's
    BLAS and passes on another's. 1e-4 of the row's scale is 3x the estimate (measured here: 6e-7
    for the aux layers, 2e-6 for the normed final state); leaked padding moves a row by O(1) of it."""
    assert_close_scaled(x, ref, 1e-4, rows=True)


def test_hooked_features_equal_output_hidden_states_with_mixed_lengths(target):
    model, tok = target.model, target.tokenizer
    runner = HFCaptureRunner(target, [1, 14, 26])
    texts = ["Hello there, how are you today?", "Hi", "A somewhat longer sentence about the weather in Paris."]
    batch = [tok(t)["input_ids"] for t in texts]
    captured = runner(batch)  # one padded batch
    for ids, features in zip(batch, captured, strict=True):
        aux, final = features["aux_hidden"], features["final_hidden"]
        assert aux.is_contiguous() and final.is_contiguous()  # the writers stream them without a copy
        with torch.no_grad():  # each sample alone: no padding at all
            out = model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, layer0 out, ..., layer29 out (normed)]
        for layer, got in zip((1, 14, 26), aux.split(hs[0].shape[-1], dim=-1), strict=True):
            row_close(got, hs[layer + 1][0])  # fp32, padding must not leak (each layer's rows at their scale)
        # transformers' last hidden state is the normed one: the lm_head input
        row_close(final, hs[-1][0])
        row_close(final @ model.lm_head.weight.T, out.logits[0])


@pytest.mark.gpu
@pytest.mark.parametrize("storage", [None, ("float8_e4m3fn", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn")])
def test_pipelined_gpu_capture_equals_each_sample_alone(storage):
    """capture_all copies batch i out on a side stream while batch i+1 computes, into pinned
    buffers that the caching host allocator recycles: every sample's features must still be its
    own after later batches ran (fp32, so exact up to kernel differences between batch shapes).
    With float8 storage the runner quantises on the GPU and one packed buffer carries values and
    scales: decoded, they are within float8's bound of each sample alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specfoundry.featureset import fp8
    from specfoundry.featureset.store import decode_state

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).cuda().eval()
    runner = HFCaptureRunner(Target.wrap(model), [1, 2, 4], storage=storage)
    g = torch.Generator().manual_seed(1)
    lengths = [[300, 17, 128], [5], [511, 64], [90, 90, 3, 250], [1000]]  # five batches, odd widths
    batches = [[torch.randint(0, 1000, (n,), generator=g).tolist() for n in b] for b in lengths]
    results = list(runner.capture_all(batches))
    assert [[f["aux_hidden"].shape[0] for f in r] for r in results] == lengths
    for batch, result in zip(batches, results, strict=True):
        for ids, features in zip(batch, result, strict=True):
            assert all(t.is_pinned() for t in features.values())
            with torch.no_grad():
                hs = model(torch.tensor([ids], device="cuda"), output_hidden_states=True).hidden_states
            refs = {"aux": torch.cat([hs[i + 1][0] for i in (1, 2, 4)], dim=-1).cpu(), "final": hs[-1][0].cpu()}
            for state, ref in refs.items():
                got = decode_state(features[f"{state}_hidden"], features.get(f"{state}_scale"), torch.float32)
                if storage is None:
                    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
                    continue
                if features.get(f"{state}_scale") is None:  # bf16: one rounding from the fp32 features
                    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2**-8)
                    continue
                rows, back = ref.unflatten(-1, (-1, 256)), got.unflatten(-1, (-1, 256))  # [T, L, H]
                scale = rows.abs().amax(-1, keepdim=True) / fp8.E4M3_MAX
                # float8's bound, loosened by the kernel differences between batch shapes (2e-4 above),
                # which also move the scale a little
                limit = fp8.RELATIVE_ERROR * rows.abs() + 1.01 * fp8.SUBNORMAL_ERROR * scale + 5e-4
                assert ((back - rows).abs() <= limit).all()


@pytest.mark.parametrize("codec", ["zarr", "safetensors"])
def test_capture_roundtrip_within_bf16_rounding(tmp_path, chat_file, target, codec):
    cfg = CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), shard_size=4, codec=codec)
    manifest = run_capture(cfg, silent=True)
    assert manifest["complete"] and manifest["counts"]["samples"] == len(CHAT)
    fs = FeatureSet(tmp_path / "fs")
    runner = HFCaptureRunner(target, manifest["aux_layer_ids"])
    for i in (0, 1, 5):
        s = fs[i]
        fresh = runner([s.input_ids.tolist()])[0]
        aux, final = fresh["aux_hidden"], fresh["final_hidden"]
        # stored as bf16: one rounding step (2^-8 relative) from the fp32 features
        torch.testing.assert_close(s.aux_hidden.float(), aux, atol=1e-2, rtol=2 ** -8)
        torch.testing.assert_close(s.final_hidden.float(), final, atol=1e-2, rtol=2 ** -8)
    counts = fs.token_counts()
    assert counts.sum().item() == manifest["counts"]["loss_tokens"] > 0
    assert verify_featureset(tmp_path / "fs") == []


def test_a_finished_capture_rerun_placed_otherwise_keeps_the_sets_identity(tmp_path, chat_file, smollm2_target):
    """Placement is not a setting of the output: rerunning a finished capture with another --device
    and writer count rewrites its manifest, whose hash sf-train's resume compares with its
    checkpoint's, so that hash must not move (it did: the manifest copied the device)."""
    from specfoundry.featureset.manifest import manifest_sha256

    cfg = CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), shard_size=4, device="cpu", writers=1)
    run_capture(cfg, silent=True, target=smollm2_target)
    before = manifest_sha256(tmp_path / "fs")
    run_capture(replace(cfg, device=None, writers=2), silent=True, target=smollm2_target)
    assert json.loads((tmp_path / "fs" / "capture_config.json").read_text())["device"] is None  # the run's own record
    assert manifest_sha256(tmp_path / "fs") == before


# the default run keeps tests/test_faults.py's SIGKILL-and-rerun of sf-capture
@pytest.mark.slow
def test_kill_and_resume_gives_identical_checksums(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", copies(CHAT, 2))
    args = [sys.executable, "-m", "specfoundry.capture.cli", "run", str(src), "--shard-size", "2", "--silent"]
    subprocess.run(args + ["-o", str(tmp_path / "whole")], check=True, capture_output=True)
    killed = tmp_path / "killed"
    # SIGKILLed just after its second done mark is in place (tests/faults.py: at that moment, not
    # whenever a polling loop gets the CPU, which could be after the last shard)
    fault = [str(Path(__file__).parent / "faults.py"), "--kill-at", "after-rename", "--match", "*/shards/*.done.json",
             "--nth", "2", "--"]
    # one writer thread: with several, a third mark could land between the kill's announcement and the signal
    run = subprocess.run([sys.executable, *fault, *args[2:], "--writers", "1", "-o", str(killed)], capture_output=True,
                         text=True)
    assert run.returncode == -signal.SIGKILL and "faults: killed at" in run.stderr, run.stderr[-2000:]
    assert len(list((killed / "shards").glob("*.done.json"))) == 2
    subprocess.run(args + ["-o", str(killed)], check=True, capture_output=True)
    a = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    b = json.loads((killed / "manifest.json").read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert len(a["shards"]) == 6
    assert (tmp_path / "whole" / "token_counts.safetensors").read_bytes() == (killed / "token_counts.safetensors").read_bytes()


def test_two_processes_write_the_same_feature_set_as_one(tmp_path):
    """torchrun, 2 CPU processes (gloo): rank r captures shards r, r+2, ... into one folder and
    rank 0 lists them after a barrier. Shard contents do not depend on who wrote them, so the
    manifest's shards and the token counts equal a single process's byte for byte. (The single
    process is this one, through the command, one thread as each rank: no interpreter to start.)"""
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    args = ["run", str(src), "--shard-size", "2", "--codec", "safetensors"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run_command(capture_cli, [*args, "-o", tmp_path / "one"])
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "specfoundry.capture.cli", *args, "--silent", "-o",
                          str(tmp_path / "two")],
                         capture_output=True, text=True, env=env)
    assert two.returncode == 0, two.stderr[-2000:]
    a = json.loads((tmp_path / "one" / "manifest.json").read_text())
    b = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert b["complete"] and len(b["shards"]) == 3 and a["counts"] == b["counts"]
    assert [(s["path"], s["sha256"]) for s in a["shards"]] == [(s["path"], s["sha256"]) for s in b["shards"]]
    one_counts = (tmp_path / "one" / "token_counts.safetensors").read_bytes()
    assert one_counts == (tmp_path / "two" / "token_counts.safetensors").read_bytes()
    assert verify_featureset(tmp_path / "two") == []


def test_verify_names_a_damaged_shard(tmp_path, chat_file):
    run_capture(CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), shard_size=2,
                              codec="safetensors"), silent=True)
    victim = tmp_path / "fs" / "shards" / "shard-000001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = CliRunner().invoke(capture_cli, ["verify", str(tmp_path / "fs")])
    assert result.exit_code != 0
    assert "shards/shard-000001.safetensors: checksum mismatch" in result.output
    victim.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    assert "shard-000001" in verify_featureset(tmp_path / "fs")[0]


def test_verify_names_nonfinite_states_in_several_shards_in_the_manifests_order(tmp_path, chat_file, monkeypatch):
    """The shards are checked on threads; the problems still come in the manifest's order, each at
    its sample, token and layer, whichever shard finishes first (one thread or several)."""
    import specfoundry.capture.verify as verify
    from specfoundry.featureset.manifest import MANIFEST
    from specfoundry.featureset.store import ShardReader, write_shard

    run_capture(CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), shard_size=2,
                              codec="safetensors"), silent=True)
    fs = tmp_path / "fs"
    manifest = json.loads((fs / MANIFEST).read_text())
    assert len(manifest["shards"]) >= 3 and manifest["storage_dtype"] == "bfloat16"
    want = []
    for shard, (sample, token, column, state) in ((2, (1, 3, 1, "aux")), (0, (0, 5, 0, "final"))):
        entry = manifest["shards"][shard]
        reader = ShardReader(fs / entry["path"], "safetensors", "bfloat16")
        rows = [reader.sample(i, decode=False) for i in range(len(reader))]
        rows = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask, "aux_hidden": r.aux_hidden.clone(),
                 "final_hidden": r.final_hidden.clone()} for r in rows]
        rows[sample][f"{state}_hidden"][token, column * manifest["hidden_size"] + 7] = float("inf")
        entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", "bfloat16")
        layer = f"layer {manifest['aux_layer_ids'][column]}" if state == "aux" else "final state"
        want.append((shard, f"{entry['path']}: {state}_hidden holds NaN or Inf at sample {sample}, token {token}, "
                            f"{layer}"))
    (fs / MANIFEST).write_text(json.dumps(manifest))
    want = [line for _, line in sorted(want)]
    for threads in (1, 4):
        monkeypatch.setattr(verify, "THREADS", threads)
        assert verify_featureset(fs) == want


def test_verify_shows_a_bar_over_the_shards_unless_silent(tmp_path, chat_file):
    run_capture(CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), shard_size=2,
                              codec="safetensors"), silent=True)
    loud = CliRunner().invoke(capture_cli, ["verify", str(tmp_path / "fs")])
    quiet = CliRunner().invoke(capture_cli, ["verify", str(tmp_path / "fs"), "--silent"])
    assert loud.exit_code == quiet.exit_code == 0, (loud.output, quiet.output)
    assert "sf-capture verify" in loud.output and "shard" in loud.output
    assert "sf-capture verify" not in quiet.output and quiet.output.strip().endswith(": ok")


def test_mismatching_target_is_refused_with_the_reason(tmp_path, chat_file):
    manifest = run_capture(CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), limit=1), silent=True)
    ok = dict(hidden_size=576, vocab_size=49152, tokenizer_sha256=manifest["tokenizer_sha256"], aux_layer_ids=[1, 14, 26])
    check_matches_target(manifest, **ok)
    for change, words in [({"hidden_size": 4096}, "hidden size 576 != target's 4096"),
                          ({"vocab_size": 128256}, "vocab size 49152 != target's 128256"),
                          ({"tokenizer_sha256": "0" * 64}, "tokenizer hash"),
                          ({"aux_layer_ids": [2, 15, 27]}, "aux layer ids [1, 14, 26] != expected [2, 15, 27]")]:
        with pytest.raises(FeatureSetError, match=words.replace("[", r"\[").replace("]", r"\]")):
            check_matches_target(manifest, **{**ok, **change})


def test_automatic_shard_size_counts_every_layer_a_multi_family_capture_stores(tmp_path, chat_file, monkeypatch):
    """A capture for every family stores the union of their layers (6 of SmolLM2's 30, against
    EAGLE-3's 3): the automatic shard size must count them all, or a shard holds about twice the
    features its memory budget allows. The budget here is 4 samples' worth at max_length; the bytes
    per token are measured from the stored shard, not taken from the rule."""
    import specfoundry.capture.stage as stage
    from specfoundry.featureset.store import FeatureSet

    max_length, hidden, families = 64, 576, ("eagle3", "dflash", "domino", "dspark", "peagle")
    layers = len(stage.stored_layers(CaptureConfig(source="s", output="o", families=families), 30))
    assert layers > 3
    budget = 4 * max_length * hidden * 2 * (layers + 1)  # 4 samples of bf16 states at max_length
    monkeypatch.setattr(stage, "SHARD_BYTES", budget)
    cfg = CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), max_length=max_length, families=families)
    manifest = run_capture(cfg, silent=True)
    shard_size = manifest["capture_config"]["shard_size"]
    fs = FeatureSet(tmp_path / "fs")
    sample = fs[0]
    per_token = (sample.aux_hidden.nbytes + sample.final_hidden.nbytes) / len(sample.input_ids)
    assert len(manifest["aux_layer_ids"]) == layers and sample.aux_hidden.shape[-1] == layers * hidden
    assert shard_size * max_length * per_token <= budget  # the shard fits its budget at max_length
    assert (shard_size + 1) * max_length * per_token > budget  # and is not needlessly small


def test_no_capture_backend_option_that_always_fails(tmp_path, chat_file):
    # capture runs through transformers only; an sglang option that could only fail is not offered
    result = CliRunner().invoke(capture_cli, ["run", str(chat_file), "-o", str(tmp_path / "x"), "--backend", "sglang"])
    assert result.exit_code == 2 and "No such option '--backend'" in result.output
    assert not (tmp_path / "x").exists()


def test_default_shard_size_fits_a_memory_budget_and_is_recorded(tmp_path, chat_file):
    """Without --shard-size a shard holds at most 4 GiB of features at max_length (it sits in
    host memory until written), at most 256 samples; the resolved size is what a resume checks."""
    assert auto_shard_size(576, 2048, "bfloat16", num_layers=3) == 256  # SmolLM2: the cap
    assert auto_shard_size(4096, 4096, "bfloat16", num_layers=3) == 32  # an 8B target: 134 MB per sample
    assert auto_shard_size(4096, 4096, "float32", num_layers=3) == 16
    assert auto_shard_size(8192, 131072, "float32", num_layers=3) == 1
    cfg = CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), max_length=64)
    manifest = run_capture(cfg, silent=True)
    assert manifest["capture_config"]["shard_size"] == 256
    assert json.loads((tmp_path / "fs" / "capture_config.json").read_text())["shard_size"] == 256
    assert run_capture(cfg, silent=True)["shards"] == manifest["shards"]  # the same command resumes
    with pytest.raises(OutputFolderError, match="other settings .*shard_size: 256 -> 3"):
        run_capture(CaptureConfig(source=str(chat_file), output=str(tmp_path / "fs"), max_length=64, shard_size=3),
                    silent=True)


def test_silent_hides_transformers_own_bars_too(tmp_path, chat_file):
    """--silent: no progress bar at all, transformers' "Loading weights" one included (a separate
    process: the switch is process-wide)."""
    out = tmp_path / "fs"
    done = subprocess.run([sys.executable, "-m", "specfoundry.capture.cli", "run", str(chat_file), "-o", str(out),
                           "--silent"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Loading weights" not in done.stderr and "%|" not in done.stderr, done.stderr
    assert (out / "manifest.json").is_file()


def test_a_source_of_bad_records_alone_is_refused_with_the_reasons(tmp_path, tiny_llama_dir):
    """issue 61 item 11: when every record was bad, capture said 'no sample with a trainable token'
    and no more (regen prints its reasons). The line now counts the bad inputs by kind and names
    the first, and counts the records left with nothing trainable within --max-length."""
    from specfoundry.capture.stage import CaptureError

    src = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                                {"messages": [{"role": "user", "content": "hello"}]}])
    with pytest.raises(CaptureError, match=r"no sample with a trainable .*: 2 bad inputs \(no_assistant_turn 2; the first: "
                                           r".*bad.jsonl:1: no_assistant_turn"):
        run_capture(CaptureConfig(source=str(src), output=str(tmp_path / "fs"), target=str(tiny_llama_dir)),
                    silent=True)
    long = write_jsonl(tmp_path / "long.jsonl", [{"messages": [{"role": "user", "content": "word " * 200},
                                                               {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(CaptureError, match=r"1 with no assistant token within --max-length 32"):
        run_capture(CaptureConfig(source=str(long), output=str(tmp_path / "fs2"), target=str(tiny_llama_dir),
                                  max_length=32), silent=True)
