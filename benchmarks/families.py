"""Draft families side by side: gathers the sf-eval reports of scripts/families_gpu.sh into
benchmarks/results/families.json and prints one table.

    python -m benchmarks.families RUN

RUN holds one sf-eval output folder per draft, `eval_<draft>` (eval_eagle3_chain_k7,
eval_eagle3_tree, eval_dflash_b16, ...), each with its eval.json. Every figure comes from those
reports: acceptance length per held-out set (tokens per target verify forward, the target's own
token counted), tokens/s with the draft and, where the report decoded the target alone too,
without it. The summary's `accept_length` maps each draft to {set: accept length}, and its
`tokens_per_s` each draft to {set: tokens/s with the draft}, plus `target_alone` {set: tokens/s}
(the first report that decoded the target alone on that set).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import print_table, write_result

PREFIX = "eval_"


def gather(run: Path) -> list[dict]:
    """One row per (draft, set) from RUN/eval_<draft>/eval.json, drafts in name order."""
    rows = []
    for folder in sorted(p for p in run.glob(f"{PREFIX}*") if p.is_dir()):
        report_path = folder / "eval.json"
        if not report_path.is_file():
            raise SystemExit(f"{folder}: no eval.json (an unfinished sf-eval run? rerun its command)")
        report = json.loads(report_path.read_text())
        if "family" not in report:  # never guessed: a draft of another family would be mislabelled
            raise SystemExit(f"{report_path}: names no draft family (rerun its sf-eval command)")
        draft = folder.name[len(PREFIX):]
        for name, entry in report["sets"].items():
            s = entry["trained"]
            rows.append({"draft": draft, "family": report["family"],
                         "shape": report["config"]["tree"] or f"k={report['config']['k']}", "set": name,
                         "prompts": s["prompts"], "accept_length": s["accept_length"],
                         "tokens_per_s": s["tokens_per_s"], "alone_tokens_per_s": entry.get("target_alone_tokens_per_s"),
                         "speedup": s.get("speedup"), "greedy_equal": s.get("identical_to_target"),
                         "device": report.get("environment", {}).get("gpu") or report.get("device")})
    if not rows:
        raise SystemExit(f"{run}: no {PREFIX}<draft> folder with an eval.json")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the folder scripts/families_gpu.sh wrote (its RUN)")
    parser.add_argument("--out", default="families", help="result file name under benchmarks/results")
    args = parser.parse_args()
    rows = gather(args.run)
    print_table(rows, ["draft", "shape", "set", "prompts", "accept_length", "tokens_per_s", "alone_tokens_per_s",
                       "speedup", "greedy_equal"])
    accept, speed = {}, {}
    for r in rows:
        accept.setdefault(r["draft"], {})[r["set"]] = r["accept_length"]
        speed.setdefault(r["draft"], {})[r["set"]] = r["tokens_per_s"]
        if r["alone_tokens_per_s"] is not None:
            speed.setdefault("target_alone", {}).setdefault(r["set"], r["alone_tokens_per_s"])
    path = write_result(args.out, rows, {"summary": {"accept_length": accept, "tokens_per_s": speed}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
