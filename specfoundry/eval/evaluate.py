"""sf-eval run: acceptance length of a draft on prompt sets, by real speculative decoding.

For each prompt set it reports the acceptance length (mean tokens per target verify forward,
counting the target's own token), the acceptance rate at each draft position (the chance that
draft token j is accepted given that tokens 1..j-1 were), draft and target time per round, and
tokens/s with and without the draft. In greedy mode it also checks that every output equals the
target's own greedy output (the baseline run), token for token.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from specfoundry.common.placement import FUSED_EXPERTS, Placement, PlacementError, launch_env
from specfoundry.common.progress import Progress
from specfoundry.common.settings import (
    MAX_DRAFT,
    TEMPLATE_KWARGS_HELP,
    Range,
    Settings,
    config_dict,
    parse_template_kwargs,
    resume_settings,
    setting,
    shared,
)
from specfoundry.common.shards import check_output_folder
from specfoundry.common.target import (
    EMBEDDED_DEFAULT,
    Target,
    chat_template_source,
    parameter_count,
    pick_device,
    resolve_target,
)
from specfoundry.conversations.templates import unread_template_kwargs
from specfoundry.decoding.rounds import DecodeResult, NonFiniteLogitsError, target_generate
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.steps import warm_steps
from specfoundry.decoding.target import TargetRunner, graphs_possible
from specfoundry.decoding.tree import (
    MAX_TREE_NODES,
    EngineTree,
    check_branching,
    parse_branching,
    shape_name,
    tree_nodes,
)
from specfoundry.eval.prompts import (
    BUILTIN_SETS,
    EvalError,
    eval_modes,
    load_prompts,
    mode_label,
    parse_modes,
)
from specfoundry.eval.report import format_table, summarise_set, write_report
from specfoundry.families import FAMILIES
from specfoundry.families.folders import (
    DraftRef,
    check_trained_for,
    load_draft,
    locate_draft,
    training_record,
    untrained_like,
)
from specfoundry.featureset.manifest import tokenizer_hashes


def parse_tree(spec) -> tuple[int, ...] | None:
    """--tree as given on the command line ('4,2,2,1') or in a recipe (a list)."""
    if spec is None:
        return None
    if isinstance(spec, list | tuple):
        spec = ",".join(map(str, spec))
    if not isinstance(spec, str):
        raise ValueError(f"tree branching must be comma-separated integers, got {spec!r}")
    return parse_branching(spec)


PROMPTS_HELP = (f"Comma-separated prompt sets: built-in held-out sets ({', '.join(BUILTIN_SETS)}) or dataset files "
                "(jsonl/json/parquet; a trailing assistant turn is dropped).")
COMPILE_TARGET_HELP = ("Run the target's captured decode steps through torch.compile, compiled in the untimed "
                       "warm-up (one CUDA device; docs/stages.md, \"sf-eval run\").")
"""sf-eval run's and sf-eval sweep's help of the options they share (one concept, one help)."""


CHAIN_K = 4
"""The chain sf-eval decodes where -k is not given and the family's k is a chain's (families PROPOSALS)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig(Settings):
    """Settings of one sf-eval run (recorded in eval_config.json and in eval.json)."""

    DECIDED_TOGETHER: ClassVar = {("k", "tree"): "-k drafts a chain, --tree a tree (its depth is its k): give one"}

    draft: str = setting(argument=True, help="An exported draft folder, an sf-train run folder, or one of its "
                         "checkpoints/step-N.")
    # eval.json, eval.txt, acceptance.png and eval_config.json; no files without it
    output: str | None = shared("output", None, resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    chat_template_kwargs: dict | None = setting(
        None, parse=parse_template_kwargs, shown="the mode the draft's feature set was rendered in (recorded with "
        "its export), else none", help=TEMPLATE_KWARGS_HELP)
    modes: tuple[dict, ...] = setting(
        (), parse=parse_modes, shown="none: one mode (--chat-template-kwargs)",
        help="Evaluate in several modes, a JSON list of chat-template argument objects, decoding each prompt set "
             "in each (docs/stages.md, \"Reasoning targets\").")
    prompt_sets: tuple[str, ...] = setting(BUILTIN_SETS, flags=("--prompts",), help=PROMPTS_HELP)
    k: int | None = shared("draft_tokens", None, shown=FAMILIES.eval_k_shown(), help=FAMILIES.draft_tokens_help())
    tree: tuple[int, ...] | None = setting(
        None, parse=parse_tree, shown="none: a chain",
        help="Draft a token tree instead of a chain, top-k branching per depth such as 4,2,2,1 (greedy only; its "
             "depth replaces -k).")
    num_steps: int | None = setting(
        None, valid=Range(1, MAX_DRAFT), shown="none: -k's chain or --tree",
        help="EAGLE-3: draft the tree an SGLang server drafts, with this many draft steps a round (its "
             "--speculative-num-steps; with --topk and --num-draft-tokens; docs/serving.md).")
    topk: int | None = setting(
        None, valid=Range(1, MAX_DRAFT), shown="none",
        help="EAGLE-3: the children kept per expanded node in SGLang's tree (its --speculative-eagle-topk).")
    num_draft_tokens: int | None = setting(
        None, valid=Range(1, MAX_TREE_NODES), shown="none",
        help="EAGLE-3: the tokens the target verifies a round in SGLang's tree, the root included (its "
             "--speculative-num-draft-tokens).")
    temperature: float = setting(0.0, valid=Range(0, zero="greedy verification"),
                                 help="Above 0: sampling with the rejection rule (the output is distributed as the "
                                      "target's).")
    max_new_tokens: int = shared("max_new_tokens", 128)
    # per prompt set
    limit: int | None = shared("limit", None)
    seed: int = shared("seed", 0)
    baseline: bool = setting(True, help="Also decode with the target alone: tokens/s without the draft, the "
                             "speedup, and the greedy equality check.")
    allow_other_target: bool = setting(False, help="Evaluate a draft whose export records another target "
                                       "(config hash or weight fingerprint), with a warning, instead of refusing.")
    compare_untrained: bool = setting(False, help="Also evaluate a freshly initialised draft with the same config "
                                      "and vocabulary (the floor).")
    compile_target: bool = setting(False, help=COMPILE_TARGET_HELP)
    compile_draft: bool = setting(
        False, help="Run the draft's captured proposal through torch.compile, one compile per shape in the untimed "
                    "warm-up (CUDA only; docs/stages.md, \"sf-eval run\").")
    device: str | None = shared("device", None, resume=False)
    placement: Placement = Placement()
    # fp32 makes greedy decoding exactly reproducible across the batch shapes of verification and plain decoding
    dtype: str | None = shared("dtype", None, choices=("float32", "bfloat16"), shown=(
        "float32 (greedy output exactly the target's own) where the target's float32 weights take at most half of "
        "its one GPU, else bfloat16; float32 on CPU"))

    def __post_init__(self):
        super().__post_init__()
        if not self.prompt_sets:
            raise ValueError("--prompts names no prompt set")
        twice = sorted({p for p in self.prompt_sets if self.prompt_sets.count(p) > 1})
        if twice:  # decoded twice and reported once, under one name
            raise ValueError(f"--prompts names {', '.join(twice)} twice")
        modes = [mode_label(m) for m in self.modes]
        if len(set(modes)) < len(modes):
            raise ValueError(f"--modes names the mode {next(m for m in modes if modes.count(m) > 1)} twice")
        served = (self.num_steps, self.topk, self.num_draft_tokens)
        if any(v is not None for v in served) and None in served:
            raise ValueError("--num-steps, --topk and --num-draft-tokens pick SGLang's tree together: give all three")
        if self.served_tree is not None and self.tree:
            raise ValueError("--tree and --num-steps/--topk/--num-draft-tokens are two trees: give one")
        self.served_tree  # noqa: B018 - EngineTree checks the three (a chain's N, a pool too small), one line

    @property
    def served_tree(self) -> EngineTree | None:
        """The engines' tree of --num-steps, --topk and --num-draft-tokens, or None."""
        if self.num_steps is None:
            return None
        return EngineTree(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def drafted_tree(self) -> tuple[int, ...] | EngineTree | None:
        """What the EAGLE-3 decoder drafts as `tree`: the served tree, the --tree branching, or None."""
        return self.served_tree or self.tree


def decode_set(target: TargetRunner, decoder, prompts, cfg: EvalConfig, eos: set[int],
               desc: str, silent: bool = False) -> list[DecodeResult]:
    """Each prompt decoded by the family's `decoder` (its generate), or by the target alone (None)."""
    sampler = Sampler(cfg.temperature, torch.Generator(device=target.device).manual_seed(cfg.seed))
    results = []
    with Progress(len(prompts), "prompt", desc, silent) as progress:
        for prompt_id, ids in prompts:
            try:
                if decoder is None:
                    r = target_generate(target, ids, max_new_tokens=cfg.max_new_tokens, eos=eos, sampler=sampler)
                else:
                    r = decoder.generate(target, ids, max_new_tokens=cfg.max_new_tokens, eos=eos, sampler=sampler)
            except NonFiniteLogitsError as e:
                raise EvalError(f"{desc}, prompt {prompt_id}: {e}") from None
            results.append(r)
            progress.update(1, len(r.tokens))
    return results


def check_config(cfg: EvalConfig) -> tuple[EvalConfig, DraftRef]:
    """cfg with k and the tree as the draft's family decodes them (a DFlash draft: its block less
    one), k resolved from a tree; refuses what cannot be decoded: the settings themselves first,
    then a folder that holds no draft (all before the target loads: minutes on a large one)."""
    if cfg.served_tree is not None and cfg.temperature > 0:
        raise EvalError("SGLang's tree (--num-steps/--topk/--num-draft-tokens) verifies greedily here; use the chain "
                        "(-k) with --temperature > 0")
    if cfg.tree:
        if cfg.temperature > 0:
            raise EvalError("--tree verifies greedily; use the chain (-k) with --temperature > 0")
        try:
            check_branching(cfg.tree)
        except ValueError as e:
            raise EvalError(str(e)) from e
    on_cuda = torch.cuda.is_available() and not (cfg.device or "cuda").startswith("cpu")
    for option, on, what in (("--compile-target", cfg.compile_target, "the target's captured decode steps"),
                             ("--compile-draft", cfg.compile_draft, "the draft's captured proposal")):
        if on and not on_cuda:
            raise EvalError(f"{option} compiles {what}, which run on a CUDA device only; leave it off here")
    ref = locate_draft(cfg.draft)  # the one time the draft's folder is read for what it holds
    dcfg = ref.config
    if cfg.compile_draft and not ref.provider.compiles_draft:
        offering = [name for name in FAMILIES.names() if FAMILIES.provider(name).compiles_draft]
        raise EvalError(f"--compile-draft: {ref.provider.name} drafts decode uncompiled ({', '.join(offering)} offer it)")
    if cfg.compile_draft and cfg.drafted_tree:
        raise EvalError("--compile-draft compiles EAGLE-3's chain; its trees expand uncompiled, so leave it off")
    if cfg.served_tree is not None and not ref.provider.serves_engine_tree:
        raise EvalError(f"--num-steps/--topk/--num-draft-tokens pick SGLang's EAGLE tree; {cfg.draft} is a "
                        f"{ref.provider.name} draft (its knobs: docs/serving.md)")
    try:
        # (None: -k not given, the family's own k; a chain's is CHAIN_K)
        k, tree, warning = ref.provider.decode_settings(dcfg, k=CHAIN_K if cfg.k is None else cfg.k, tree=cfg.tree,
                                                       temperature=cfg.temperature, k_given=cfg.k is not None,
                                                       source=cfg.draft)
    except ValueError as e:
        raise EvalError(str(e)) from e
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    cfg = replace(cfg, k=cfg.num_steps if cfg.served_tree else len(tree) if tree else k, tree=tree)
    if cfg.k < 1:
        raise EvalError(f"k must be at least 1, got {cfg.k}")
    if cfg.output:  # before decoding: the results are not lost to an unwritable or another run's folder
        check_output_folder(Path(cfg.output), "eval", cfg)
    return cfg, ref


EXACT_SHARE = 0.5
"""sf-eval's default dtype on one GPU is float32 when the target's float32 weights take at most this
share of the device's memory; the rest holds the KV cache, the draft, fp32 logits and the captured
steps' pools."""


def target_dtype(cfg: EvalConfig) -> torch.dtype:
    """--dtype, or else exact_default_dtype's choice, said in one line (by the first rank)."""
    if cfg.dtype:
        return getattr(torch, cfg.dtype)
    dtype, why = exact_default_dtype(cfg)
    if launch_env()[0] == 0:
        print(f"sf-eval: the target runs in {why}", file=sys.stderr)
    return dtype


def exact_default_dtype(cfg: EvalConfig) -> tuple[torch.dtype, str]:
    """(the target's dtype when --dtype is not given, why, as printed): the exact side by default,
    since greedy speculative output is the target's own token for token in float32, while in bfloat16 a verify of k+1 tokens and a one-token step can round a
    near-tie apart (docs/stages.md). float32 doubles the weights' memory, so a target whose float32
    weights would crowd its GPU, or one spread over several devices, runs in bfloat16."""
    device = pick_device(cfg.device)
    if device.type != "cuda":
        return torch.float32, "float32"
    exact = "pass --dtype float32 for greedy output exactly the target's own"
    if cfg.placement.copy_size > 1 or cfg.placement.device_map:
        return torch.bfloat16, f"bfloat16, spread over several devices ({exact})"
    need = 4 * parameter_count(resolve_target(cfg.target))
    have = torch.cuda.get_device_properties(device).total_memory
    if need <= EXACT_SHARE * have:
        return torch.float32, ("float32, so that greedy output is exactly the target's own (--dtype bfloat16: the "
                               "serving precision, faster, exact up to near-ties)")
    return torch.bfloat16, (f"bfloat16: its float32 weights ({need / 2**30:.0f} GiB) would take more than "
                            f"{EXACT_SHARE:.0%} of {device}'s {have / 2**30:.0f} GiB ({exact})")


def warms_up(device) -> bool:
    """Whether decode_sets decodes untimed first (warm_up): on a GPU."""
    return torch.device(device).type == "cuda"


def warm_up(cfg: EvalConfig, target: TargetRunner, drafts: dict, sets: dict, eos: set[int]) -> None:
    """One untimed decode of the first prompt, at full length, by the target alone (with --baseline)
    and by each draft, before any timed one: on a GPU the first decode pays for kernel selection,
    library handles, the allocator's first blocks and clocks still rising from idle, which would
    otherwise fall on the first set's tokens/s alone (after a warm-up of a few tokens the first timed
    decode was still slow). Then every captured step the decodes will meet is captured (and compiled)
    now: the target's prompt reads of every set's prompt lengths and its one-token step, and each
    decoder's step_keys. Its outputs are dropped and its sampler is its own, so the timed decodes'
    tokens are those of a run without it."""
    first = next((prompts[0][1] for prompts in sets.values() if prompts), None)
    if first is None:
        return
    lengths = sorted({len(ids) for prompts in sets.values() for _, ids in prompts})
    sampler = Sampler(cfg.temperature, torch.Generator(device=target.device).manual_seed(cfg.seed))
    if cfg.baseline:
        target_generate(target, first, max_new_tokens=cfg.max_new_tokens, eos=eos, sampler=sampler)
    for decoder in drafts.values():
        decoder.generate(target, first, max_new_tokens=cfg.max_new_tokens, eos=eos, sampler=sampler)
    target.warm(tokens=[1] if cfg.baseline else [], prompts=lengths)
    for decoder in drafts.values():
        warm_steps(decoder.step_keys(target, lengths))


def decode_sets(cfg: EvalConfig, target: TargetRunner, drafts: dict, sets: dict, eos: set[int],
                silent: bool = False) -> tuple[dict, float | None]:
    """({set name: {label: summary, ...}} for every prompt set, each draft, and the target alone;
    the seconds of warm_up first, its captures and --compile-* compiles included, or None off a GPU)."""
    # the longest sequence a decode may hold, reserved once, before the warm-up, in the target's
    # cache and each draft's: no decode grows one (which would drop its captured steps and
    # prefills: a recapture, or a recompile, inside a timed decode)
    longest = max((len(ids) for prompts in sets.values() for _, ids in prompts), default=0)
    # a tree verify: its nodes and the pending path
    served = cfg.served_tree
    tree_width = (served.num_draft_tokens - 1 + served.num_steps if served else
                  tree_nodes(cfg.tree) + len(cfg.tree) if cfg.tree else 0)
    target.reserve(longest + cfg.max_new_tokens + 1 + max(MAX_DRAFT, tree_width))
    for runner in drafts.values():
        runner.reserve(longest + cfg.max_new_tokens)
    warm_up_s = None
    if warms_up(target.device):
        warm_started = time.perf_counter()
        warm_up(cfg, target, drafts, sets, eos)
        warm_up_s = time.perf_counter() - warm_started
    out = {}
    for name, prompts in sets.items():
        entry, base, started = {}, None, time.perf_counter()
        if cfg.baseline:
            base = decode_set(target, None, prompts, cfg, eos, f"{name}: target alone", silent)
            entry["target_alone_tokens_per_s"] = sum(len(r.tokens) for r in base) / sum(r.total_s for r in base)
            # steps its asynchronous read-back ran after an eos, in its time (decoding/rounds.py GREEDY_READBACK)
            entry["target_alone_dropped_steps"] = sum(r.dropped_steps for r in base)
        for label, runner in drafts.items():
            results = decode_set(target, runner, prompts, cfg, eos,
                                 f"{name}: {label} draft {shape_name(cfg.k, cfg.drafted_tree)}", silent)
            entry[label] = summarise_set(results, cfg.k)
            if base is not None:
                entry[label]["speedup"] = entry[label]["tokens_per_s"] / entry["target_alone_tokens_per_s"]
                if cfg.temperature <= 0:
                    same = sum(r.tokens == b.tokens for r, b in zip(results, base, strict=True))
                    entry[label]["identical_to_target"] = f"{same}/{len(results)}"
                    if same != len(results):
                        bad = next(p[0] for p, r, b in zip(prompts, results, base, strict=True) if r.tokens != b.tokens)
                        print(f"warning: greedy speculative output differs from the target's own on {bad} "
                              "(numerical near-ties can do this in bf16)", file=sys.stderr)
        entry["wall_s"] = time.perf_counter() - started  # the set's decodes, the target alone's included
        out[name] = entry
    return out, warm_up_s


def one_copy(target: Target, command: str) -> None:
    """Decoding runs one sequence on one copy of the target: a launch of several copies is refused."""
    if target.ranks.groups > 1:
        raise PlacementError(f"{command} decodes on one copy of the target: launch as many processes as --tp / --ep "
                             f"({target.ranks.group_size}), not {target.ranks.world}")


def check_rendering(cfg: EvalConfig, ref, tokenizer, say: bool) -> None:
    """Template arguments the template never reads are an EvalError; a template other than the one the
    draft was trained under is a warning (where `say`: the rank that prints)."""
    for option, kwargs in (("--chat-template-kwargs", cfg.chat_template_kwargs),
                           *(("--modes", m) for m in (cfg.modes or []) if isinstance(m, dict))):
        problem = unread_template_kwargs(tokenizer, kwargs, option)
        if problem:
            raise EvalError(problem)
    warning = other_template(ref, tokenizer)
    if warning and say:
        print(f"warning: {warning}", file=sys.stderr)


def other_template(ref, tokenizer) -> str | None:
    """The warning, where the draft was trained on conversations rendered with another chat template
    than the one the prompts are rendered with now (its training record's hash; None where it
    records none): its acceptance is then measured on text it was not trained to follow."""
    record = training_record(ref) or {}
    trained = record.get("chat_template_sha256")
    if trained is None or trained == tokenizer_hashes(tokenizer)[1]:
        return None
    source = record.get("chat_template_source", "target")
    how = {"target": "the target's own template", "completion": "plain-text completion"}.get(source, source)
    return (f"draft {ref.path} was trained on conversations rendered with {how}, and the prompts are rendered with "
            f"another ({chat_template_source(tokenizer)}): pass the same --chat-template to measure it as trained")


def run_eval(cfg: EvalConfig, silent: bool = False, target: Target | None = None, dynamic: bool = False) -> dict:
    """Decode every prompt set with the draft (and the target alone); the report, also written
    to cfg.output (by the writing rank) when given. Everything is loaded and checked before the
    first decode. `target`: the target already loaded (the gate), else cfg's is loaded. `dynamic`:
    --compile-target compiles with symbolic widths (TargetRunner), for a caller meeting many."""
    started = time.perf_counter()
    cfg, ref = check_config(cfg)
    if target is None:
        from specfoundry.kernels.fused_moe import register_fused_experts

        register_fused_experts(FUSED_EXPERTS)  # so that --experts-implementation can name it
        target = Target.load(cfg.target, device=cfg.device, dtype=target_dtype(cfg), placement=cfg.placement,
                             chat_template=cfg.chat_template, command="sf-eval run", settings=resume_settings(cfg))
    one_copy(target, "sf-eval run")
    # the draft runs in the target's dtype, on its input device
    device, dtype, tokenizer, identity, target_dir = (target.input_device, target.dtype, target.tokenizer,
                                                      target.identity, target.path)
    warning = check_trained_for(ref, target_dir, cfg.allow_other_target)
    if warning and target.is_writer:
        print(f"warning: {warning}", file=sys.stderr)
    draft = load_draft(ref, target_dir, device, dtype)
    if draft.cfg.vocab_size != identity.vocab_size:
        raise EvalError(f"draft {cfg.draft} has vocab {draft.cfg.vocab_size}, target {cfg.target} {identity.vocab_size}")
    check_rendering(cfg, ref, tokenizer, say=target.is_writer)
    modes, mode_from = eval_modes(cfg.modes, cfg.chat_template_kwargs, ref)
    sets = {(name if len(modes) == 1 else f"{name} [{mode_label(m)}]"): load_prompts(name, tokenizer, cfg.limit, m)
            for name in cfg.prompt_sets for m in modes}
    family = ref.provider
    aux = list(draft.cfg.target_layers)
    if cfg.compile_target and not graphs_possible(target):
        raise EvalError("--compile-target needs the target's decode steps captured: one CUDA device, without "
                        "--tp / --ep or a device map; leave it off for this placement")
    runner_target = TargetRunner(target, aux, compiled=cfg.compile_target, dynamic=dynamic)
    drafts = {"trained": family.decoder(draft, target, k=cfg.k, tree=cfg.drafted_tree, compiled=cfg.compile_draft)}
    if cfg.compare_untrained:
        drafts["untrained"] = family.decoder(untrained_like(draft, cfg.seed), target, k=cfg.k, tree=cfg.drafted_tree,
                                             compiled=cfg.compile_draft)
    report = {"config": config_dict(cfg), "convention": "accept_length = mean tokens per target verify forward, "
              "counting the target's own token (k+1 at most); the prompt's first token is not counted",
              "family": family.name, "draft_training_steps": (training_record(ref) or {}).get("step"),  # optimizer steps
              "aux_layer_ids": aux, "device": str(device),
              "modes": {mode_label(m): m for m in modes}, "modes_from": mode_from,
              "dtype": str(dtype), "placement": config_dict(target.placement)}
    try:
        report["sets"], report["warm_up_s"] = decode_sets(cfg, runner_target, drafts, sets, set(target.end_of_turn_ids()),
                                                          silent or not target.is_writer)
    finally:
        runner_target.remove_hooks()
    report["wall_s"] = time.perf_counter() - started  # the whole run: loading, warm-up and every set
    report["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}
    if cfg.output and target.is_writer:
        try:
            write_report(report, Path(cfg.output))
        except OSError:
            print(format_table(report))  # the decoding is not lost with the report files
            raise
    return report


