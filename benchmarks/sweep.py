"""The serving sweeps of `scripts/measure_gpu.sh sweep` side by side: gathers each draft's `sf-eval
sweep` folder and EAGLE-3's static-tree run into benchmarks/results/sweep.json and prints one table.

    python -m benchmarks.sweep RUN [--status STATUS_TSV] [--out sweep]

RUN holds `sweep_<draft>/sweep.json` per draft (sweep_eagle3, sweep_dflash_b16, ...: `sf-eval sweep`
over every built-in prompt, one sf-eval run a setting, the target decoding alone in the first; a
folder without one is named in `unfinished` and left out) and
`eval_eagle3_tree/eval.json` (the same EAGLE-3 draft decoding the full static tree 8,4,2,1,1,1,1).
The rows are the sweeps' own, one per (draft, setting, prompt set). The summary gives:

- `best`: per draft its best setting over all sets (the highest mean tokens/s, as sf-eval sweep
  picks it) with its acceptance length and tokens/s per set, the target alone's tokens/s per set,
  and the SGLang and vLLM flags that serve it;
- `best_vs_chain_k7`: EAGLE-3's best setting's tokens/s against the chain k=7's (S7_K1_N8) per set,
  and whether the best is at least the chain on every set;
- `static_tree_vs_dynamic`: per set the static tree's acceptance length beside the dynamic tree's
  (an EAGLE-3 setting with K > 1 and N at most DYNAMIC_MOST) whose acceptance is highest there:
  acceptance only, as the plan decodes the static tree with its target uncompiled (its verify
  widths, one per accepted depth, would each compile for minutes; the compiled and uncompiled
  steps round differently, which moves a bf16 acceptance a little where near-ties fall);
- `wall_s`: per draft the settings swept and the seconds of their sf-eval runs (the runs' own
  `wall_s`, warm-up and every set), and, with --status (the plan's status.tsv), the whole `sf-eval
  sweep` step's seconds (the target's load and compile included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import print_table, reports_environment, write_result

CHAIN_K7 = "S7_K1_N8"
DYNAMIC_MOST = 64  # the most tokens a round (N, SGLang's --speculative-num-draft-tokens) of the dynamic
# trees compared with the static one


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"{path}: missing (an unfinished run? rerun its command)")
    return json.loads(path.read_text())


def sweeps(run: Path) -> tuple[dict[str, dict], list[str]]:
    """({draft: its sweep.json} from RUN/sweep_<draft>/, the drafts whose sweep has no sweep.json yet:
    failed or cut off, left out of the table and named, so that one draft's sweep never costs the
    others' their table)."""
    found, unfinished = {}, []
    for folder in sorted(p for p in run.glob("sweep_*") if p.is_dir()):
        draft = folder.name.removeprefix("sweep_")
        if (folder / "sweep.json").is_file():
            found[draft] = read_json(folder / "sweep.json")
        else:
            unfinished.append(draft)
            print(f"{folder}: no sweep.json (failed or cut off): left out", file=sys.stderr)
    if not found:
        raise SystemExit(f"{run}: no sweep_<draft>/sweep.json")
    return found, unfinished


def step_seconds(status: Path | None) -> dict[str, float]:
    """{step name: seconds} of the plan's status.tsv (step, rc, start, end, seconds); skipped steps left out."""
    if status is None:
        return {}
    out = {}
    for line in status.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) == 5 and fields[1] == "0" and fields[4].isdigit():
            out[fields[0]] = float(fields[4])
    return out


def per_set(rows: list[dict], setting: str, key: str) -> dict[str, float]:
    return {r["set"]: r[key] for r in rows if r["setting"] == setting}


def summary(found: dict[str, dict], tree: dict | None, steps: dict[str, float]) -> dict:
    best = {}
    for draft, s in found.items():
        best[draft] = {"setting": s["best"], "accept_length": per_set(s["rows"], s["best"], "accept_length"),
                       "tokens_per_s": per_set(s["rows"], s["best"], "tokens_per_s"),
                       "target_alone_tokens_per_s": s["target_alone_tokens_per_s"], "serve": s["serve"]}
    out = {"best": best,
           "wall_s": {draft: {"settings": len(s["wall_s"]), "settings_runs_s": sum(v or 0 for v in s["wall_s"].values()),
                              "step_s": steps.get(f"sweep_{draft}")} for draft, s in found.items()}}
    eagle3 = found.get("eagle3")
    if eagle3 is not None and any(r["setting"] == CHAIN_K7 for r in eagle3["rows"]):
        chain = per_set(eagle3["rows"], CHAIN_K7, "tokens_per_s")
        ours = best["eagle3"]["tokens_per_s"]
        out["best_vs_chain_k7"] = {"best": eagle3["best"], "best_tokens_per_s": ours, "chain_k7_tokens_per_s": chain,
                                   "at_least_chain_on_every_set": all(ours[k] >= v for k, v in chain.items())}
    if eagle3 is not None and tree is not None:
        dynamic = [r for r in eagle3["rows"] if r.get("topk", 1) > 1 and r["num_draft_tokens"] <= DYNAMIC_MOST]
        compare = {}
        for set_name, entry in tree["sets"].items():
            candidates = [r for r in dynamic if r["set"] == set_name]
            top = max(candidates, key=lambda r: r["accept_length"]) if candidates else None
            compare[set_name] = {"static_tree": tree["config"]["tree"],
                                 "static_accept_length": entry["trained"]["accept_length"],
                                 "dynamic_setting": top and top["setting"],
                                 "dynamic_accept_length": top and top["accept_length"]}
        out["static_tree_vs_dynamic"] = compare
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the folder `scripts/measure_gpu.sh sweep` wrote ($EV/run/sweep)")
    parser.add_argument("--status", type=Path, default=None,
                        help="the plan's status.tsv: the sweep steps' whole seconds (default: none, the runs' own)")
    parser.add_argument("--out", default="sweep", help="result file name under benchmarks/results")
    args = parser.parse_args()
    found, unfinished = sweeps(args.run)
    tree_report = args.run / "eval_eagle3_tree" / "eval.json"
    tree = read_json(tree_report) if tree_report.exists() else None
    rows = [{"draft": draft, **{k: v for k, v in r.items() if k != "accept_rate_by_position"},
             "accept_rate_by_position": r["accept_rate_by_position"]} for draft, s in found.items() for r in s["rows"]]
    print_table(rows, ["draft", "setting", "set", "verify_width", "accept_length", "draft_ms_per_round",
                       "target_ms_per_round", "tokens_per_s"])
    result = {**summary(found, tree, step_seconds(args.status)), "unfinished": unfinished}
    for draft, b in result["best"].items():
        print(f"{draft}: best {b['setting']}; SGLang {b['serve']['sglang']}; vLLM {b['serve']['vllm']}")
    print(json.dumps({k: v for k, v in result.items() if k != "best"}, indent=1))
    measured_on = reports_environment(args.run, reports="sweep_*/*/eval.json")  # each setting's sf-eval run
    print(f"wrote {write_result(args.out, rows, {'summary': result}, measured_on=measured_on)}")


if __name__ == "__main__":
    main()
