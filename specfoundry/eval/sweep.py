"""sf-eval sweep: a draft decoded at each serving setting of its family, one sf-eval run a setting
over the same prompts with the target loaded once, reported side by side with the best setting.

The settings (`--settings`, else the family's defaults):
    EAGLE-3   SGLang's tree, S,K,N each (--speculative-num-steps, --speculative-eagle-topk,
              --speculative-num-draft-tokens; K = 1 is the chain of S tokens, N = S + 1)
    P-EAGLE   k, the proposals a round, at most its trained depths (3, 5, 7 and its own)
    blocks    k, the proposals a round: a block of k + 1 (DSpark: of k), at most the trained one, as
              the engines serve it (3, 7 and the trained block's)
Each setting's run writes OUTPUT/<setting>/ (eval.json, eval.txt) as `sf-eval run` does, so a
rerun skips the settings already done; the first one decodes the target alone too (its tokens/s
are every setting's yardstick). OUTPUT/sweep.json holds per setting and prompt set the acceptance
length, acceptance by position, draft and target ms a round and tokens/s; each setting's run's wall
seconds; the best setting per set and over all sets (the highest mean tokens/s); and the SGLang and
vLLM flags that serve the best one (serving_flags). sf-eval decodes one sequence at a time: what a
server under load gains from a setting is not what one sequence gains (docs/serving.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specfoundry.common.files import atomic_write_json
from specfoundry.common.settings import Settings, setting, shared
from specfoundry.common.shards import record_config
from specfoundry.common.target import EMBEDDED_DEFAULT, Target
from specfoundry.decoding.tree import EngineTree
from specfoundry.eval.evaluate import COMPILE_TARGET_HELP, PROMPTS_HELP, EvalConfig, run_eval, target_dtype
from specfoundry.eval.prompts import BUILTIN_SETS, EvalError
from specfoundry.families.folders import locate_draft

NOT_SWEPT = ("k", "tree", "num_steps", "topk", "num_draft_tokens", "compare_untrained", "tp")
"""sf-eval run's settings of a recipe's eval section that the sweep leaves out: the serving settings it
varies (the section's k is sf-eval run's chain), the untrained draft's comparison it never runs, and
tp at 1 (above 1: recipe_refusal)."""


def recipe_refusal(values: dict, where: str) -> str | None:
    """Why the recipe's eval section (`values`, from the file `where`) cannot drive a sweep, or None:
    a tp above 1, as the sweep decodes on one device. Any other setting of sf-eval run the sweep
    lacks (sampling, modes, ...) is refused by resolve_config as an unknown key."""
    tp = values.get("tp", 1)
    if tp != 1:
        return (f"{where}: eval: tp {tp}: sf-eval sweep decodes on one device (sf-eval run --tp spreads the target "
                "over several); sweep with a recipe whose target fits one")
    return None

EAGLE3_DEFAULTS = ("3,1,4", "5,1,6", "7,1,8", "5,4,8", "6,8,32")
"""SGLang's chains of 3, 5 and 7 and its trees (5,4,8 its Llama default)."""


def parse_settings(value) -> tuple[str, ...]:
    """--settings: space- or semicolon-separated settings ('3,1,4 5,4,8', or '3 7 15')."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else str(value).replace(";", " ").split()
    return tuple(str(x).strip() for x in items if str(x).strip())


@dataclass(frozen=True, kw_only=True)
class SweepConfig(Settings):
    """Settings of one sf-eval sweep (recorded in sweep.json)."""

    draft: str = setting(argument=True, help="An exported draft folder, an sf-train run folder, or one of its "
                         "checkpoints/step-N.")
    output: str = shared("output", resume=False)
    settings: tuple[str, ...] = setting(
        (), parse=parse_settings, resume=False, shown="the family's: EAGLE-3 3,1,4 5,1,6 7,1,8 5,4,8 6,8,32; P-EAGLE "
        "3, 5, 7 and its depths; a block drafter 3, 7 and its trained block's; each at most the trained one",
        help="The serving settings to decode at, space-separated: S,K,N for EAGLE-3, k for the others "
             "(docs/serving.md).")
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    prompt_sets: tuple[str, ...] = setting(BUILTIN_SETS, flags=("--prompts",), help=PROMPTS_HELP)
    max_new_tokens: int = shared("max_new_tokens", 128)
    limit: int | None = shared("limit", None)
    seed: int = shared("seed", 0)
    compile_target: bool = setting(False, help=COMPILE_TARGET_HELP)
    device: str | None = shared("device", None, resume=False)
    dtype: str | None = shared("dtype", None, choices=("float32", "bfloat16"), shown="sf-eval run's default")


def setting_options(family, settings: tuple[str, ...], draft_cfg) -> list[tuple[str, dict]]:
    """[(the setting's name, the EvalConfig fields it sets)] for the family of the draft; EvalError,
    one line, for a setting the family does not take."""
    if family.serves_engine_tree:
        out = []
        for s in settings or EAGLE3_DEFAULTS:
            try:
                steps, topk, tokens = (int(x) for x in s.split(","))
                EngineTree(steps, topk, tokens)
            except ValueError as e:
                raise EvalError(f"--settings {s!r}: an EAGLE-3 setting is S,K,N (SGLang's tree: {e})" if "," in s else
                                f"--settings {s!r}: an EAGLE-3 setting is S,K,N (SGLang's tree), not k") from None
            out.append((f"S{steps}_K{topk}_N{tokens}", dict(num_steps=steps, topk=topk, num_draft_tokens=tokens)))
        return out
    # the family's own k, at most its trained one: a block drafter's block less one (DSpark's block),
    # P-EAGLE's depths
    most = family.decode_settings(draft_cfg, k=1, tree=None, temperature=0.0, k_given=False, source="draft")[0]
    defaults = (3, 5, 7, most) if hasattr(draft_cfg, "num_depths") else (3, 7, most)
    ks = [int(s) for s in settings if s.isdigit()] if settings else sorted({k for k in defaults if k <= most})
    bad = [s for s in settings if not s.isdigit() or not 1 <= int(s) <= most]
    if bad:
        raise EvalError(f"--settings {bad[0]!r}: a {family.name} setting is k, the proposals a round, from 1 to {most}")
    return [(f"k{k}", dict(k=k)) for k in ks]


def run_sweep(cfg: SweepConfig, silent: bool = False, target: Target | None = None) -> dict:
    """Each setting's sf-eval run (skipped where its eval.json is there), then sweep.json."""
    ref = locate_draft(cfg.draft)
    options = setting_options(ref.provider, cfg.settings, ref.config)
    out = Path(cfg.output)
    record_config(out, "sweep", cfg)  # a rerun into it with another draft or prompts is refused, naming them
    common = dict(draft=cfg.draft, target=cfg.target, chat_template=cfg.chat_template, prompt_sets=cfg.prompt_sets,
                  max_new_tokens=cfg.max_new_tokens, limit=cfg.limit, seed=cfg.seed,
                  compile_target=cfg.compile_target, device=cfg.device, dtype=cfg.dtype)
    reports, earlier = {}, []
    for i, (name, fields) in enumerate(options):
        folder = out / name
        if (folder / "eval.json").is_file():
            reports[name] = json.loads((folder / "eval.json").read_text())
            earlier.append(name)
            continue
        run_cfg = EvalConfig(**common, **fields, baseline=i == 0, output=str(folder))
        if target is None:  # loaded once, as the first run would load it
            target = Target.load(cfg.target, device=cfg.device, dtype=target_dtype(run_cfg),
                                 chat_template=cfg.chat_template, command="sf-eval sweep")
        # --compile-target: one compile shared by all the widths the settings verify at, not one per width
        reports[name] = run_eval(run_cfg, silent=silent, target=target, dynamic=True)
    if len(earlier) == len(options):  # nothing decoded now: the sweep.json before holds which runs they came from
        before = out / "sweep.json"
        earlier = json.loads(before.read_text()).get("measured_earlier", []) if before.is_file() else []
    summary = {**summarise(reports, options, ref), "measured_earlier": earlier}
    atomic_write_json(out / "sweep.json", {"config": {k: getattr(cfg, k) for k in ("draft", "target", "settings")},
                                          **summary})
    plot_sweep(summary, ref.provider.name, out / "sweep.png")
    return summary


def plot_sweep(summary: dict, family: str, path: Path) -> bool:
    """tokens/s against the verify width, a line per prompt set, the target alone dashed. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'specfoundry[plot]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for set_name in dict.fromkeys(r["set"] for r in summary["rows"]):
        rows = sorted((r for r in summary["rows"] if r["set"] == set_name), key=lambda r: r["verify_width"])
        line = ax.plot([r["verify_width"] for r in rows], [r["tokens_per_s"] for r in rows], "-o", label=set_name)
        if set_name in summary["target_alone_tokens_per_s"]:
            ax.axhline(summary["target_alone_tokens_per_s"][set_name], linestyle="--", color=line[0].get_color())
    ax.set_xlabel("tokens verified a round")
    ax.set_ylabel("tokens/s (dashed: the target alone)")
    ax.set_title(f"{family}: tokens/s by serving setting, one sequence")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarise(reports: dict, options: list[tuple[str, dict]], ref) -> dict:
    """Rows per setting and set, the best setting per set and over all sets, and the flags."""
    rows, alone = [], {}
    for name, fields in options:
        report = reports[name]
        for set_name, entry in report["sets"].items():
            s = entry["trained"]
            if entry.get("target_alone_tokens_per_s") is not None:
                alone[set_name] = entry["target_alone_tokens_per_s"]
            rows.append({"setting": name, **fields, "set": set_name, "verify_width": verify_width(fields),
                         "accept_length": s["accept_length"], "accept_rate_by_position": s["accept_rate_by_position"],
                         "draft_ms_per_round": s.get("draft_ms_per_round"),
                         "target_ms_per_round": s.get("target_ms_per_round"), "tokens_per_s": s["tokens_per_s"]})
    best_per_set = {}
    for r in rows:
        if r["set"] not in best_per_set or r["tokens_per_s"] > best_per_set[r["set"]]["tokens_per_s"]:
            best_per_set[r["set"]] = r
    means = {name: sum(r["tokens_per_s"] for r in rows if r["setting"] == name) /
             max(1, sum(r["setting"] == name for r in rows)) for name, _ in options}
    best = max(means, key=means.get)
    fields = dict(options)[best]
    # each setting's sf-eval run, warm-up and every set (the target alone's in the first); a resumed
    # setting's from its own run
    wall = {name: reports[name].get("wall_s") for name, _ in options}
    return {"rows": rows, "target_alone_tokens_per_s": alone, "wall_s": wall,
            "best_per_set": {k: v["setting"] for k, v in best_per_set.items()},
            "best": best, "best_mean_tokens_per_s": means[best],
            "serve": serving_flags(ref.provider.name, served_folder(ref), fields)}


def served_folder(ref) -> str:
    """The folder an engine loads: the export (a run's export/, not the run folder the user may have
    named); a checkpoint has none until sf-export writes one, which the flags then stand for."""
    return str(ref.where) if ref.is_export else f"EXPORT_OF_{ref.path}"


def verify_width(fields: dict) -> int:
    """The tokens the target verifies a round at this setting: N, or k + 1."""
    return fields["num_draft_tokens"] if "num_draft_tokens" in fields else fields["k"] + 1


def serving_flags(family: str, draft: str, fields: dict) -> dict:
    """The SGLang server flags and vLLM's --speculative-config that serve the export `draft` of
    `family` at the setting; None where the engine serves no such draft or setting. Written from the
    engines' code (docs/serving.md): EAGLE-3 in SGLang as EAGLE3 with its tree's three flags, in vLLM
    as a chain (K = 1); DFlash, DFlash2 and Domino in SGLang as DFLASH, the block given as
    --speculative-num-draft-tokens, in vLLM as dflash (not Domino) with k; DSpark as DSPARK and
    dspark with k; P-EAGLE in vLLM alone, as eagle3 with parallel drafting."""
    def vllm(method: str, k: int, **extra) -> str:
        return "--speculative-config " + json.dumps({"method": method, "model": draft, "num_speculative_tokens": k,
                                                     **extra})

    if family == "eagle3":
        return {"sglang": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
                          f"--speculative-num-steps {fields['num_steps']} --speculative-eagle-topk {fields['topk']} "
                          f"--speculative-num-draft-tokens {fields['num_draft_tokens']}",
                "vllm": vllm("eagle3", fields["num_steps"]) if fields["topk"] == 1 else None}
    k = fields["k"]
    if family in ("dflash", "dflash2", "domino"):
        return {"sglang": f"--speculative-algorithm DFLASH --speculative-draft-model-path {draft} "
                          f"--speculative-num-draft-tokens {k + 1}",
                "vllm": None if family == "domino" else vllm("dflash", k)}
    if family == "dspark":
        return {"sglang": f"--speculative-algorithm DSPARK --speculative-draft-model-path {draft} "
                          f"--speculative-dspark-block-size {k}", "vllm": vllm("dspark", k)}
    if family == "peagle":
        return {"sglang": None, "vllm": vllm("eagle3", k, parallel_drafting=True)}
    raise ValueError(f"no serving flags are known for family {family!r}")


def format_sweep(summary: dict) -> str:
    """The sweep's table, a line per setting and set, then the best and its flags."""
    lines = [f"{'setting':<14} {'set':<12} {'width':>5} {'accept':>7} {'tok/s':>8}"]
    for r in summary["rows"]:
        lines.append(f"{r['setting']:<14} {r['set']:<12} {r['verify_width']:>5} {r['accept_length']:>7.2f} "
                     f"{r['tokens_per_s']:>8.1f}")
    alone = ", ".join(f"{k} {v:.1f}" for k, v in summary["target_alone_tokens_per_s"].items())
    lines.append(f"target alone, tokens/s: {alone or '-'}")
    lines.append(f"best over all sets: {summary['best']} ({summary['best_mean_tokens_per_s']:.1f} tokens/s on "
                 f"average); per set: " + ", ".join(f"{k} {v}" for k, v in summary["best_per_set"].items()))
    serve = summary["serve"]
    lines.append(f"SGLang: {serve['sglang'] or 'serves no such draft'}")
    lines.append(f"vLLM: {serve['vllm'] or 'serves no such draft or setting (of an EAGLE-3 tree: a chain only, K = 1)'}")
    alone_mean = (sum(summary["target_alone_tokens_per_s"].values()) / len(summary["target_alone_tokens_per_s"])
                  if summary["target_alone_tokens_per_s"] else None)
    if alone_mean is not None and summary["best_mean_tokens_per_s"] < alone_mean:
        lines.append(f"note: the best setting decodes slower than the target alone ({summary['best_mean_tokens_per_s']:.1f} "
                     f"against {alone_mean:.1f} tokens/s on average): serving this draft would slow decoding here")
    if summary.get("measured_earlier"):
        lines.append(f"note: {', '.join(summary['measured_earlier'])} measured in an earlier run of this sweep (resumed): "
                     "their tokens/s compare with the others only where the machine was as idle; delete their "
                     "folders to measure every setting in one run")
    lines.append("one sequence at a time: a server under load gains otherwise (docs/serving.md)")
    return "\n".join(lines)


__all__ = ["NOT_SWEPT", "SweepConfig", "format_sweep", "recipe_refusal", "run_sweep"]
