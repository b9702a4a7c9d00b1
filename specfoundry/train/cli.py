"""sf-train: train an EAGLE-3 draft from a feature set (recipe YAML + CLI overrides)."""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

import click
import yaml

from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.tree_attention import TooManyShapesError
from specfoundry.train.trainer import TrainConfig, run_train

# one option per TrainConfig field; help comes from the field docstrings where they exist
OPTION_HELP = {
    "featureset": "Feature-set folder written by sf-capture.",
    "output": "Run folder: checkpoints/, export/, train_config.json, history.json. Rerun to resume.",
    "target": "Local model directory or 'smollm2' (must match the feature set).",
    "draft_vocab_size": "Draft vocabulary: this many most frequent loss-masked tokens.",
    "ttt_length": "Training-Time Test steps unrolled per forward.",
    "loss_decay": "Weight of step s is decay^s.",
    "lr": "Peak AdamW learning rate.",
    "weight_decay": "AdamW weight decay.",
    "warmup_steps": "Linear warmup steps before the cosine decay.",
    "max_steps": "Optimizer steps (ignored when --epochs is set).",
    "epochs": "Passes over the training split (overrides --max-steps).",
    "max_tokens": "Padded tokens per micro-batch per rank (length-grouped batches).",
    "max_length": "Truncate samples to this many tokens.",
    "pad_multiple": "Round batch widths up to a multiple of this, so compiled kernels see few shapes "
                    "[default: 128 with FlexAttention, else 1].",
    "grad_accum": "Micro-batches per optimizer step.",
    "clip_grad": "Gradient-norm clip (0 = off).",
    "seed": "Seed of data order, split and init.",
    "eval_fraction": "Held-out fraction of samples for evaluation.",
    "eval_every": "Evaluate every N steps.",
    "save_every": "Checkpoint every N steps (and at the end).",
    "keep_last": "Checkpoints kept.",
    "attention": "auto | flex | sdpa | eager (the original EAGLE-3 formulation).",
    "loss": "auto | triton (in-place kernel) | reference (plain torch).",
    "num_workers": "Background loader workers per rank.",
    "init_from": "Exported draft to fine-tune (keeps its vocab map).",
    "tensorboard": "Log to <output>/tensorboard.",
    "log_every": "Print metrics every N steps.",
}


def field_type(f: dataclasses.Field):
    hints = typing.get_type_hints(TrainConfig)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    t = args[0] if args else t
    return {int: int, float: float, str: str, bool: bool}[t]


def add_options(fn):
    for f in reversed(dataclasses.fields(TrainConfig)):
        name = "--" + f.name.replace("_", "-")
        if field_type(f) is bool:
            fn = click.option(name + "/--no-" + f.name.replace("_", "-"), default=None, help=OPTION_HELP[f.name])(fn)
        else:
            fn = click.option(name, type=field_type(f), default=None, help=OPTION_HELP[f.name])(fn)
    return fn


def resolve(recipe: str | None, overrides: dict) -> TrainConfig:
    values = {}
    if recipe:
        data = yaml.safe_load(Path(recipe).read_text()) or {}
        values.update(data.get("train", data))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise click.ClickException(f"{recipe or 'options'}: unknown train settings {unknown}")
    for required in ("featureset", "output"):
        if required not in values:
            raise click.ClickException(f"--{required} is required (on the command line or in the recipe)")
    return TrainConfig(**values)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), default=None,
              help="YAML recipe with train settings; command-line options override it.")
@click.option("--silent", is_flag=True, help="No progress bar.")
@add_options
def main(recipe, silent, **options):
    """Train the EAGLE-3 draft with Training-Time Test on a feature set, then export it for SGLang.

    Runs as one process (CPU or GPU) or under `accelerate launch` on many GPUs (ZeRO-2 with
    recipes/accelerate_zero2.yaml). Rerunning into the same --output resumes exactly."""
    cfg = resolve(recipe, options)
    try:
        result = run_train(cfg, silent=silent)
    except (FeatureSetError, ValueError, FileNotFoundError, TooManyShapesError) as e:
        raise click.ClickException(str(e)) from e
    last = result["history"][-1] if result["history"] else {}
    click.echo(f"trained {result['steps']} steps; exported to {result['export']}; "
               f"last sim_accept_len {last.get('sim_accept_len', float('nan')):.2f}")


if __name__ == "__main__":
    sys.exit(main())
