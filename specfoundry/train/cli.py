"""sf-train: train a draft from a feature set (recipe YAML + command-line overrides); sf-export:
write a draft in the layout a serving engine loads."""

from __future__ import annotations

import click

from specfoundry.common.cli import (
    CONTEXT,
    CommandError,
    ToolGroup,
    given_on_command_line,
    resolve_config,
    stage_command,
)
from specfoundry.common.settings import config_fields, long_flag
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.families import FAMILIES
from specfoundry.families.folders import DraftLoadError
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.tree_attention import TooManyShapesError
from specfoundry.train.export import ExportConfig, run_export
from specfoundry.train.trainer import TrainConfig, run_train


@click.group(cls=ToolGroup, context_settings=CONTEXT)
def main():
    """Train speculative-decoding drafts of any family (--family) from a feature set."""


def run_help() -> str:
    """sf-train run's help, its families' layouts and option groups from the catalogue."""
    families = FAMILIES.families.values()
    layouts = "; ".join(f"{f.name}: {f.layouts[0]}" for f in families)
    extends = "; ".join(f"{f.name} reads {f.extends}'s" for f in families if f.extends)
    return (f"Train a draft of --family on FEATURESET, then export it to OUTPUT/export in the family's serving "
            f"layout ({layouts}). A family reads its own options and those of the family it extends ({extends}); "
            "another family's option given here is refused.\n\nRuns as one process (CPU or GPU) or under "
            "`accelerate launch` on many GPUs (ZeRO-2 with recipes/accelerate_zero2.yaml). Rerunning into the same "
            "--output resumes exactly.")


@stage_command(main, "run", TrainConfig, FeatureSetError, OutputFolderError, TargetError, TooManyShapesError,
               FileNotFoundError, ValueError, help=run_help())
def run(recipe, silent, **options):
    """sf-train run (its help: run_help, generated from the catalogue)."""
    cfg = resolve_config(TrainConfig, "train", recipe, options)
    refuse_other_families_options(cfg.family)
    result = run_train(cfg, silent=silent)
    last = result["history"][-1] if result["history"] else {}
    steps = result["steps"]
    held = last.get("eval_sim_accept_len")  # the held-out split's, where there is one
    click.echo(f"trained {steps} step{'s' if steps != 1 else ''}; exported to {result['export']}; "
               f"sim_accept_len {last.get('sim_accept_len', float('nan')):.2f} on the last batch"
               + (f", {held:.3f} held out" if held is not None else "")
               + (f"; warning: {result['warning']}" if result.get("warning") else ""))


def refuse_other_families_options(family: str) -> None:
    """A family option given on the command line that --family does not read (another family's
    group) is a one-line error rather than a setting recorded and never used. A recipe may hold
    several families' options: only those of the family trained are read."""
    read = [f.name for f in FAMILIES.chain(family)]
    for f, _, path in config_fields(TrainConfig):
        if path and path[0] not in read and given_on_command_line(f.name):
            raise CommandError(f"{long_flag(f)} is an option of {path[0]}; --family {family} reads only "
                               f"{' and '.join(read)}'s options")


@click.group(cls=ToolGroup, context_settings=CONTEXT)
def export_main():
    """Write drafts in the layout a serving engine loads: SGLang's, or vLLM's speculators format."""


@stage_command(export_main, "run", ExportConfig, DraftLoadError, OutputFolderError, TargetError, FileNotFoundError,
               ValueError)
def export_run(recipe, silent, **options):
    """Read DRAFT (an export of any layout, ours or another tool's, an sf-train run folder, or one of
    its checkpoints/step-N) and write it to --output in --format: the layer ids in each engine's
    convention, the tensors under each loader's names (docs/serving.md)."""
    cfg = resolve_config(ExportConfig, "export", recipe, options)
    out = run_export(cfg)
    click.echo(f"wrote {out} ({cfg.format} layout)")


if __name__ == "__main__":
    main()
