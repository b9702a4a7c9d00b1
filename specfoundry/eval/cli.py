"""sf-eval: acceptance length by real speculative decoding, and the training-serving gate."""

from __future__ import annotations

import sys

import click

from specfoundry.common.target import EMBEDDED_DEFAULT
from specfoundry.eval.draft import DraftLoadError
from specfoundry.eval.evaluate import BUILTIN_SETS, EvalConfig, EvalError, format_table, run_eval
from specfoundry.eval.gate import DEFAULT_PROMPT, GateConfig, build, run_checks, verdict
from specfoundry.eval.tree import parse_branching

CTX = {"help_option_names": ["-h", "--help"], "show_default": True}


@click.group(context_settings=CTX)
def main():
    """Evaluate EAGLE-3 drafts against their target by real speculative decoding."""


@main.command("run", context_settings=CTX)
@click.argument("draft")
@click.option("--target", default=EMBEDDED_DEFAULT, help="Local model directory, or 'smollm2' (embedded default).")
@click.option("--prompts", default=",".join(BUILTIN_SETS),
              help=f"Comma-separated prompt sets: built-in held-out sets ({', '.join(BUILTIN_SETS)}) or dataset "
                   "files (jsonl/json/parquet; a trailing assistant turn is dropped).")
@click.option("-k", "--k", "k", type=int, default=4, help="Draft tokens proposed per round (chain).")
@click.option("--tree", default=None,
              help="Draft a token tree instead of a chain: top-k branching per depth, e.g. 4,2,2,1 (depth 4, "
                   "44 nodes, all verified in one target forward). Greedy only; its depth replaces -k.")
@click.option("--temperature", type=float, default=0.0,
              help="0: greedy verification. >0: sampling with the rejection rule (output distributed as the target's).")
@click.option("--max-new-tokens", type=int, default=128, help="Tokens generated per prompt (stops earlier at eos).")
@click.option("--limit", type=int, default=None, help="Use the first N prompts of each set.")
@click.option("--seed", type=int, default=0, help="Sampling seed (and the untrained draft's init).")
@click.option("--baseline/--no-baseline", default=True,
              help="Also decode with the target alone: tokens/s without the draft, speedup, greedy equality check.")
@click.option("--compare-untrained", is_flag=True,
              help="Also evaluate a freshly initialised draft with the same config and vocabulary (the floor).")
@click.option("--device", default=None, help="Torch device (default cuda if available, else cpu).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="Target and draft dtype [default: bfloat16 on GPU, float32 on CPU]; float32 keeps greedy "
                   "decoding exactly reproducible across batch shapes.")
@click.option("-o", "--output", default=None, help="Folder for eval.json, eval.txt and acceptance.png.")
def run(draft, target, prompts, k, tree, temperature, max_new_tokens, limit, seed, baseline, compare_untrained, device,
        dtype, output):
    """Decode each prompt with DRAFT (an exported folder, an sf-train run folder, or one of its
    checkpoints/step-N) proposing and the target verifying, and report acceptance length."""
    try:
        branching = parse_branching(tree) if tree else None
    except ValueError as e:
        sys.exit(f"sf-eval: {e}")
    cfg = EvalConfig(draft=draft, target=target, prompt_sets=tuple(p for p in prompts.split(",") if p), k=k,
                     tree=branching,
                     temperature=temperature, max_new_tokens=max_new_tokens, limit=limit, seed=seed,
                     baseline=baseline, compare_untrained=compare_untrained, device=device, dtype=dtype, output=output)
    try:
        report = run_eval(cfg)
    except (EvalError, DraftLoadError, FileNotFoundError) as e:
        sys.exit(f"sf-eval: {e}")
    click.echo(format_table(report))
    if output:
        click.echo(f"wrote {output}/eval.json, eval.txt, acceptance.png")


@main.command("gate", context_settings=CTX)
@click.option("-w", "--workdir", required=True, help="Folder for the gate's regen, features and train run (resumes).")
@click.option("--target", default=EMBEDDED_DEFAULT, help="Local model directory, or 'smollm2' (embedded default).")
@click.option("--prompt", default=DEFAULT_PROMPT, help="The one prompt whose greedy answer the draft overfits.")
@click.option("--answer-tokens", type=int, default=96, help="Length cap of the target's greedy answer.")
@click.option("-k", "--k", "k", type=int, default=4, help="Draft tokens per round, and the TTT length trained.")
@click.option("--steps", type=int, default=200, help="Training steps on the one conversation.")
@click.option("--lr", type=float, default=3e-3, help="Learning rate of the overfit.")
@click.option("--min-accept-length", type=float, default=None, help="Bar of the decode check [default: 0.8*(k+1)].")
@click.option("--export", "export", default=None,
              help="Check this exported draft against the gate's run instead of the run's own export.")
@click.option("--device", default=None, help="Torch device (default cuda if available, else cpu).")
def gate(workdir, target, prompt, answer_tokens, k, steps, lr, min_accept_length, export, device):
    """Overfit one conversation through regen, capture and train, reload the export and decode
    its prompt: the draft must be accepted almost always. Run it before a long training run;
    on failure it names the stage that disagrees (vocab map, export, features, positions, fit,
    decode) and exits with status 1."""
    cfg = GateConfig(workdir=workdir, target=target, prompt=prompt, answer_tokens=answer_tokens, k=k, steps=steps,
                     lr=lr, min_accept_length=min_accept_length, device=device)
    export_dir = build(cfg, silent=False)
    checks = run_checks(cfg, export_dir if export is None else export)
    for c in checks:
        click.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<10} {c.detail}")
    ok, message = verdict(checks)
    click.echo(message)
    sys.exit(0 if ok else 1)
