"""The fault matrix: every long stage killed (SIGKILL) at chosen moments, or run out of disk,
then the same command run again, must end exactly as an uninterrupted run.

Every killed command runs as a real process through tests/faults.py, which kills it for real at the
moment chosen (just before or after a rename, half-way through a file write); a run out of disk is a
real process too. The rerun of the same command, and an uninterrupted run of it into another folder
(the reference), run in this process (tests/conftest.py run_command: as a child with ENV's one
thread and no CUDA device would, byte for byte; no interpreter to start for each). The resumed
folder must hold the same files with the same bytes (the output folder's own path, recorded in the
configs, aside), and no leftover of the killed run. One moment per stage runs by default; the rest
are marked slow (`pytest -m slow tests/test_faults.py`).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specfoundry.capture.cli import main as capture_cli
from specfoundry.families import FAMILIES
from tests.conftest import CHAT, copies, run_command, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults.py"
# one thread per process: the reference and the killed run go side by side on 2 cores, and
# every run of one command must compute in the same order to write the same bytes
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
REGEN, CAPTURE, TRAIN = "specfoundry.generate.cli", "specfoundry.capture.cli", "specfoundry.train.cli"


def command(module: str, args: list, fault: tuple[str, str, int] | None = None) -> list[str]:
    """`python -m module run args`, or the same under tests/faults.py with (moment, glob, nth)."""
    run = [module, "run", *map(str, args)]
    if fault is None:
        return [sys.executable, "-m", *run]
    moment, pattern, nth = fault
    return [sys.executable, str(FAULTS), "--kill-at", moment, "--match", pattern, "--nth", str(nth), "--", *run]


def start(module: str, args: list, fault=None) -> subprocess.Popen:
    return subprocess.Popen(command(module, args, fault), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rerun(module: str, args: list) -> str:
    """The command run again after its kill, in this process (tests/conftest.py run_command: as a
    child with ENV would run it); returns what it wrote to stderr."""
    return run_command(importlib.import_module(module).main, ["run", *args]).stderr


def killed(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The run died of the SIGKILL tests/faults.py sends at the chosen moment (not earlier, not of itself)."""
    assert result.returncode == -signal.SIGKILL and "faults: killed at" in result.stderr, (
        f"expected a kill, got exit {result.returncode}:\n{result.stderr[-3000:]}")
    return result


class Reference:
    """An uninterrupted run of one command into root/reference, made when the test first reads it.
    It runs in this process, as the rerun does (`rerun`)."""

    def __init__(self, module: str, args_for):
        self.module, self.args_for, self.out, self.done = module, args_for, None, False

    def start(self, root: Path) -> Reference:
        if self.out is None:
            self.out = root / "reference"
        return self

    def folder(self) -> Path:
        if not self.done:
            rerun(self.module, self.args_for(self.out))
            self.done = True
        return self.out


def files(root: Path) -> dict[str, bytes]:
    """Every file under root by relative path, with its bytes; JSON files with root's own path
    written as <OUT> (the configs record the output folder)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.suffix == ".json":
                data = data.replace(str(root).encode(), b"<OUT>")
            out[str(p.relative_to(root))] = data
    return out


def assert_same_files(reference: Path, resumed: Path, skip=lambda rel: False) -> None:
    a = {k: v for k, v in files(reference).items() if not skip(k)}
    b = {k: v for k, v in files(resumed).items() if not skip(k)}
    assert sorted(b) == sorted(a), f"files differ: extra {sorted(set(b) - set(a))}, missing {sorted(set(a) - set(b))}"
    for rel in a:
        assert a[rel] == b[rel], f"{rel} differs from the uninterrupted run's"


def leftovers(root: Path) -> list[str]:
    """Temporary files or folders of a killed run: .partial-*, *.tmp, dot-files."""
    return [str(p.relative_to(root)) for p in root.rglob("*")
            if p.name.startswith(".") or p.name.endswith(".tmp") or p.name.startswith(".partial-")]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    write_jsonl(root / "chat.jsonl", CHAT)
    return root


# ---- sf-regen: 6 conversations, 3 shards of 2 -------------------------------------------------

def regen_args(src: Path):
    return lambda out: [src, "--shard-size", 2, "--max-new-tokens", 2, "--seed", 3, "--silent", "-o", out]


@pytest.fixture(scope="module")
def regen_reference(inputs):
    return Reference(REGEN, regen_args(inputs / "chat.jsonl")).start(inputs / "regen")


SHARD1 = "*/data/shard-00001.parquet"
REGEN_MOMENTS = {
    "before the shard's rename": ("before-rename", SHARD1, 1),
    "after the rename, before its done mark": ("after-rename", SHARD1, 1),
    "while its done mark is written": ("before-rename", SHARD1 + ".done.json", 1),
    "after its done mark": ("after-rename", SHARD1 + ".done.json", 1),
    "while the manifest is written": ("before-rename", "*/manifest.json", 3),  # after shards 0 and 1
}


@pytest.mark.parametrize("moment", [pytest.param(m, marks=[] if i == 0 else [pytest.mark.slow])
                                    for i, m in enumerate(REGEN_MOMENTS)])
def test_regen_killed_then_rerun_equals_an_uninterrupted_run(tmp_path, inputs, regen_reference, moment):
    args = regen_args(inputs / "chat.jsonl")(tmp_path / "out")
    killed(finish(start(REGEN, args, REGEN_MOMENTS[moment])))
    data = tmp_path / "out" / "data"
    assert (data / "shard-00000.parquet.done.json").is_file() and not (data / "shard-00002.parquet").exists()
    assert not json.loads((tmp_path / "out" / "manifest.json").read_text())["complete"]
    rerun(REGEN, args)
    reference = regen_reference.folder()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == manifest["num_shards"] == 3
    assert leftovers(tmp_path / "out") == []
    assert_same_files(reference, tmp_path / "out")  # parquet shards, done marks, manifest, config, card


# ---- sf-capture: 6 conversations, 3 shards of 2, each codec ----------------------------------

EXT = {"zarr": "zarr", "safetensors": "safetensors"}


def capture_args(src: Path, codec: str):
    return lambda out: [src, "--shard-size", 2, "--codec", codec, "--writers", 1, "--silent", "-o", out]


@pytest.fixture(scope="module")
def capture_references(inputs):
    return {codec: Reference(CAPTURE, capture_args(inputs / "chat.jsonl", codec)) for codec in EXT}


def capture_moments(codec: str) -> dict:
    shard1 = f"*/shards/shard-000001.{EXT[codec]}"
    return {
        "before the shard's rename": ("before-rename", shard1, 1),
        "after the rename, before its done mark": ("after-rename", shard1, 1),
        "while its done mark is written": ("before-rename", shard1 + ".done.json", 1),
        "after its done mark": ("after-rename", shard1 + ".done.json", 1),
        "while the token counts are written": ("before-rename", "*/token_counts.safetensors", 1),
    }


CAPTURE_CASES = [pytest.param(codec, moment, marks=[] if (codec, moment) == (
    "zarr", "after the rename, before its done mark") else [pytest.mark.slow], id=f"{codec}-{moment}")
    for codec in EXT for moment in capture_moments(codec)]


def verify(folder: Path) -> str:
    return run_command(capture_cli, ["verify", folder]).stdout


def assert_same_featureset(reference: Path, resumed: Path) -> None:
    a = json.loads((reference / "manifest.json").read_text())
    b = json.loads((resumed / "manifest.json").read_text())
    assert b["complete"] and len(b["shards"]) == len(a["shards"]) == 3
    assert [(s["path"], s["sha256"]) for s in b["shards"]] == [(s["path"], s["sha256"]) for s in a["shards"]]
    assert leftovers(resumed) == []
    assert_same_files(reference, resumed)  # every shard file, done mark, manifest, token counts
    output = verify(resumed)
    assert output.strip() == f"{resumed}: ok", output


@pytest.mark.parametrize("codec,moment", CAPTURE_CASES)
def test_capture_killed_then_rerun_equals_an_uninterrupted_run(tmp_path, inputs, capture_references, codec, moment):
    reference = capture_references[codec].start(inputs / f"capture-{codec}")
    args = capture_args(inputs / "chat.jsonl", codec)(tmp_path / "out")
    killed(finish(start(CAPTURE, args, capture_moments(codec)[moment])))
    assert not (tmp_path / "out" / "manifest.json").exists()  # written last, once every shard is in
    rerun(CAPTURE, args)
    assert_same_featureset(reference.folder(), tmp_path / "out")


# ---- sf-train: 4 steps on a small feature set, a checkpoint every 2 ---------------------------

@pytest.fixture(scope="module")
def train_features(inputs) -> Path:
    src = write_jsonl(inputs / "chat2.jsonl", copies(CHAT, 2))
    run_command(capture_cli, ["run", src, "--shard-size", 8, "--max-length", 96, "--silent", "-o", inputs / "fs"])
    return inputs / "fs"


def train_args(fs: Path):
    return lambda out: [fs, "-o", out, "--draft-vocab-size", 512, "--ttt-length", 3, "--lr", 3e-3,
                        "--warmup-steps", 2, "--max-steps", 4, "--max-batch-tokens", 160, "--save-every", 2,
                        "--eval-fraction", 0, "--num-workers", 0, "--loss-kernel", "reference", "--silent"]


@pytest.fixture(scope="module")
def train_reference(inputs, train_features):
    return Reference(TRAIN, train_args(train_features)).start(inputs / "train")


TRAIN_MOMENTS = {  # (the fault, what the rerun says it resumes from)
    "during a checkpoint write (optimizer state half written)": (
        ("mid-write", "*/checkpoints/step-0000004.tmp/optimizer.bin", 1),
        "incomplete checkpoint step-0000004.tmp"),
    "during a checkpoint write (model weights half written)": (
        ("mid-write", "*/checkpoints/step-0000004.tmp/model.safetensors", 1),
        "incomplete checkpoint step-0000004.tmp"),
    "after a complete checkpoint, before the next step": (("after-rename", "*/checkpoints/step-0000002", 1), None),
    "during the export write": (("mid-write", "*/.export.tmp/model.safetensors", 1), None),
    "while history.json is written": (("before-rename", "*/history.json", 1), None),
}


def assert_same_training(reference: Path, resumed: Path) -> None:
    a = load_file(str(reference / "export" / "model.safetensors"))
    b = load_file(str(resumed / "export" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit for bit
    history = json.loads((resumed / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert history == json.loads((reference / "history.json").read_text())
    assert leftovers(resumed) == []
    assert not list(resumed.rglob("*.tmp"))
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    assert_same_files(reference, resumed, skip=lambda rel: rel.startswith("checkpoints/"))


@pytest.mark.parametrize("moment", [pytest.param(m, marks=[] if i == 0 else [pytest.mark.slow])
                                    for i, m in enumerate(TRAIN_MOMENTS)])
def test_train_killed_then_rerun_equals_an_uninterrupted_run(tmp_path, train_features, train_reference, moment):
    fault, said = TRAIN_MOMENTS[moment]
    args = train_args(train_features)(tmp_path / "out")
    killed(finish(start(TRAIN, args, fault)))
    output = rerun(TRAIN, args)
    if said:
        lines = [line for line in output.splitlines() if "incomplete checkpoint" in line]
        assert len(lines) == 1 and said in lines[0] and "resuming from step-0000002" in lines[0], output
    assert_same_training(train_reference.folder(), tmp_path / "out")


# every family's training, killed mid-checkpoint and rerun: the same export, history and files
FAMILY_ARGS = {  # small drafts of each family, trained on the set of every family's layers
    "eagle3": ["--draft-vocab-size", 512, "--ttt-length", 3],
    # one draft layer reading the five layers a five-layer DFlash draft would (SmolLM2's, stored in the set)
    "dflash": ["--num-draft-layers", 1, "--layers", "1,8,14,20,27", "--block-size", 4, "--num-anchors", 8],
    "domino": ["--num-draft-layers", 1, "--layers", "1,8,14,20,27", "--block-size", 4, "--num-anchors", 8,
               "--gru-hidden-dim", 16, "--correction-dim", 16],
    "dspark": ["--num-draft-layers", 1, "--layers", "1,8,14,20,27", "--block-size", 4, "--num-anchors", 8,
               "--markov-rank", 8],
    # a selector ramping in over the run: its schedule is part of what a resume must repeat
    "dflash2": ["--num-draft-layers", 1, "--layers", "1,8,14,20,27", "--block-size", 4, "--num-anchors", 8,
                "--selector-rank", 8, "--selector-top-k", 4, "--selector-ramp-ratio", 0.5],
    "peagle": ["--peagle-vocab-size", 512, "--num-depths", 3, "--peagle-layers", 1],
}


@pytest.fixture(scope="module")
def every_family_features(inputs) -> Path:
    src = write_jsonl(inputs / "chat2-all.jsonl", copies(CHAT, 2))
    run_command(capture_cli, ["run", src, "--shard-size", 8, "--max-length", 96, "--silent", "-o", inputs / "fs-all",
                              "--families", ",".join(FAMILIES.names())])
    return inputs / "fs-all"


def family_train_args(fs: Path, family: str):
    return lambda out: [fs, "-o", out, "--family", family, *FAMILY_ARGS[family], "--lr", 3e-3, "--warmup-steps", 2,
                        "--max-steps", 4, "--max-batch-tokens", 160, "--save-every", 2, "--eval-fraction", 0,
                        "--num-workers", 0, "--loss-kernel", "reference", "--silent"]


@pytest.mark.parametrize("family", [f for f in FAMILIES.names() if f != FAMILIES.default])  # (the default: above)
def test_every_familys_training_killed_mid_checkpoint_then_rerun_equals_an_uninterrupted_run(
        tmp_path, every_family_features, family):
    """issue 37 item 12: SIGKILL-and-resume was tried for EAGLE-3 (and DFlash) only."""
    args = family_train_args(every_family_features, family)
    reference = Reference(TRAIN, args).start(tmp_path / "reference")
    fault, said = TRAIN_MOMENTS["during a checkpoint write (model weights half written)"]
    killed(finish(start(TRAIN, args(tmp_path / "out"), fault)))
    output = rerun(TRAIN, args(tmp_path / "out"))
    lines = [line for line in output.splitlines() if "incomplete checkpoint" in line]
    assert len(lines) == 1 and said in lines[0] and "resuming from step-0000002" in lines[0], output
    assert_same_training(reference.folder(), tmp_path / "out")


# ---- a full disk: a small tmpfs as the output folder -----------------------------------------

class Tmpfs:
    """A tmpfs mounted at `path` (skips the test when it cannot be mounted), grown in place."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs at {path}: {(done.stderr or done.stdout).strip()}")

    def grow(self, size: int) -> None:
        """Free space: the same filesystem, its files kept, made bigger."""
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True)

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.path)], check=True, capture_output=True)


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def assert_no_space_error(result: subprocess.CompletedProcess, out: Path) -> None:
    """Exit status 2 and one line saying the disk is full, under the output folder; no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode == 2, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and "No space left on device" in errors[0] and str(out) in errors[0], result.stderr[-3000:]


@pytest.mark.parametrize("codec", [pytest.param("zarr"), pytest.param("safetensors", marks=pytest.mark.slow)])
def test_capture_on_a_full_disk_fails_in_one_line_then_resumes_identically(tmp_path, inputs, capture_references,
                                                                          codec):
    reference = capture_references[codec].start(inputs / f"capture-{codec}").folder()
    out = tmp_path / "out"
    disk = Tmpfs(out, folder_bytes(reference) // 2)  # the run stops half way
    try:
        args = capture_args(inputs / "chat.jsonl", codec)(out)
        assert_no_space_error(finish(start(CAPTURE, args)), out)
        disk.grow(64 << 20)
        rerun(CAPTURE, args)
        assert_same_featureset(reference, out)
    finally:
        disk.unmount()


def pages(size: int, page: int = 4096) -> int:
    return -(-size // page) * page


@pytest.mark.slow
def test_capture_with_the_disk_full_for_the_token_counts_fails_in_one_line_then_finishes(tmp_path, inputs,
                                                                                        capture_references):
    """Every shard fits, the token counts (written once every shard is done) do not."""
    reference = capture_references["safetensors"].start(inputs / "capture-safetensors").folder()
    counts = reference / "token_counts.safetensors"
    rest = sum(pages(p.stat().st_size) for p in reference.rglob("*") if p.is_file() and p != counts)
    out = tmp_path / "out"
    disk = Tmpfs(out, rest + pages(counts.stat().st_size) // 2)
    try:
        args = capture_args(inputs / "chat.jsonl", "safetensors")(out)
        assert_no_space_error(finish(start(CAPTURE, args)), out)
        assert len(list((out / "shards").glob("*.done.json"))) == 3
        disk.grow(64 << 20)
        rerun(CAPTURE, args)
        assert_same_featureset(reference, out)
    finally:
        disk.unmount()


@pytest.mark.slow
def test_train_on_a_full_disk_during_its_final_export_fails_in_one_line_then_resumes_identically(
        tmp_path, train_features, train_reference):
    """issue 61 item 10: the final export ran out of space with safetensors' traceback and left its
    temporary folder; it is now written whole aside (files.write_dir_whole): one line, nothing left."""
    reference = train_reference.folder()
    export = folder_bytes(reference / "export")
    out = tmp_path / "out"
    disk = Tmpfs(out, folder_bytes(reference) - export // 2)  # everything before the export fits
    try:
        args = train_args(train_features)(out)
        assert_no_space_error(finish(start(TRAIN, args)), out)
        assert (out / "checkpoints" / "step-0000004" / "trainer_state.json").is_file()
        assert not (out / "export").exists() and not list(out.glob(".export*"))
        disk.grow(4 * folder_bytes(reference))
        rerun(TRAIN, args)
        assert_same_training(reference, out)
    finally:
        disk.unmount()


@pytest.mark.slow
def test_train_on_a_full_disk_during_a_checkpoint_fails_in_one_line_then_resumes_identically(
        tmp_path, train_features, train_reference):
    reference = train_reference.folder()
    checkpoint = folder_bytes(reference / "checkpoints" / "step-0000002")
    out = tmp_path / "out"
    disk = Tmpfs(out, checkpoint * 3 // 2)  # step 2's checkpoint fits, step 4's runs out of space
    try:
        args = train_args(train_features)(out)
        assert_no_space_error(finish(start(TRAIN, args)), out)
        assert (out / "checkpoints" / "step-0000002" / "trainer_state.json").is_file()
        disk.grow(4 * checkpoint)
        rerun(TRAIN, args)
        assert_same_training(reference, out)
    finally:
        disk.unmount()
