"""sf-eval: acceptance length by real speculative decoding, and the training-serving gate."""

from __future__ import annotations

import click

from specfoundry.common.cli import CONTEXT, resolve_config, stage_command
from specfoundry.common.conversations import ConversationFormatError
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.eval.draft import DraftLoadError
from specfoundry.eval.evaluate import EvalConfig, EvalError, format_table, run_eval
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.gate import GateConfig, run_gate

FAILURES = (EvalError, DraftLoadError, TargetError, OutputFolderError, ConversationFormatError, FeatureSetError,
            FileNotFoundError)


@click.group(context_settings=CONTEXT)
def main():
    """Evaluate drafts against their target by real speculative decoding."""


@stage_command(main, "run", EvalConfig, *FAILURES)
def run(recipe, silent, **options):
    """Decode each prompt with DRAFT (an exported folder, an sf-train run folder, or one of its
    checkpoints/step-N) proposing and the target verifying, and report acceptance length."""
    cfg = resolve_config(EvalConfig, "eval", recipe, options)
    report = run_eval(cfg, silent=silent)
    click.echo(format_table(report))
    if cfg.output:
        click.echo(f"wrote {cfg.output}/eval.json, eval.txt, acceptance.png")


# The gate drives every stage (specfoundry/gate.py); it is offered here, beside the decoding it ends with.
@stage_command(main, "gate", GateConfig, *FAILURES)
def gate(recipe, silent, **options):
    """Overfit one conversation through regen, capture and train, reload the export and decode
    its prompt: the draft must be accepted almost always. Run it before a long training run;
    on failure it names the stage that disagrees (vocab map, export, features, positions, fit,
    decode) and exits with status 1 (2: the gate could not run)."""
    cfg = resolve_config(GateConfig, "gate", recipe, options)
    checks, ok, message = run_gate(cfg, silent=silent)
    for c in checks:
        click.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<10} {c.detail}")
    click.echo(message)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
