"""Acceptance per serving mode: gathers the sf-eval reports of `scripts/measure_gpu.sh modes`
into benchmarks/results/modes.json and prints the table.

    python -m benchmarks.modes RUN [--out modes]

RUN holds one sf-eval folder per trained mode, eval_<mode> (eval_nothink, eval_think), each run
with --modes, so its sets are named "SET [MODE]" (SET [enable_thinking=false], ...).
summary:
    accept_length   {trained mode: {evaluated mode: {set: acceptance length}}}
    mean            {trained mode: {evaluated mode: mean over the sets}}
    matched_gain_pct  {trained mode: 100 * (mean in its own mode / mean in the other mode - 1)},
                    where the evaluated modes include the trained one
The trained mode's evaluated twin: nothink is enable_thinking=false, think is enable_thinking=true.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.common import print_table, reports_environment, write_result
from benchmarks.families import gather

SET_AND_MODE = re.compile(r"^(?P<set>.+) \[(?P<mode>[^\]]+)\]$")
EVALUATED = {"nothink": "enable_thinking=false", "think": "enable_thinking=true"}


def split_set(name: str) -> tuple[str, str]:
    """'chat [enable_thinking=false]' -> ('chat', 'enable_thinking=false'); a set of a one-mode
    run has no mode in its name: an error, since this table compares modes."""
    m = SET_AND_MODE.match(name)
    if not m:
        raise SystemExit(f"set {name!r} names no mode: was its sf-eval run without --modes?")
    return m["set"], m["mode"]


def summarise(rows: list[dict]) -> dict:
    accept: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        accept.setdefault(r["draft"], {}).setdefault(r["mode"], {})[r["prompt_set"]] = r["accept_length"]
    mean = {t: {m: sum(s.values()) / len(s) for m, s in modes.items()} for t, modes in accept.items()}
    gain = {}
    for trained, modes in mean.items():
        own = EVALUATED.get(trained)
        others = [m for m in modes if m != own]
        if own in modes and len(others) == 1:
            gain[trained] = 100 * (modes[own] / modes[others[0]] - 1)
    return {"accept_length": accept, "mean": mean, "matched_gain_pct": gain}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", default="modes", help="The result file's name under benchmarks/results.")
    args = ap.parse_args()
    rows = gather(args.run)
    for r in rows:
        r["prompt_set"], r["mode"] = split_set(r["set"])
    summary = summarise(rows)
    print_table(rows, ["draft", "mode", "prompt_set", "prompts", "accept_length", "greedy_equal"])
    sets = sorted({r["prompt_set"] for r in rows})
    table = [{"trained": t, "evaluated": m, **{s: f"{a[s]:.3f}" for s in sets if s in a},
              "mean": f"{summary['mean'][t][m]:.3f}"}
             for t, modes in summary["accept_length"].items() for m, a in modes.items()]
    print_table(table, ["trained", "evaluated", *sets, "mean"])
    print("acceptance in the trained mode against the other (%):", summary["matched_gain_pct"])
    print(write_result(args.out, rows, {"summary": summary}, measured_on=reports_environment(args.run)))


if __name__ == "__main__":
    main()
