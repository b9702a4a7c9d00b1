"""sf-train: train a draft from a feature set (recipe YAML + command-line overrides); sf-export:
write a draft in the layout a serving engine loads."""

from __future__ import annotations

import click

from specfoundry.common.cli import CONTEXT, resolve_config, stage_command
from specfoundry.common.shards import OutputFolderError
from specfoundry.common.target import TargetError
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.tree_attention import TooManyShapesError
from specfoundry.train.export import ExportConfig, run_export
from specfoundry.train.family import DraftLoadError
from specfoundry.train.trainer import TrainConfig, run_train


@click.group(context_settings=CONTEXT)
def main():
    """Train speculative-decoding drafts (EAGLE-3) from a feature set."""


@stage_command(main, "run", TrainConfig, FeatureSetError, OutputFolderError, TargetError, TooManyShapesError,
               FileNotFoundError, ValueError)
def run(recipe, silent, **options):
    """Train the EAGLE-3 draft with Training-Time Test on FEATURESET, then export it for SGLang.

    Runs as one process (CPU or GPU) or under `accelerate launch` on many GPUs (ZeRO-2 with
    recipes/accelerate_zero2.yaml). Rerunning into the same --output resumes exactly."""
    cfg = resolve_config(TrainConfig, "train", recipe, options)
    result = run_train(cfg, silent=silent)
    last = result["history"][-1] if result["history"] else {}
    click.echo(f"trained {result['steps']} steps; exported to {result['export']}; "
               f"last sim_accept_len {last.get('sim_accept_len', float('nan')):.2f}")


@click.group(context_settings=CONTEXT)
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
