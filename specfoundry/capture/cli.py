"""sf-capture: run the target over conversations and store its hidden states as a feature set."""

from __future__ import annotations

import click

from specfoundry.capture.stage import CaptureConfig, CaptureError, run_capture
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.cli import (
    CONTEXT,
    IntIn,
    ToolGroup,
    expected_failures,
    hide_transformers_bars,
    resolve_config,
    shared_option,
    silent_option,
    stage_command,
)
from specfoundry.common.placement import PlacementError, launch_env
from specfoundry.common.settings import Range
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.conversations.records import ConversationFormatError
from specfoundry.featureset.manifest import FeatureSetError

FAILURES = (CaptureError, FeatureSetError, OutputFolderError, ConversationFormatError, TargetError,
            PlacementError, FileNotFoundError)


@click.group(cls=ToolGroup, context_settings=CONTEXT)
def main():
    """Capture the target's hidden states (chosen layers + the final state) into a feature set."""


@stage_command(main, "run", CaptureConfig, *FAILURES)
def run(recipe, silent, **options):
    """Render SOURCE (conversations or an sf-regen output) with the target's chat template,
    compute the assistant-only loss mask, prefill the target and store its features.

    Under `torchrun` each copy of the target (one process, or --tp N processes) takes its share
    of the shards. Rerunning the same command resumes."""
    cfg = resolve_config(CaptureConfig, "capture", recipe, options)
    manifest = run_capture(cfg, silent=silent)
    if launch_env()[0] == 0:
        for bad in manifest.get("bad_inputs", []):
            click.echo(f"bad input: {bad['location']}: {bad['kind']}: {bad['detail']}", err=True)
        c = manifest["counts"]
        left_out = [f"{n} {what}" for n, what in ((c.get("bad_inputs", 0), "bad inputs (above)"),
                                                   (c["skipped_untrainable"], "with no assistant token within "
                                                    f"--max-length {cfg.max_length}")) if n]
        click.echo(f"feature set {cfg.output}: {c['samples']} samples, {c['tokens']} tokens, "
                   f"{c['loss_tokens']} loss tokens" + (f"; left out: {', '.join(left_out)}" if left_out else ""))


@main.command("verify", context_settings=CONTEXT)
@click.argument("featureset", type=click.Path())
@click.option("--recompute", type=IntIn(Range(0)), default=0, show_default=True,
              help="Also rerun the target on this many samples and compare. 0: none.")
@shared_option("device")
@silent_option
@expected_failures(*FAILURES)
def verify(featureset, recompute, device, silent):
    """Check FEATURESET against its manifest: checksums, shapes, counts, NaN/Inf. Exit status 1
    when it finds a problem, 2 when it cannot check."""
    if silent:  # where --recompute loads the target
        hide_transformers_bars()
    problems = verify_featureset(featureset, recompute, device, silent=silent)
    if problems:
        click.echo(f"Error: {problems[0]}" + (f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""),
                   err=True)
        raise SystemExit(1)
    click.echo(f"{featureset}: ok")


if __name__ == "__main__":
    main()
