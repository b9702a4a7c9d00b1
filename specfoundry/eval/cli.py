"""sf-eval: acceptance length by real speculative decoding, and the training-serving gate."""

from __future__ import annotations

import click

from specfoundry.common.cli import (
    CONTEXT,
    config_options,
    expected_failures,
    recipe_option,
    resolve_config,
    silent_option,
)
from specfoundry.common.conversations import ConversationFormatError
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.eval.draft import DraftLoadError
from specfoundry.eval.evaluate import EvalConfig, EvalError, format_table, run_eval
from specfoundry.featureset.manifest import FeatureSetError

FAILURES = (EvalError, DraftLoadError, TargetError, OutputFolderError, ConversationFormatError, FeatureSetError,
            FileNotFoundError)


@click.group(context_settings=CONTEXT)
def main():
    """Evaluate drafts against their target by real speculative decoding."""


@main.command("run", context_settings=CONTEXT)
@config_options(EvalConfig)
@recipe_option
@expected_failures(*FAILURES)
def run(recipe, **options):
    """Decode each prompt with DRAFT (an exported folder, an sf-train run folder, or one of its
    checkpoints/step-N) proposing and the target verifying, and report acceptance length."""
    cfg = resolve_config(EvalConfig, "eval", recipe, options)
    report = run_eval(cfg)
    click.echo(format_table(report))
    if cfg.output:
        click.echo(f"wrote {cfg.output}/eval.json, eval.txt, acceptance.png")


def gate_command():
    """sf-eval gate, defined here over specfoundry.gate (the module that may drive every stage)."""
    from specfoundry.gate import GateConfig, run_gate

    @click.command("gate", context_settings=CONTEXT)
    @config_options(GateConfig)
    @recipe_option
    @silent_option
    @expected_failures(*FAILURES)
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

    return gate


main.add_command(gate_command())


if __name__ == "__main__":
    main()
