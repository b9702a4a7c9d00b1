"""benchmarks/families.py: the table of draft families joins runs only where they read one capture."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import families

ROOT = Path(__file__).resolve().parents[1]


def eval_folder(run: Path, draft: str, accept: float, *, alone: float | None = None, gpu: str = "NVIDIA H100",
                limit: int | None = None) -> None:
    """An sf-eval output folder as benchmarks.families reads it: one set, the keys it takes."""
    folder = run / f"eval_{draft}"
    folder.mkdir(parents=True)
    entry = {"trained": {"prompts": 2, "accept_length": accept, "tokens_per_s": 100.0 * accept}}
    if alone is not None:
        entry["target_alone_tokens_per_s"] = alone
    report = {"family": draft.split("_")[0], "config": {"tree": None, "k": 15, "limit": limit, "dtype": "bfloat16"},
              "environment": {"gpu": gpu}, "sets": {"chat": entry}}
    (folder / "eval.json").write_text(json.dumps(report))


def capture_listing(run: Path, text: str) -> None:
    (run / families.DIGEST).write_text(text)


def two_runs_of_one_capture(tmp_path) -> tuple[Path, Path]:
    """Run a (DFlash2, the target alone beside it) and run b (Domino), their captures' listings equal."""
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7, alone=640.0)
    eval_folder(second, "domino_b16", 1.6)
    for run in (first, second):
        capture_listing(run, "0620  ./shards/shard-000000.safetensors\n")
    return first, second


def test_runs_of_one_capture_join_and_the_result_names_its_digest(tmp_path):
    first, second = two_runs_of_one_capture(tmp_path)
    digest = families.features_digest([first, second])
    rows = families.gather_runs([first, second])
    assert {r["draft"] for r in rows} == {"dflash2_b16", "domino_b16"}
    s = families.summary(rows, [], each_alone=True)
    assert s["accept_length"] == {"dflash2_b16": {"chat": 1.7}, "domino_b16": {"chat": 1.6}}
    assert s["tokens_per_s"]["target_alone"] == {"chat": 640.0}
    assert digest is not None and len(digest) == 64


def test_runs_of_different_captures_or_without_a_digest_are_refused(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7)
    eval_folder(second, "domino_b16", 1.6)
    capture_listing(first, "0620  ./shards/shard-000000.safetensors\n")
    with pytest.raises(SystemExit, match="no features.sha256"):
        families.features_digest([first, second])
    capture_listing(second, "ffff  ./shards/shard-000000.safetensors\n")
    with pytest.raises(SystemExit, match="read different features"):
        families.features_digest([first, second])
    # one run needs no digest (a table of one machine's drafts)
    assert families.features_digest([tmp_path / "c"]) is None


def test_a_draft_evaluated_in_two_runs_is_refused_naming_both(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash_b16", 1.5)
    eval_folder(second, "dflash_b16", 1.6)
    with pytest.raises(SystemExit, match="eval_dflash_b16 is in both"):
        families.gather_runs([first, second])


def test_the_command_joins_two_runs_into_one_result(tmp_path):
    first, second = two_runs_of_one_capture(tmp_path)
    out = tmp_path / "families.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.families", str(first), str(second), "--each-alone",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["features_sha256"] == families.features_digest([first, second])
    assert set(result["summary"]["accept_length"]) == {"dflash2_b16", "domino_b16"}


@pytest.mark.parametrize("other, words", [(dict(gpu="NVIDIA H200"), "card"), (dict(limit=8), "limit")])
def test_runs_evaluated_on_another_card_or_with_other_settings_are_refused(tmp_path, other, words):
    """Their speeds would sit in one table against one target-alone figure: refused, naming what differs."""
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7, alone=640.0)
    eval_folder(second, "domino_b16", 1.6, **other)
    with pytest.raises(SystemExit, match=f"evaluated with another {words}: their speeds are not one table's"):
        families.gather_runs([first, second])
