"""sf-regen: regenerate every assistant turn of a conversation dataset with the target."""

from __future__ import annotations

import sys

import click

from specfoundry.common.target import EMBEDDED_DEFAULT
from specfoundry.generate.backend import SamplingConfig, make_backend
from specfoundry.generate.regen import ON_EMPTY, ON_TRUNCATED, RegenConfig, RegenError, run_regen
from specfoundry.generate.synth import DEFAULT_STARTERS, read_starters


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("source", required=False)
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Output folder (parquet shards + manifest.json). Rerunning into it resumes.")
@click.option("--target", default=EMBEDDED_DEFAULT,
              help=f"Target model: a local model directory, or '{EMBEDDED_DEFAULT}' for the embedded SmolLM2-135M-Instruct.")
@click.option("--backend", type=click.Choice(["hf", "openai", "sglang"]), default="hf",
              help="hf: transformers in this process; openai: an OpenAI-compatible server; sglang: offline sglang.Engine.")
@click.option("--synthesize", type=int, default=0,
              help="No dataset: synthesise this many user prompts from the target (Magpie) instead of reading SOURCE.")
@click.option("--prompt-temperature", type=float, default=None,
              help="Temperature of synthesised prompts [default: --temperature, or 1.0 with --greedy].")
@click.option("--prompt-starters", default="default",
              help=f"Seed each synthesised prompt with an opening that the target continues, so the prompts cover "
                   f"many kinds of request: 'default' ({len(DEFAULT_STARTERS)} built-in openings such as 'Why', "
                   f"'Explain', 'Write a', 'Compare'), 'none' (plain Magpie), or a text file with one opening per line.")
@click.option("--temperature", type=float, default=0.8, help="Sampling temperature (0.8 as in the SpecForge paper).")
@click.option("--greedy", is_flag=True, help="Greedy decoding (same as --temperature 0).")
@click.option("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1 = off).")
@click.option("--top-k", type=int, default=0, help="Sample only from the k most likely tokens (0 = off).")
@click.option("--max-new-tokens", type=int, default=512, help="Cap per assistant turn; a longer answer is 'truncated'.")
@click.option("--seed", type=int, default=0, help="Base seed; the same command reproduces the same output.")
@click.option("--batch-size", type=int, default=32, help="Sequences generated together (hf, sglang).")
@click.option("--shard-size", type=int, default=128, help="Conversations per output shard (the unit of resumption).")
@click.option("--max-prompt-tokens", type=int, default=2048, help="Prompts longer than this are reported as bad input.")
@click.option("--on-empty", type=click.Choice(ON_EMPTY), default="drop",
              help="Drop conversations with an empty regenerated answer, or keep them flagged.")
@click.option("--on-truncated", type=click.Choice(ON_TRUNCATED), default="flag",
              help="Drop conversations with an answer cut at --max-new-tokens, keep them flagged, or 'trim': "
                   "cut an answer that ends in a verbatim repetition loop (a block of <= 64 tokens repeating "
                   ">= 32 tokens) after the loop's first repeat, and keep the other cut answers flagged "
                   "(backends that return token ids: hf, sglang).")
@click.option("--strict", is_flag=True, help="Fail on the first bad input instead of reporting and skipping it.")
@click.option("--limit", type=int, default=None, help="Use only the first N good conversations.")
@click.option("--device", default=None, help="Torch device for the hf backend (default: cuda if available, else cpu).")
@click.option("--openai-url", default=None, help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:30000/v1.")
@click.option("--openai-model", default=None, help="Model name to send to the server (if it needs one).")
@click.option("--concurrency", type=int, default=16, help="Requests in flight at once (openai backend).")
@click.option("--retries", type=int, default=4, help="Retries per request with exponential backoff (openai backend).")
@click.option("--silent", is_flag=True, help="No progress bar.")
def main(source, output, target, backend, synthesize, prompt_temperature, prompt_starters, temperature, greedy, top_p, top_k, max_new_tokens, seed,
         batch_size, shard_size, max_prompt_tokens, on_empty, on_truncated, strict, limit, device, openai_url,
         openai_model, concurrency, retries, silent):
    """Regenerate the assistant turns of SOURCE (a jsonl/json/parquet file or a folder of them,
    ShareGPT or OpenAI shaped) with the target, turn by turn on the regenerated history.

    Bad records are reported with their file and line and counted in the manifest; the run
    goes on (use --strict to stop instead)."""
    sampling = SamplingConfig(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, seed=seed)
    try:
        starters = read_starters(prompt_starters)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    cfg = RegenConfig(output=output, source=source, synthesize=synthesize, prompt_temperature=prompt_temperature,
                      prompt_starters=starters, target=target, backend=backend,
                      sampling=sampling, batch_size=batch_size, shard_size=shard_size,
                      max_prompt_tokens=max_prompt_tokens, on_empty=on_empty, on_truncated=on_truncated,
                      strict=strict, limit=limit)
    try:
        gen_backend = make_backend(backend, target=target, device=device, openai_url=openai_url,
                                   openai_model=openai_model, concurrency=concurrency, retries=retries,
                                   batch_size=batch_size)
        manifest = run_regen(cfg, gen_backend, silent=silent)
    except (RegenError, RuntimeError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    for bad in manifest["bad_inputs"]:
        click.echo(f"bad input: {bad['location']}: {bad['kind']}: {bad['detail']}", err=True)
    t = manifest["totals"]
    click.echo(
        f"wrote {t.get('conversations_written', 0)} conversations to {output} "
        f"(turns ok {t.get('turns_ok', 0)}, empty {t.get('turns_empty', 0)}, truncated {t.get('turns_truncated', 0)}, "
        f"loops trimmed {t.get('turns_loop_trimmed', 0)}, "
        f"failed {t.get('turns_failed', 0)}; bad inputs {len(manifest['bad_inputs'])})"
    )


if __name__ == "__main__":
    sys.exit(main())
