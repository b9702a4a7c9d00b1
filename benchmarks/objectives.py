"""Token losses side by side: gathers the sf-eval reports of `scripts/measure_gpu.sh objectives`
into benchmarks/results/objectives.json and prints the tables.

    python -m benchmarks.objectives RUN [--out objectives] [--with-run EARLIER]

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
    data                 what the drafts trained on: samples, tokens, and a hash of the samples'
                         token ids and loss masks (each shard's source_sha256, in order)
--with-run EARLIER adds the drafts of an earlier run of the same comparison (one machine's time
may hold only part of it): a folder of its eval_<draft>/eval.json files, its curve_eagle3/ and
its features/ manifest.json or fingerprint.json (what `--keep-run DEST` copies out of a run). Its data must be this run's
(the same samples, token for token), else the two are not one comparison and nothing is written.
Only the data are compared: that the drafts trained for the same epochs with the same recipe is
the caller's to keep (the commands of both runs are in their logs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

from benchmarks.common import print_table, reports_environment, write_result
from benchmarks.families import gather

SEED = re.compile(r"_seed\d+$")
BAR_PCT = 3.0  # the best LK variant at least 3% above ce, beyond the seed spread, to replace it as the default


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


def fingerprint(run: Path) -> dict | None:
    """RUN/features' samples, tokens and the hash of its shards' source_sha256 (the samples' ids,
    token ids and loss masks, capture/stage.py's samples_sha256), from manifest.json, or from
    fingerprint.json where only that was kept; None where neither is."""
    folder = run / "features"
    if (folder / "manifest.json").is_file():
        manifest = json.loads((folder / "manifest.json").read_text())
        shards = manifest["shards"]
        return {"samples": sum(s["num_samples"] for s in shards), "tokens": sum(s["num_tokens"] for s in shards),
                "samples_sha256": hashlib.sha256("".join(s["source_sha256"] for s in shards).encode()).hexdigest()}
    if (folder / "fingerprint.json").is_file():
        return json.loads((folder / "fingerprint.json").read_text())
    return None


def known_fingerprint(run: Path) -> dict:
    """fingerprint(run), which --with-run and --keep-run cannot do without."""
    found = fingerprint(run)
    if found is None:
        raise SystemExit(f"{run / 'features'}: neither manifest.json nor fingerprint.json (not a run of "
                         "`scripts/measure_gpu.sh objectives`?)")
    return found


def with_run(rows: list[dict], run: Path, earlier: Path) -> list[dict]:
    """rows and the earlier run's rows of drafts this run lacks, both trained on the same data."""
    mine, theirs = known_fingerprint(run), known_fingerprint(earlier)
    if mine != theirs:
        raise SystemExit(f"{earlier} trained on other data than {run} ({theirs} against {mine}): "
                         "not one comparison")
    have = {r["draft"] for r in rows}
    return rows + [r for r in gather(earlier) if r["draft"] not in have]


def keep_run(run: Path, dest: Path) -> None:
    """Copy what --with-run reads out of RUN into DEST, small enough to commit: the sf-eval
    reports, curve_eagle3's history and training record, and features/fingerprint.json."""
    files = [p.relative_to(run) for p in sorted(run.glob("eval_*/eval.json"))]
    files += [Path("curve_eagle3/history.json"), Path("curve_eagle3/export/specfoundry_training.json")]
    for rel in files:
        if (run / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run / rel, dest / rel)
    (dest / "features").mkdir(parents=True, exist_ok=True)
    (dest / "features" / "fingerprint.json").write_text(json.dumps(known_fingerprint(run), indent=1) + "\n")


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
    ap.add_argument("--with-run", type=Path, help="An earlier run of the same comparison whose drafts join "
                                                  "this run's (the same data required; see above).")
    ap.add_argument("--keep-run", type=Path, metavar="DEST",
                    help="Copy what --with-run reads out of RUN into DEST (small enough to commit), then stop.")
    args = ap.parse_args()
    if args.keep_run:
        keep_run(args.run, args.keep_run)
        print(f"kept {args.run}'s reports, curve and data fingerprint in {args.keep_run}")
        return
    rows = gather(args.run)
    if args.with_run:
        rows = with_run(rows, args.run, args.with_run)
    summary = summarise(rows)
    summary["curve"] = curve(args.run) or (curve(args.with_run) if args.with_run else None)
    summary["data"] = fingerprint(args.run)
    print_table(rows, ["draft", "set", "prompts", "accept_length", "greedy_equal"])
    table = [{"variant": v, **{s: f"{m:.3f} ({summary['vs_ce_pct'].get(v, {}).get(s, 0.0):+.1f}%)"
                               for s, m in sets.items()}} for v, sets in summary["mean_accept_length"].items()]
    print_table(table, ["variant", *sorted({s for r in rows for s in [r["set"]]})])
    print("best LK variant:", summary["best_lk"])
    if summary["curve"]:
        print("curve:", summary["curve"]["points"], "kept:", summary["curve"]["kept"])
    print(write_result(args.out, rows, {"summary": summary}, measured_on=reports_environment(args.run)))


if __name__ == "__main__":
    main()
