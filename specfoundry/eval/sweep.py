"""sf-eval sweep: a draft decoded at each serving setting of its family, one sf-eval run a setting
over the same prompts with the target loaded once, reported side by side with the best setting.

The settings (`--settings`, else the family's defaults):
    EAGLE-3   SGLang's tree, S,K,N each (--speculative-num-steps, --speculative-eagle-topk,
              --speculative-num-draft-tokens; K = 1 is the chain of S tokens, N = S + 1)
    others    k, the proposals a round: a block drafter's block less one (at most its trained
              block's), P-EAGLE's depths (at most its trained ones)
Each setting's run writes OUTPUT/<setting>/ (eval.json, eval.txt) as `sf-eval run` does, so a
rerun skips the settings already done; the first one decodes the target alone too (its tokens/s
are every setting's yardstick). OUTPUT/sweep.json holds per setting and prompt set the acceptance
length, acceptance by position, draft and target ms a round and tokens/s; the best setting per set
and over all sets (the highest mean tokens/s); and for EAGLE-3 the SGLang and vLLM flags that
serve the best one. sf-eval decodes one sequence at a time: what a server under load gains from
a setting is not what one sequence gains (docs/serving.md).
"""

from __future__ import annotations

import json
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
        (), parse=parse_settings, resume=False, shown="the family's: EAGLE-3 3,1,4 5,1,6 7,1,8 5,4,8 6,8,32; a block "
        "drafter 3, 5, 7 and its block less one; P-EAGLE 3, 5, 7 and its depths, at most its own",
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
    most = most_proposals(draft_cfg)
    ks = [int(s) for s in settings if s.isdigit()] if settings else sorted({k for k in (3, 5, 7, most) if k <= most})
    bad = [s for s in settings if not s.isdigit() or not 1 <= int(s) <= most]
    if bad:
        raise EvalError(f"--settings {bad[0]!r}: a {family.name} setting is k, the proposals a round, from 1 to {most}")
    return [(f"k{k}", dict(k=k)) for k in ks]


def most_proposals(draft_cfg) -> int:
    """The most proposals a round the draft makes: a block drafter's block less one (DSpark's block),
    P-EAGLE's depths."""
    if hasattr(draft_cfg, "num_depths"):
        return int(draft_cfg.num_depths)
    return int(draft_cfg.block_size) - 1


def run_sweep(cfg: SweepConfig, silent: bool = False, target: Target | None = None) -> dict:
    """Each setting's sf-eval run (skipped where its eval.json is there), then sweep.json."""
    ref = locate_draft(cfg.draft)
    options = setting_options(ref.provider, cfg.settings, ref.config)
    out = Path(cfg.output)
    record_config(out, "sweep", cfg)  # a rerun into it with another draft or prompts is refused, naming them
    common = dict(draft=cfg.draft, target=cfg.target, chat_template=cfg.chat_template, prompt_sets=cfg.prompt_sets,
                  max_new_tokens=cfg.max_new_tokens, limit=cfg.limit, seed=cfg.seed,
                  compile_target=cfg.compile_target, device=cfg.device, dtype=cfg.dtype)
    reports = {}
    for i, (name, fields) in enumerate(options):
        folder = out / name
        if (folder / "eval.json").is_file():
            reports[name] = json.loads((folder / "eval.json").read_text())
            continue
        run_cfg = EvalConfig(**common, **fields, baseline=i == 0, output=str(folder))
        if target is None:  # loaded once, as the first run would load it
            target = Target.load(cfg.target, device=cfg.device, dtype=target_dtype(run_cfg),
                                 chat_template=cfg.chat_template, command="sf-eval sweep")
        reports[name] = run_eval(run_cfg, silent=silent, target=target)
    summary = summarise(reports, options, ref)
    atomic_write_json(out / "sweep.json", {"config": {k: getattr(cfg, k) for k in ("draft", "target", "settings")},
                                          **summary})
    return summary


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
    return {"rows": rows, "target_alone_tokens_per_s": alone,
            "best_per_set": {k: v["setting"] for k, v in best_per_set.items()},
            "best": best, "best_mean_tokens_per_s": means[best],
            "serve": serving_flags(ref, fields) if ref.provider.serves_engine_tree else None}


def verify_width(fields: dict) -> int:
    """The tokens the target verifies a round at this setting: N, or k + 1."""
    return fields["num_draft_tokens"] if "num_draft_tokens" in fields else fields["k"] + 1


def serving_flags(ref, fields: dict) -> dict:
    """The SGLang and vLLM flags that serve an EAGLE-3 export at the setting (SGLang's server flags;
    vLLM's --speculative-config drafts a chain, so it is given where K = 1)."""
    draft = str(ref.path)
    sglang = (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
              f"--speculative-num-steps {fields['num_steps']} --speculative-eagle-topk {fields['topk']} "
              f"--speculative-num-draft-tokens {fields['num_draft_tokens']}")
    vllm = None
    if fields["topk"] == 1:
        vllm = "--speculative-config " + json.dumps({"method": "eagle3", "model": draft,
                                                     "num_speculative_tokens": fields["num_steps"]})
    return {"sglang": sglang, "vllm": vllm}


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
    if summary["serve"]:
        lines.append(f"SGLang: {summary['serve']['sglang']}")
        lines.append(f"vLLM: {summary['serve']['vllm'] or 'a chain only (--settings S,1,S+1): its token tree differs'}")
    lines.append("one sequence at a time: a server under load gains otherwise (docs/serving.md)")
    return "\n".join(lines)


__all__ = ["SweepConfig", "format_sweep", "run_sweep"]
