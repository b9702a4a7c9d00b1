"""`python -m benchmarks.families`: the table of draft families joins runs only where they read one
capture and were evaluated alike. Driven through its command line, as the GPU plan runs it (tests
import no benchmark)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIGEST = "features.sha256"  # the capture listing beside each run (scripts/measure_gpu.sh writes it)
LISTING = "0620  ./shards/shard-000000.safetensors\n"


def eval_folder(run: Path, draft: str, accept: float, *, alone: float | None = None, gpu: str = "NVIDIA H100",
                limit: int | None = None, steps: int | None = None, evaluated_as: str | None = None,
                draft_training_steps: int | None = None) -> None:
    """An sf-eval output folder as benchmarks.families reads it: one set, the keys it takes; `steps`:
    the draft's sf-train run beside it, as the plan leaves it, recording that many steps; `evaluated_as`:
    the folder's name where it was evaluated (renamed since); `draft_training_steps`: the report's own record."""
    folder = run / f"eval_{draft}"
    folder.mkdir(parents=True)
    entry = {"trained": {"prompts": 2, "accept_length": accept, "tokens_per_s": 100.0 * accept}}
    if alone is not None:
        entry["target_alone_tokens_per_s"] = alone
    report = {"family": draft.split("_")[0], "config": {"tree": None, "k": 15, "limit": limit, "dtype": "bfloat16",
                                                        "draft": f"/elsewhere/run/{evaluated_as or draft}"},
              "environment": {"gpu": gpu}, "sets": {"chat": entry}, "draft_training_steps": draft_training_steps}
    if steps is not None:
        (run / draft).mkdir()
        (run / draft / "train_summary.json").write_text(json.dumps({"steps": steps}))
    (folder / "eval.json").write_text(json.dumps(report))


def capture_listing(run: Path, text: str = LISTING) -> None:
    (run / DIGEST).write_text(text)


def two_runs_of_one_capture(tmp_path) -> tuple[Path, Path]:
    """Run a (DFlash2 with its training run, the target alone beside it) and run b (Domino), their
    captures' listings equal."""
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7, alone=640.0, steps=678)
    eval_folder(second, "domino_b16", 1.6)
    for run in (first, second):
        capture_listing(run)
    return first, second


def benchmark(module: str, *args) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` from the repository's root, as scripts/measure_gpu.sh runs it."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def table(tmp_path, *runs: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The command over `runs` (--each-alone), and the result it wrote (None where it wrote none)."""
    out = tmp_path / "families.json"
    done = benchmark("benchmarks.families", *runs, "--each-alone", "--out", out)
    return done, json.loads(out.read_text()) if out.is_file() else None


def test_runs_of_one_capture_join_and_the_result_names_its_digest(tmp_path):
    done, result = table(tmp_path, *two_runs_of_one_capture(tmp_path))
    assert done.returncode == 0, done.stderr
    summary = result["summary"]
    assert summary["accept_length"] == {"dflash2_b16": {"chat": 1.7}, "domino_b16": {"chat": 1.6}}
    assert summary["tokens_per_s"]["target_alone"] == {"chat": 640.0}
    assert summary["train_steps"] == {"dflash2_b16": 678}  # Domino's run folder is not there: unknown
    assert result["machine"]["gpu"] == "NVIDIA H100"  # where the reports decoded, not where they were gathered
    assert result["features_sha256"] == hashlib.sha256(LISTING.encode()).hexdigest()
    # the steps: the report's own record first, else the run folder by either name
    steps = tmp_path / "s"
    eval_folder(steps, "eagle3", 1.8, steps=678, draft_training_steps=500)
    eval_folder(steps, "dflash_b16", 1.5, steps=600, evaluated_as="dflash_b16_before")
    done, result = table(tmp_path, steps)
    assert done.returncode == 0, done.stderr
    assert result["summary"]["train_steps"] == {"eagle3": 500, "dflash_b16": 600}
    # one run needs no digest (a table of one machine's drafts)
    single = tmp_path / "c"
    eval_folder(single, "dflash_b16", 1.5)
    done, result = table(tmp_path, single)
    assert done.returncode == 0, done.stderr
    assert result["features_sha256"] is None


@pytest.mark.parametrize("second_listing, words", [(None, "no features.sha256"),
                                                    ("ffff  ./shards/shard-000000.safetensors\n",
                                                     "read different features")])
def test_runs_of_different_captures_or_without_a_digest_are_refused(tmp_path, second_listing, words):
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7)
    eval_folder(second, "domino_b16", 1.6)
    capture_listing(first)
    if second_listing is not None:
        capture_listing(second, second_listing)
    done, result = table(tmp_path, first, second)
    assert done.returncode != 0 and words in done.stderr and result is None


def test_a_draft_evaluated_in_two_runs_is_refused_naming_both(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for run, accept in ((first, 1.5), (second, 1.6)):
        eval_folder(run, "dflash_b16", accept)
        capture_listing(run)
    done, result = table(tmp_path, first, second)
    assert done.returncode != 0 and f"eval_dflash_b16 is in both {first} and {second}" in done.stderr
    assert result is None


@pytest.mark.parametrize("other, words", [(dict(gpu="NVIDIA H200"), "card"), (dict(limit=8), "limit")])
def test_runs_evaluated_on_another_card_or_with_other_settings_are_refused(tmp_path, other, words):
    """Their speeds would sit in one table against one target-alone figure: refused, naming what differs."""
    first, second = tmp_path / "a", tmp_path / "b"
    eval_folder(first, "dflash2_b16", 1.7, alone=640.0)
    eval_folder(second, "domino_b16", 1.6, **other)
    for run in (first, second):
        capture_listing(run)
    done, result = table(tmp_path, first, second)
    assert done.returncode != 0 and result is None
    assert f"evaluated with another {words}: their speeds are not one table's" in done.stderr


def sweep_folder(run: Path, draft: str, rows: list[tuple], best: str) -> None:
    """An sf-eval sweep output as benchmarks.sweep reads it: rows (setting, set, fields, accept, tok/s)."""
    folder = run / f"sweep_{draft}"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({
        "rows": [{"setting": name, "set": s, **fields, "verify_width": 0, "accept_length": accept,
                  "accept_rate_by_position": [], "draft_ms_per_round": 1.0, "target_ms_per_round": 1.0,
                  "tokens_per_s": speed} for name, s, fields, accept, speed in rows],
        "target_alone_tokens_per_s": {"chat": 600.0, "code": 610.0}, "best": best,
        "wall_s": {name: 10.0 for name, *_ in rows}, "serve": {"sglang": f"--{draft}", "vllm": None}}))


def test_the_sweep_table_compares_the_best_with_the_chain_and_the_static_tree_with_the_dynamic(tmp_path):
    """benchmarks.sweep: the best EAGLE-3 setting against the chain k=7 on every set (here it loses on
    code), the static tree beside the most accepting dynamic tree of N <= 64 (N=65 and chains left
    out), the sweep steps' seconds from the plan's status.tsv (a skipped step left out), and a sweep
    cut off before its sweep.json named in `unfinished`, the others' table still written."""
    chain, tree8, tree65 = (dict(num_steps=7, topk=1, num_draft_tokens=8), dict(num_steps=5, topk=4, num_draft_tokens=8),
                            dict(num_steps=8, topk=8, num_draft_tokens=65))
    sweep_folder(tmp_path, "eagle3", [("S7_K1_N8", "chat", chain, 3.0, 500.0), ("S7_K1_N8", "code", chain, 3.5, 520.0),
                                      ("S5_K4_N8", "chat", tree8, 2.5, 560.0), ("S5_K4_N8", "code", tree8, 2.6, 510.0),
                                      ("S8_K8_N65", "chat", tree65, 4.0, 300.0), ("S8_K8_N65", "code", tree65, 4.1, 300.0)],
                 best="S5_K4_N8")
    sweep_folder(tmp_path, "dflash_b16", [("k7", "chat", dict(k=7), 1.5, 450.0), ("k7", "code", dict(k=7), 1.7, 470.0)],
                 best="k7")
    tree = tmp_path / "eval_eagle3_tree"
    tree.mkdir()
    (tree / "eval.json").write_text(json.dumps({"config": {"tree": [8, 4, 2, 1, 1, 1, 1]}, "sets": {
        s: {"trained": {"accept_length": a, "tokens_per_s": 400.0}} for s, a in (("chat", 3.1), ("code", 3.3))}}))
    (tmp_path / "sweep_peagle_k7" / "k3").mkdir(parents=True)  # a sweep cut off before its sweep.json
    status = tmp_path / "status.tsv"
    status.write_text("sweep_eagle3\t0\t100\t400\t300\nsweep_dflash_b16\tskipped\t400\t-\t-\n")
    out = tmp_path / "sweep.json"
    done = benchmark("benchmarks.sweep", tmp_path, "--status", status, "--out", out)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["best"]["eagle3"]["tokens_per_s"] == {"chat": 560.0, "code": 510.0}
    assert summary["best"]["eagle3"]["target_alone_tokens_per_s"] == {"chat": 600.0, "code": 610.0}
    assert summary["best_vs_chain_k7"]["at_least_chain_on_every_set"] is False  # 510 < 520 on code
    dynamic = summary["static_tree_vs_dynamic"]
    assert {s: (d["dynamic_setting"], d["static_accept_length"]) for s, d in dynamic.items()} == {
        "chat": ("S5_K4_N8", 3.1), "code": ("S5_K4_N8", 3.3)}
    assert summary["wall_s"]["eagle3"] == {"settings": 3, "settings_runs_s": 30.0, "step_s": 300.0}
    assert summary["wall_s"]["dflash_b16"]["step_s"] is None
    assert summary["unfinished"] == ["peagle_k7"] and "peagle_k7" not in summary["best"]


def test_the_table_gatherers_never_import_torch():
    """They only read reports (their results record the reports' machine): importing torch cost each
    of these subprocesses about two seconds of the test run."""
    code = ("import sys, benchmarks.families, benchmarks.sweep, benchmarks.objectives, benchmarks.modes; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
