"""Draft families side by side: gathers the sf-eval reports of `scripts/measure_gpu.sh families` into
benchmarks/results/families.json and prints one table.

    python -m benchmarks.families RUN [RUN ...] [--each-alone] [--out families]

RUN holds one sf-eval output folder per draft, `eval_<draft>` (eval_eagle3_chain_k7,
eval_eagle3_tree, eval_dflash_b16, ...), each with its eval.json: the acceptance run over every
prompt. `--each-alone` says those runs decoded one at a time, each alone on the GPU (the families
plan's way): their speeds are comparable and are the table's. Otherwise (runs side by side) a
`timing_<draft>` folder per draft (each draft decoding alone on the first prompts of every set)
gives the speeds, or, without them, the acceptance runs' own, which are not comparable between
drafts (the summary's `tokens_per_s_from` says which). Every figure comes from those reports:
acceptance length per held-out set (tokens per target verify forward, the target's own token
counted), draft and target ms per round, tokens/s with the draft and, where the report decoded
the target alone too, without it; the rows also carry the time outside the rounds where the
report has it (prefill and the draft's start, ms a prompt; the rest, ms a round). The summary's
`accept_length` maps each draft to {set: accept length}, its `tokens_per_s` each draft to {set:
tokens/s with the draft} plus `target_alone` {set: tokens/s} (the first report that decoded the
target alone on that set), its `accept_rate_by_position` each draft to {set: [the share of the
rounds reaching draft position j whose token was accepted, j = 1..k]}, its `train_steps` each draft to
the optimizer steps its sf-train run recorded (where RUN holds that run's folder).

Several RUN folders join into one table when they read the same features: each holds the digest
`scripts/measure_gpu.sh` wrote of its capture's arrays (features.sha256, a sha256sum listing), and
the runs' listings must be equal (drafts trained on two machines from captures of the same
conversations), and so must their evaluations' card and settings (EVAL_SETTINGS), so that every
speed in the table is one card's at one setting; a draft evaluated in two of them is refused. The
result records the digest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import print_table, reports_environment, write_result

ACCEPTANCE, TIMING = "eval_", "timing_"


def gather(run: Path, prefix: str = ACCEPTANCE) -> list[dict]:
    """One row per (draft, set) from RUN/<prefix><draft>/eval.json, drafts in name order."""
    rows = []
    for folder in sorted(p for p in run.glob(f"{prefix}*") if p.is_dir()):
        report_path = folder / "eval.json"
        if not report_path.is_file():
            raise SystemExit(f"{folder}: no eval.json (an unfinished sf-eval run? rerun its command)")
        report = json.loads(report_path.read_text())
        if "family" not in report:  # never guessed: a draft of another family would be mislabelled
            raise SystemExit(f"{report_path}: names no draft family (rerun its sf-eval command)")
        draft = folder.name[len(prefix):]
        steps = report.get("draft_training_steps") or train_steps(run, report["config"].get("draft"), draft)
        for name, entry in report["sets"].items():
            s = entry["trained"]
            rows.append({"draft": draft, "family": report["family"], "train_steps": steps,
                         "shape": report["config"]["tree"] or f"k={report['config']['k']}", "set": name,
                         "prompts": s["prompts"], "accept_length": s["accept_length"],
                         "draft_ms_per_round": s.get("draft_ms_per_round"),
                         "target_ms_per_round": s.get("target_ms_per_round"),
                         # (reports before these keys have none)
                         "prefill_ms_per_prompt": s.get("prefill_ms_per_prompt"),
                         "start_ms_per_prompt": s.get("start_ms_per_prompt"),
                         "other_ms_per_round": s.get("other_ms_per_round"),
                         "tokens_per_s": s["tokens_per_s"], "alone_tokens_per_s": entry.get("target_alone_tokens_per_s"),
                         "speedup": s.get("speedup"), "greedy_equal": s.get("identical_to_target"),
                         "accept_rate_by_position": s.get("accept_rate_by_position"),
                         "device": report.get("environment", {}).get("gpu") or report.get("device")})
    if not rows and prefix == ACCEPTANCE:
        raise SystemExit(f"{run}: no {prefix}<draft> folder with an eval.json")
    return rows


def train_steps(run: Path, evaluated: str | None, draft: str) -> int | None:
    """The optimizer steps of a draft whose report predates its `draft_training_steps`: its sf-train run folder
    in RUN (the plan keeps them side by side) records them in train_summary.json. The folder is found
    by the name it had where it was evaluated, else by the draft's name in the table (a folder renamed
    since); None where neither is there."""
    for name in (Path(evaluated or "").name, draft):
        summary = run / name / "train_summary.json"
        if name and summary.is_file():
            return json.loads(summary.read_text()).get("steps")
    return None


DIGEST = "features.sha256"


def features_digest(runs: list[Path]) -> str | None:
    """The digest of the runs' one capture (sha256 of its listing), None for a single run without one;
    exits naming the run whose capture differs or has no digest."""
    import hashlib

    listings = {run: (run / DIGEST).read_text() if (run / DIGEST).is_file() else None for run in runs}
    if len(runs) == 1 and listings[runs[0]] is None:
        return None
    for run, listing in listings.items():
        if listing is None:
            raise SystemExit(f"{run}: no {DIGEST}: runs join only when each names its capture's digest")
        if listing != listings[runs[0]]:
            raise SystemExit(f"{run}/{DIGEST} differs from {runs[0]}/{DIGEST}: the runs read different features")
    return hashlib.sha256(listings[runs[0]].encode()).hexdigest()


EVAL_SETTINGS = ("target", "prompt_sets", "limit", "max_new_tokens", "dtype", "temperature", "compile_target")
"""The sf-eval settings the joined runs must share (besides the card, the rows' `device`)."""


def eval_settings(run: Path, prefix: str) -> set[tuple]:
    """The (card, EVAL_SETTINGS values) of each of a run's reports."""
    out = set()
    for report in sorted(run.glob(f"{prefix}*/eval.json")):
        data = json.loads(report.read_text())
        device = data.get("environment", {}).get("gpu") or data.get("device")
        out.add((device, *(json.dumps(data["config"].get(k)) for k in EVAL_SETTINGS)))
    return out


def gather_runs(runs: list[Path], prefix: str = ACCEPTANCE) -> list[dict]:
    """gather() over several runs; a draft found in two of them, or runs evaluated on another card
    or with other settings, exit, naming them."""
    rows, where, settings = [], {}, {}
    for run in runs:
        found = gather(run, prefix) if len(runs) == 1 else _gather_any(run, prefix)
        for draft in sorted({r["draft"] for r in found}):
            if draft in where:
                raise SystemExit(f"{prefix}{draft} is in both {where[draft]} and {run}: keep one")
            where[draft] = run
        for setting in eval_settings(run, prefix):
            settings.setdefault(setting, run)
        if len(settings) > 1:
            (a, first), (b, second) = list(settings.items())[:2]
            differ = [name for name, x, y in zip(("card", *EVAL_SETTINGS), a, b, strict=True) if x != y]
            raise SystemExit(f"{first} and {second} were evaluated with another {', '.join(differ)}: their speeds "
                             "are not one table's")
        rows += found
    if not rows and prefix == ACCEPTANCE:
        raise SystemExit(f"{', '.join(map(str, runs))}: no {prefix}<draft> folder with an eval.json")
    return rows


def _gather_any(run: Path, prefix: str) -> list[dict]:
    """gather() that lets one of several runs hold no eval folder (the others may)."""
    return gather(run, prefix) if any(p.is_dir() for p in run.glob(f"{prefix}*")) else []


def summary(accept_rows: list[dict], timing_rows: list[dict], each_alone: bool = False) -> dict:
    """accept_length and accept_rate_by_position from the acceptance runs; tokens_per_s (and
    target_alone) from the timing runs where there are any, else from the acceptance runs."""
    speed_rows = timing_rows or accept_rows
    accept, by_position, speed, steps = {}, {}, {}, {}
    for r in accept_rows:
        accept.setdefault(r["draft"], {})[r["set"]] = r["accept_length"]
        if r.get("train_steps") is not None:
            steps[r["draft"]] = r["train_steps"]
        by_position.setdefault(r["draft"], {})[r["set"]] = r["accept_rate_by_position"]
    for r in speed_rows:
        speed.setdefault(r["draft"], {})[r["set"]] = r["tokens_per_s"]
        if r["alone_tokens_per_s"] is not None:
            speed.setdefault("target_alone", {}).setdefault(r["set"], r["alone_tokens_per_s"])
    source = ("timing (each draft alone)" if timing_rows else
              "acceptance runs (each draft alone)" if each_alone else "acceptance runs (side by side)")
    return {"accept_length": accept, "accept_rate_by_position": by_position, "tokens_per_s": speed,
            "tokens_per_s_from": source, "train_steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                        help="the folder `scripts/measure_gpu.sh families` wrote ($EV/run/families); several "
                             "join when their features.sha256 agree")
    parser.add_argument("--each-alone", action="store_true",
                        help="the eval_<draft> runs decoded one at a time, each alone on the GPU: their speeds are the table's")
    parser.add_argument("--out", default="families", help="result file name under benchmarks/results")
    args = parser.parse_args()
    digest = features_digest(args.runs)
    rows = gather_runs(args.runs)
    timing = gather_runs(args.runs, TIMING)
    if args.each_alone and timing:
        raise SystemExit(f"{', '.join(map(str, args.runs))}: --each-alone, but timing_<draft> folders are there "
                         "too: which speeds are the table's?")
    columns = ["draft", "train_steps", "shape", "set", "prompts", "accept_length", "draft_ms_per_round", "target_ms_per_round",
               "tokens_per_s", "alone_tokens_per_s", "speedup", "greedy_equal"]
    print("acceptance (the eval runs' prompts):")
    print_table(rows, columns)
    if timing:
        print("timing (each draft alone):")
        print_table(timing, columns)
    path = write_result(args.out, rows, {"timing_rows": timing, "features_sha256": digest,
                                         "summary": summary(rows, timing, args.each_alone)},
                        measured_on=reports_environment(*args.runs))  # one card: gather_runs checked
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
