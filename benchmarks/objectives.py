"""Token losses side by side (issue 40): gathers the sf-eval reports of scripts/objectives_gpu.sh
into benchmarks/results/objectives.json and prints the tables.

    python -m benchmarks.objectives RUN [--out objectives]

RUN holds one sf-eval folder per draft, eval_<draft> (eval_eagle3_ce_seed0, eval_eagle3_lk_alpha_seed1,
eval_dflash_ce, eval_dflash_lk_lambda, ...), and optionally curve_eagle3/, a --keep-best run.
summary:
    accept_length        {draft: {set: acceptance length}}
    mean_accept_length   {variant: {set: mean over its seeds}} (variant: the draft without _seedN)
    seed_spread          {variant: {set: max - min over its seeds}}
    vs_ce_pct            {variant: {set: 100 * (mean / the same family's ce mean - 1)}}
    best_lk              the EAGLE-3 LK variant ahead of ce on the most sets, and on how many it is
                         at least 3% ahead by more than the larger of the two seed spreads
    curve                the held-out simulated acceptance length per evaluation of curve_eagle3,
                         the step --keep-best kept and its value against the last evaluation's
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import print_table, write_result
from benchmarks.families import gather

SEED = re.compile(r"_seed\d+$")
BAR_PCT = 3.0  # issue 40: the best LK variant at least 3% above ce, beyond the seed spread


def variant(draft: str) -> str:
    return SEED.sub("", draft)


def family_ce(name: str) -> str:
    return "eagle3_ce" if name.startswith("eagle3") else "dflash_ce"


def summarise(rows: list[dict]) -> dict:
    accept: dict[str, dict[str, float]] = {}
    for r in rows:
        accept.setdefault(r["draft"], {})[r["set"]] = r["accept_length"]
    by_variant: dict[str, list[dict[str, float]]] = {}
    for draft, sets in accept.items():
        by_variant.setdefault(variant(draft), []).append(sets)
    sets = sorted({s for v in accept.values() for s in v})
    mean = {v: {s: sum(d[s] for d in ds) / len(ds) for s in sets if all(s in d for d in ds)}
            for v, ds in by_variant.items()}
    spread = {v: {s: max(d[s] for d in ds) - min(d[s] for d in ds) for s in sets if all(s in d for d in ds)}
              for v, ds in by_variant.items()}
    vs_ce = {v: {s: 100 * (m[s] / mean[family_ce(v)][s] - 1) for s in m if s in mean.get(family_ce(v), {})}
             for v, m in mean.items() if v != family_ce(v) and family_ce(v) in mean}
    best = None
    lk = [v for v in vs_ce if v.startswith("eagle3_")]
    if lk:
        name = max(lk, key=lambda v: (sum(x > 0 for x in vs_ce[v].values()), sum(vs_ce[v].values())))
        beyond = [s for s, pct in vs_ce[name].items()
                  if pct >= BAR_PCT and mean[name][s] - mean["eagle3_ce"][s]
                  > max(spread[name].get(s, 0.0), spread["eagle3_ce"].get(s, 0.0))]
        best = {"variant": name, "sets_ahead": sum(x > 0 for x in vs_ce[name].values()),
                "sets_3pct_beyond_spread": beyond, "bar_met": len(beyond) >= 3}
    return {"accept_length": accept, "mean_accept_length": mean, "seed_spread": spread, "vs_ce_pct": vs_ce,
            "best_lk": best}


def curve(run: Path) -> dict | None:
    folder = run / "curve_eagle3"
    history, record = folder / "history.json", folder / "export" / "specfoundry_training.json"
    if not (history.is_file() and record.is_file()):
        return None
    points = [{"step": h["step"], "eval_sim_accept_len": h["eval_sim_accept_len"]}
              for h in json.loads(history.read_text()) if "eval_sim_accept_len" in h]
    return {"points": points, "kept": json.loads(record.read_text())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", default="objectives", help="The result file's name under benchmarks/results.")
    args = ap.parse_args()
    rows = gather(args.run)
    summary = summarise(rows)
    summary["curve"] = curve(args.run)
    print_table(rows, ["draft", "set", "prompts", "accept_length", "greedy_equal"])
    table = [{"variant": v, **{s: f"{m:.3f} ({summary['vs_ce_pct'].get(v, {}).get(s, 0.0):+.1f}%)"
                               for s, m in sets.items()}} for v, sets in summary["mean_accept_length"].items()]
    print_table(table, ["variant", *sorted({s for r in rows for s in [r["set"]]})])
    print("best LK variant:", summary["best_lk"])
    if summary["curve"]:
        print("curve:", summary["curve"]["points"], "kept:", summary["curve"]["kept"])
    print(write_result(args.out, rows, {"summary": summary}))


if __name__ == "__main__":
    main()
