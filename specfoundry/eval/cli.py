"""sf-eval run: acceptance length by real speculative decoding. specfoundry/cli.py puts it in the
sf-eval group beside gate.py's gate, which drives every stage."""

from __future__ import annotations

import click

from specfoundry.common.cli import (
    CommandError,
    read_recipe,
    resolve_config,
    stage_command,
)
from specfoundry.common.placement import PlacementError, launch_env
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.conversations.records import ConversationFormatError
from specfoundry.eval.evaluate import EvalConfig, run_eval
from specfoundry.eval.prompts import EvalError
from specfoundry.eval.report import format_table
from specfoundry.eval.sweep import NOT_SWEPT, SweepConfig, format_sweep, recipe_refusal, run_sweep
from specfoundry.families.folders import DraftLoadError
from specfoundry.featureset.manifest import FeatureSetError

FAILURES = (EvalError, DraftLoadError, TargetError, PlacementError, OutputFolderError, ConversationFormatError,
            FeatureSetError, FileNotFoundError)


@stage_command(None, "run", EvalConfig, *FAILURES)
def run(recipe, silent, **options):
    """Decode each prompt with DRAFT (an exported folder, an sf-train run folder, or one of its
    checkpoints/step-N) proposing and the target verifying, and report acceptance length. With
    --tp N, launch it under `torchrun --nproc-per-node N` (one copy of the target)."""
    cfg = resolve_config(EvalConfig, "eval", recipe, options)
    report = run_eval(cfg, silent=silent)
    if launch_env()[0] != 0:  # under torchrun (--tp), rank 0 reports
        return
    click.echo(format_table(report))
    if cfg.output:
        click.echo(f"wrote {cfg.output}/eval.json, eval.txt, acceptance.png")
    else:  # said, so that a missing -o is not found out after a long run
        click.echo("wrote nothing: -o DIR keeps the report (eval.json, eval.txt, acceptance.png)")


@stage_command(None, "sweep", SweepConfig, *FAILURES)
def sweep(recipe, silent, **options):
    """Decode with DRAFT at each serving setting of its family (EAGLE-3: SGLang's tree, S,K,N; the
    others: k), the target loaded once and decoding alone once, and report acceptance and tokens/s
    per setting and prompt set, the best setting, and for EAGLE-3 the SGLang and vLLM flags that
    serve it (OUTPUT/sweep.json; each setting's run in OUTPUT/<setting>, which a rerun skips)."""
    why = recipe_refusal(read_recipe(recipe, "eval"), recipe)
    if why:
        raise CommandError(why)
    cfg = resolve_config(SweepConfig, "eval", recipe, options, decided_here=NOT_SWEPT)
    summary = run_sweep(cfg, silent=silent)
    click.echo(format_sweep(summary))
    click.echo(f"wrote {cfg.output}/sweep.json, sweep.png")
