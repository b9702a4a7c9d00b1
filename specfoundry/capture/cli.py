"""sf-capture: run the target over conversations and store its hidden states as a feature set."""

from __future__ import annotations

import os
import sys

import click

from specfoundry.capture.stage import CaptureConfig, CaptureError, run_capture
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.target import EMBEDDED_DEFAULT
from specfoundry.featureset.manifest import FeatureSetError

CTX = {"help_option_names": ["-h", "--help"], "show_default": True}


@click.group(context_settings=CTX)
def main():
    """Capture the target's hybrid hidden states (three layers + final) into a feature set."""


@main.command("run", context_settings=CTX)
@click.argument("source")
@click.option("-o", "--output", required=True, help="Feature-set folder. Rerunning the same command resumes.")
@click.option("--target", default=EMBEDDED_DEFAULT, help="Local model directory, or 'smollm2' (embedded default).")
@click.option("--backend", type=click.Choice(["hf", "sglang"]), default="hf",
              help="hf: transformers prefill with forward hooks. sglang: not implemented yet (fails clearly).")
@click.option("--aux-layers", default=None,
              help="Comma-separated decoder layer ids whose outputs are captured (default 1,L//2-1,L-4).")
@click.option("--max-length", type=int, default=2048, help="Tokens per sample after the chat template (truncated).")
@click.option("--shard-size", type=click.IntRange(min=1), default=None,
              help="Samples per shard (unit of resumption and of work per rank). A shard's features stay in "
                   "host memory until written, so the default is as many samples as fit 4 GiB of features at "
                   "--max-length, at most 256 (SmolLM2 at 2048 tokens: 256; an 8B target at 4096: 32).")
@click.option("--max-batch-tokens", type=int, default=16384, help="Padded tokens per prefill batch.")
@click.option("--codec", type=click.Choice(["zarr", "safetensors"]), default="zarr",
              help="zarr: Zarr v3, chunked and compressed (1.3x smaller for bf16; compressing costs about 4x "
                   "the CPU per byte of safetensors, so a fast GPU needs more --writers). safetensors: "
                   "memory-mapped, uncompressed.")
@click.option("--storage-dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              help="dtype of the stored hidden states.")
@click.option("--strict", is_flag=True, help="Fail on the first bad conversation instead of skipping it.")
@click.option("--limit", type=int, default=None, help="Capture only the first N samples.")
@click.option("--device", default=None, help="Torch device (default cuda if available, else cpu).")
@click.option("--writers", type=click.IntRange(min=1), default=None, show_default=False,
              help="Threads writing finished shards in the background [default: min(4, CPU cores)]. "
                   "Up to writers + 2 shards are held in memory at once.")
@click.option("--silent", is_flag=True, help="No progress bar.")
def run(source, output, target, backend, aux_layers, max_length, shard_size, max_batch_tokens, codec,
        storage_dtype, strict, limit, device, writers, silent):
    """Render SOURCE (conversations or an sf-regen output) with the target's chat template,
    compute the assistant-only loss mask, prefill the target and store its features.

    Under `accelerate launch`/`torchrun` each process takes its share of the shards."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch
        import torch.distributed as dist

        if device is None and torch.cuda.is_available():  # one GPU per process
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        dist.init_process_group("nccl" if device and device.startswith("cuda") else "gloo")
    layers = tuple(int(x) for x in aux_layers.split(",")) if aux_layers else None
    cfg = CaptureConfig(source=source, output=output, target=target, backend=backend, aux_layers=layers,
                        max_length=max_length, shard_size=shard_size, max_batch_tokens=max_batch_tokens,
                        codec=codec, storage_dtype=storage_dtype, strict=strict, limit=limit, device=device,
                        **({} if writers is None else {"writers": writers}))
    try:
        manifest = run_capture(cfg, rank=rank, world=world, silent=silent)
    except (CaptureError, FeatureSetError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    if rank == 0:
        for bad in manifest.get("bad_inputs", []):
            click.echo(f"bad input: {bad['location']}: {bad['kind']}: {bad['detail']}", err=True)
        c = manifest["counts"]
        click.echo(f"feature set {output}: {c['samples']} samples, {c['tokens']} tokens, "
                   f"{c['loss_tokens']} loss tokens, {c['skipped_untrainable']} skipped")


@main.command("verify", context_settings=CTX)
@click.argument("featureset")
@click.option("--recompute", type=int, default=0, help="Also rerun the target on this many samples and compare.")
@click.option("--device", default=None, help="Torch device for --recompute.")
def verify(featureset, recompute, device):
    """Check FEATURESET against its manifest: checksums, shapes, counts, NaN/Inf."""
    try:
        problems = verify_featureset(featureset, recompute, device)
    except FeatureSetError as e:
        raise click.ClickException(str(e)) from e
    if problems:
        raise click.ClickException(problems[0] + (f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    click.echo(f"{featureset}: ok")


if __name__ == "__main__":
    sys.exit(main())
