"""Targets placed across processes and devices (common/placement.py) give what one process gives.

One torchrun launch of 2 CPU processes (gloo) runs every stage that runs the target, through
tests/parallel_job.py, on tiny random targets: Llama with --tp 2 (capture, greedy regen, the gate,
sf-eval), Qwen3-MoE with --tp 2, with --ep 2 and with --ep 2 running the fused experts kernel
(--experts-implementation sf_fused, on each rank's experts), GLM-4-MoE with --tp 2, and a Llama with one KV
head, which --tp 2 cannot split (its attention is kept whole on each rank). This process then runs
the same stages alone and compares. sf-capture itself is run under torchrun by the kill-and-resume
test. --device-map with a --max-memory that offloads the layers is checked in this process.

Why features are compared within a tolerance and not byte for byte: a tensor-parallel layer
splits the reduction of each sharded matmul over the ranks and sums the partial products with an
all-reduce, so fp32 rounding happens in another order (about 1e-7 relative per operation, over 8
layers). The tolerance, 1e-5 relative plus 1e-5 of the tensor's largest value, is a hundred
times that and ten thousand times below a wrong layer or a wrong token. Greedy tokens, which a
rounding difference could flip only at a near-tie, are compared exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from specfoundry.capture.cli import main as capture_cli
from specfoundry.capture.stage import run_capture
from specfoundry.common.placement import Placement, PlacementError, distributed_config, join_launch
from specfoundry.common.target import resolve_target
from specfoundry.eval.evaluate import run_eval
from specfoundry.featureset.store import FeatureSet
from specfoundry.generate.regen import run_regen
from specfoundry.testing import write_tiny_target
from tests.conftest import CHAT, free_port, run_command, write_jsonl
from tests.parallel_job import capture_config, eval_config, regen_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
JOBS = {  # name: (model type, config overrides, placement, stages)
    "llama-tp": ("llama", {}, {"tp": 2}, ["capture", "regen", "gate", "eval"]),
    "qwen3_moe-tp": ("qwen3_moe", {}, {"tp": 2}, ["capture", "regen"]),
    "qwen3_moe-ep": ("qwen3_moe", {}, {"ep": 2}, ["capture", "regen"]),
    # the fused experts kernel (under Triton's interpreter here) on each rank's 2 experts
    "qwen3_moe-ep_fused": ("qwen3_moe", {}, {"ep": 2, "experts_implementation": "sf_fused"}, ["capture"]),
    "glm4_moe-tp": ("glm4_moe", {}, {"tp": 2}, ["capture", "regen"]),
    "llama_kv1-tp": ("llama", {"num_key_value_heads": 1}, {"tp": 2}, ["capture"]),
}
FEWER = {"qwen3_moe-ep_fused": 2}
"""Jobs that read only the first N conversations of CHAT: the fused experts kernel runs under
Triton's interpreter on a CPU, which made that capture of 6 conversations the launch's longest job."""


def job_source(root: Path, job: str) -> Path:
    return root / (f"chat-{job}.jsonl" if job in FEWER else "chat.jsonl")


def torchrun(*args, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *args]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The tiny targets, and the one launch that ran every job of JOBS under --tp / --ep."""
    root = tmp_path_factory.mktemp("parallel")
    smol = resolve_target("smollm2")
    targets = {}
    for name, (model_type, overrides, _, _) in JOBS.items():
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in targets:
            targets[key] = write_tiny_target(model_type, root / name.split("-")[0], smol, **overrides)
    source = write_jsonl(root / "chat.jsonl", CHAT)
    for job, n in FEWER.items():
        write_jsonl(job_source(root, job), CHAT[:n])
    plan = [{"target": str(targets[(m, tuple(sorted(o.items())))]), "work": str(root / name), **placement,
             "stages": stages, "source": str(job_source(root, name))} for name, (m, o, placement, stages) in JOBS.items()]
    (root / "plan.json").write_text(json.dumps(plan))
    run = subprocess.run(torchrun("-m", "tests.parallel_job", str(source), str(root / "plan.json")),
                         capture_output=True, text=True, env=ENV, cwd=ROOT)
    # the failing rank's own traceback, not only the others' "connection closed" that ends the output
    tracebacks = [line for line in run.stderr.splitlines() if line.startswith("[rank")]
    assert run.returncode == 0, "\n".join(tracebacks[:60]) + "\n...\n" + run.stderr[-2000:]
    return root, source, {name: job["target"] for name, job in zip(JOBS, plan, strict=True)}


def rows(out: Path) -> list[dict]:
    return [r for p in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def assert_same_features(one: Path, placed: Path, conversations: int) -> None:
    a, b = FeatureSet(one), FeatureSet(placed)
    assert len(a) == len(b) == conversations
    assert a.manifest["aux_layer_ids"] == b.manifest["aux_layer_ids"]
    assert a.manifest["counts"] == b.manifest["counts"]
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for name in ("aux_hidden", "final_hidden"):
            want, got = getattr(x, name), getattr(y, name)
            assert want.dtype == got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("job", [name for name, spec in JOBS.items() if "capture" in spec[3]])
def test_a_placed_capture_writes_the_features_one_process_writes(launched, tmp_path, job):
    root, _, targets = launched
    run_capture(capture_config(targets[job], str(job_source(root, job)), tmp_path / "one", Placement()), silent=True)
    assert_same_features(tmp_path / "one", root / job / "capture", FEWER.get(job, len(CHAT)))


@pytest.mark.parametrize("job", [name for name, spec in JOBS.items() if "regen" in spec[3]])
def test_a_placed_greedy_regen_writes_the_tokens_one_process_writes(launched, tmp_path, job):
    root, source, targets = launched
    run_regen(regen_config(targets[job], str(source), tmp_path / "one", Placement()), silent=True)
    one, placed = rows(tmp_path / "one"), rows(root / job / "regen")
    assert [r["id"] for r in one] == [r["id"] for r in placed]
    assert [r["gen_token_ids"] for r in one] == [r["gen_token_ids"] for r in placed]
    assert sum(len(ids) for r in one for ids in r["gen_token_ids"]) > 0


def test_the_gate_passes_and_sf_eval_decodes_as_one_process_under_tp(launched):
    """The launch exits non-zero if the gate fails under --tp 2 (parallel_job.py). sf-eval there
    decoded the gate's draft: greedy output equal to the target alone, and the same acceptance
    as this process decoding the same draft."""
    root, _, targets = launched
    placed = json.loads((root / "llama-tp" / "eval" / "eval.json").read_text())
    assert placed["placement"]["tp"] == 2
    one = run_eval(eval_config(targets["llama-tp"], root / "llama-tp" / "gate" / "train" / "export", Placement()),
                   silent=True)
    for report in (placed, one):
        assert report["sets"]["chat"]["trained"]["identical_to_target"] == "2/2"
    assert placed["sets"]["chat"]["trained"]["accept_length"] == one["sets"]["chat"]["trained"]["accept_length"]
    assert placed["sets"]["chat"]["trained"]["accept_rate_by_position"] == \
        one["sets"]["chat"]["trained"]["accept_rate_by_position"]


def test_device_map_offload_writes_the_features_one_device_writes(launched, tmp_path):
    """--device-map auto with a --max-memory far below the model: accelerate keeps the embedding
    in CPU memory and offloads the decoder layers to disk, loading each when it runs."""
    _, source, targets = launched
    target = targets["llama-tp"]
    run_capture(capture_config(target, str(source), tmp_path / "one", Placement()), silent=True)
    placement = Placement(device_map="auto", max_memory={"cpu": "13MB"})
    run_capture(capture_config(target, str(source), tmp_path / "offloaded", placement), silent=True)
    from transformers import AutoModelForCausalLM

    from specfoundry.common.target import placement_kwargs

    model = AutoModelForCausalLM.from_pretrained(target, **placement_kwargs(Path(target), placement, "cpu"))
    assert "disk" in set(model.hf_device_map.values())  # the placement really offloaded layers
    a, b = FeatureSet(tmp_path / "one"), FeatureSet(tmp_path / "offloaded")
    for i in range(len(a)):
        for name in ("aux_hidden", "final_hidden"):
            assert torch.equal(getattr(a[i], name), getattr(b[i], name))  # the same kernels on the same device


def test_a_killed_rank_then_the_same_command_resumes_to_an_uninterrupted_capture(launched, tmp_path):
    """sf-capture --tp 2 under torchrun; the writing rank is SIGKILLed right after it renamed
    shard 1 into place, before that shard's done mark, and torchrun stops the other rank. The
    same command then ends with the shards of an uninterrupted run (the launch's, with the same
    settings), byte for byte. A rerun with another --tp (which places the target and is no
    setting of the output) is accepted; another --max-length is refused."""
    root, source, targets = launched
    args = ["run", str(source), "--target", targets["llama-tp"], "--shard-size", "2", "--codec", "safetensors",
            "--storage-dtype", "float32", "--max-length", "96", "--silent", "--device", "cpu"]
    whole, killed = root / "llama-tp" / "capture", tmp_path / "killed"

    def capture(out: Path, *extra, kill: bool = False):
        prefix = [str(ROOT / "tests" / "faults.py"), "--kill-at", "after-rename", "--match",
                  "*/shard-000001.safetensors", "--"] if kill else ["-m"]
        return subprocess.run(torchrun(*prefix, "specfoundry.capture.cli", *args, "--tp", "2", "-o", str(out),
                                       *extra), capture_output=True, text=True, env=ENV, cwd=ROOT)

    faulty = capture(killed, kill=True)
    assert faulty.returncode != 0 and "faults: killed at after os.replace" in faulty.stderr, faulty.stderr[-2000:]
    assert not json.loads((killed / "manifest.json").read_text())["complete"] if (killed / "manifest.json").exists() \
        else True
    resumed = capture(killed)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((whole / "manifest.json").read_text())
    b = json.loads((killed / "manifest.json").read_text())
    assert b["complete"] and [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    run_command(capture_cli, [*args, "-o", killed])  # --tp 1 (this process): accepted, nothing to redo
    assert json.loads((killed / "manifest.json").read_text())["shards"] == b["shards"]
    refused = run_command(capture_cli, [*args, "--max-length", "64", "-o", killed], exit_code=2)
    assert "max_length: 96 -> 64" in refused.stderr


# ---- what cannot be placed is named before anything loads ---------------------------------------

def test_tp_without_torchrun_names_the_launch():
    with pytest.raises(PlacementError, match=r"torchrun --nproc-per-node 2 sf-capture run"):
        join_launch(Placement(tp=2), "cpu", "sf-capture run")


@pytest.mark.parametrize("settings, message", [
    (dict(tp=0), "--tp: 0 is not in the range 1<=x<=1,024"),
    (dict(tp=2, ep=4), "give one size"),
    (dict(tp=2, device_map="auto"), "choose one"),
    (dict(max_memory={"cpu": "1GB"}), "give --device-map auto too"),
])
def test_contradictory_placements_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Placement(**settings)


def plan_of(model_type: str, **config):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **config)


def test_the_plans_limits_are_named_or_handled():
    from transformers import LlamaConfig

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert distributed_config(LlamaConfig(**small), Placement(tp=2)).tp_plan is None  # the model's own plan
    # 2 KV heads over 4 ranks: the attention projections are kept whole, the MLP is split
    kept = distributed_config(LlamaConfig(**small), Placement(tp=4)).tp_plan
    assert set(kept) == {f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"}
    assert set(kept.values()) == {"replicated_with_grad_allreduce"}
    with pytest.raises(PlacementError, match=r"does not divide LlamaConfig's MLP width \(intermediate_size\) 128: "
                                             r"use one of 1, 2"):
        distributed_config(LlamaConfig(**small), Placement(tp=3))
    with pytest.raises(PlacementError, match="no expert-parallel plan.*use --tp 2"):
        distributed_config(LlamaConfig(**small), Placement(ep=2))
    gpt_oss = plan_of("gpt_oss", num_local_experts=4)
    with pytest.raises(PlacementError, match=r"splits none of its decoder layers \(only embed_tokens\): spread its "
                                             r"experts with --ep 2"):
        distributed_config(gpt_oss, Placement(tp=2))
    with pytest.raises(PlacementError, match="does not divide .* 4 experts: use one of 1, 2"):
        distributed_config(gpt_oss, Placement(ep=3))
    no_plan = LlamaConfig(**small)
    no_plan.base_model_tp_plan = {}
    with pytest.raises(PlacementError, match="no tensor-parallel plan in transformers: .* --device-map auto"):
        distributed_config(no_plan, Placement(tp=2))


def test_the_process_groups_of_several_copies_are_their_own(tmp_path):
    """4 ranks with --tp 2 are 2 copies: each initialises the default process group over its own 2
    ranks, so a collective inside one copy never waits on the other, and launch-wide barriers go
    through the store (placement.join_launch)."""
    script = ("import torch, torch.distributed as dist\n"
              "from specfoundry.common.placement import Placement, join_launch\n"
              "ranks, _ = join_launch(Placement(tp=2), 'cpu')\n"
              "x = torch.tensor([float(ranks.rank)])\n"
              "dist.all_reduce(x)\n"
              "ranks.barrier()\n"
              "shared = ranks.from_writer(f'group {ranks.group} writer {ranks.rank}' if ranks.is_writer else None)\n"
              "import sys, pathlib\n"  # a file per rank: the ranks' stdout lines can interleave
              "line = f'{ranks.rank} {ranks.group} {dist.get_world_size()} {x.item()} {shared}'\n"
              "(pathlib.Path(sys.argv[1]) / f'rank{ranks.rank}.txt').write_text(line)\n")
    (tmp_path / "groups.py").write_text(script)
    run = subprocess.run(torchrun(str(tmp_path / "groups.py"), str(tmp_path), nproc=4), capture_output=True,
                         text=True, env=ENV, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = sorted(tuple(f.read_text().split(" ", 4)) for f in tmp_path.glob("rank*.txt"))
    assert lines == [("0", "0", "2", "1.0", "group 0 writer 0"), ("1", "0", "2", "1.0", "group 0 writer 0"),
                     ("2", "1", "2", "5.0", "group 1 writer 2"), ("3", "1", "2", "5.0", "group 1 writer 2")]


# ---- the ranks of one launch run one command on one target (issue 37 item 2) -----------------------

LAUNCH_CASES = {  # name: (per-rank options, the environment's addition, words the one line holds)
    "another --tp": (["--tp", "r0=2|r1=1"], {}, "rank 1 runs with placement.tp 1, rank 0 with 2"),
    "another recorded setting": (["--max-length", "r0=64|r1=48"], {}, "rank 1 runs with settings.max_length 48"),
    "other weights at the same path": ([], {"OTHER_WEIGHTS_ON_RANK": "1"}, "rank 1 runs with target.weight_fingerprint"),
    # issue 61 item 3: before, a complete feature set whose shard 1 held the other copy's data
    "other data at the same path": ([], {"OTHER_DATA_ON_RANK": "1"}, "rank 1 runs with source.samples_sha256"),
}


@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_ranks_that_differ_are_one_line_on_every_rank_without_a_hang(tmp_path, tiny_llama_dir, case):
    """Before: other weights at the same path wrote one 'complete' feature set of both targets; another
    --tp hung; another setting was refused with a gloo traceback on rank 0. Now the ranks compare what
    they run through the launch's store before anything else: every rank exits 2 with the same line."""
    options, env, words = LAUNCH_CASES[case]
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT[:2])
    args = [str(ROOT / "tests" / "per_rank.py"), "specfoundry.capture.cli", "run", str(src), "-o", str(tmp_path / "fs"),
            "--target", str(tiny_llama_dir), "--silent", *options]
    done = subprocess.run(torchrun(*args), env={**ENV, **env}, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    # (torchrun's own agent reports a failed child with a traceback of its launcher; the ranks print none)
    ours = [line for line in done.stderr.splitlines() if 'File "' in line and "torch/distributed/" not in line
            and "<frozen runpy>" not in line]
    assert done.returncode != 0 and not ours and "gloo" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 2 and all(words in e for e in errors), done.stderr[-3000:]  # one line from each rank
    assert not (tmp_path / "fs" / "manifest.json").exists()
