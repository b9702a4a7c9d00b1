"""sf-eval's report: a prompt set's decodes summarised (acceptance length, acceptance by position, the
time of each phase, tokens/s), and the table, eval.json and the acceptance plot written from it."""

from __future__ import annotations

import sys
from pathlib import Path

from specfoundry.common.files import atomic_write_bytes, atomic_write_json
from specfoundry.decoding.rounds import DecodeResult
from specfoundry.decoding.tree import shape_name


def summarise_set(results: list[DecodeResult], k: int) -> dict:
    accepted = [a for r in results for a in r.accepted]
    rounds = len(accepted)
    reached = [sum(a >= j for a in accepted) for j in range(k)]  # rounds whose draft j+1 was verified
    kept = [sum(a >= j + 1 for a in accepted) for j in range(k)]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.total_s for r in results)
    return {
        "prompts": len(results),
        "rounds": rounds,
        "tokens": tokens,
        "accept_length": (sum(accepted) + rounds) / max(rounds, 1),
        "accept_rate_by_position": [kept[j] / reached[j] if reached[j] else None for j in range(k)],
        "draft_ms_per_round": 1e3 * sum(r.draft_s for r in results) / max(rounds, 1),
        "target_ms_per_round": 1e3 * sum(r.target_s for r in results) / max(rounds, 1),
        # the rest of a decode's time, so that the parts account for tokens_per_s: the prompt's
        # reads, and what is outside every phase, per round though part of it comes once a prompt:
        # the host's work between phases (on a GPU only where the device waited for it), before the
        # first and after the last
        "prefill_ms_per_prompt": 1e3 * sum(r.prefill_s for r in results) / max(len(results), 1),
        "start_ms_per_prompt": 1e3 * sum(r.start_s for r in results) / max(len(results), 1),
        "other_ms_per_round": 1e3 * sum(r.total_s - r.draft_s - r.target_s - r.prefill_s - r.start_s
                                        for r in results) / max(rounds, 1),
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def format_table(report: dict) -> str:
    k = report["config"]["k"]
    head = (f"{'set':<10} {'draft':<9} {'accept len':>10} " + " ".join(f"{'p' + str(j + 1):>5}" for j in range(k))
            + f" {'draft ms':>9} {'target ms':>9} {'tok/s':>8} {'alone':>8} {'speedup':>7} {'greedy==target':>14}")
    lines = [head, "-" * len(head)]
    for name, entry in report["sets"].items():
        for label in ("trained", "untrained"):
            s = entry.get(label)
            if s is None:
                continue
            rates = " ".join(f"{r:5.2f}" if r is not None else "    -" for r in s["accept_rate_by_position"])
            alone = entry.get("target_alone_tokens_per_s")
            lines.append(f"{name:<10} {label:<9} {s['accept_length']:>10.2f} {rates} {s['draft_ms_per_round']:>9.1f} "
                         f"{s['target_ms_per_round']:>9.1f} {s['tokens_per_s']:>8.1f} "
                         f"{alone if alone is not None else float('nan'):>8.1f} {s.get('speedup', float('nan')):>7.2f} "
                         f"{s.get('identical_to_target', '-'):>14}")
    lines.append(report["convention"])
    lines.append(f"p1..p{k}: at draft position j, the share of the rounds that reached it (every draft token before "
                 "it accepted) in which it was accepted too")
    dropped = [entry["target_alone_dropped_steps"] for entry in report["sets"].values() if "target_alone_dropped_steps" in entry]
    if dropped:
        lines.append(f"alone = the target alone; its greedy read-back ran {sum(dropped)} steps after an eos in all "
                     "(dropped, their time counted)")
    outside = [f"{name} {s['prefill_ms_per_prompt']:.1f} + {s['start_ms_per_prompt']:.1f} ms, "
               f"{s['other_ms_per_round']:.2f} ms"
               for name, entry in report["sets"].items() if "other_ms_per_round" in (s := entry.get("trained", {}))]
    if outside:
        lines.append("outside the rounds (trained; a prompt: the target's prefill + the draft's read of it; a round: "
                     f"the time outside every phase): {'; '.join(outside)}")
    if "wall_s" in report:
        sets = ", ".join(f"{name} {entry['wall_s']:.1f} s" for name, entry in report["sets"].items() if "wall_s" in entry)
        warm = report.get("warm_up_s")
        warm = f"; warm-up {warm:.1f} s, its graph captures and compiles included" if warm is not None else ""
        lines.append(f"wall time: {sets}; the whole run {report['wall_s']:.1f} s (loading and warm-up included{warm})")
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "eval.json", report)
    atomic_write_bytes(out / "eval.txt", (format_table(report) + "\n").encode())
    atomic_write_json(out / "eval_config.json", report["config"])  # the record check_output_folder reads: last
    plot_acceptance(report, out / "acceptance.png")


def plot_acceptance(report: dict, path: Path) -> bool:
    """Acceptance rate by draft position, one line per set (and draft). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'specfoundry[plot]')", file=sys.stderr)
        return False
    k = report["config"]["k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entry in report["sets"].items():
        for label, style in (("trained", "-o"), ("untrained", ":x")):
            if label in entry:
                rates = [r if r is not None else float("nan") for r in entry[label]["accept_rate_by_position"]]
                ax.plot(range(1, k + 1), rates, style,
                        label=f"{name} ({label}, accept len {entry[label]['accept_length']:.2f})")
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(draft j accepted | 1..j-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, k + 1))
    ax.legend(fontsize=7)
    shape = shape_name(k, report["config"].get("tree"))
    ax.set_title(f"acceptance by position, {shape}, T={report['config']['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
