"""sf-regen: regenerate every assistant turn of a conversation dataset with the target."""

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
from specfoundry.common.placement import launch_env
from specfoundry.common.shards import OutputFolderError
from specfoundry.conversations.records import ConversationFormatError
from specfoundry.generate.regen import RegenConfig, RegenError, run_regen


@click.group(cls=ToolGroup, context_settings=CONTEXT)
def main():
    """Regenerate training conversations with the target itself, so the draft learns its text."""


@stage_command(main, "run", RegenConfig, RegenError, OutputFolderError, ConversationFormatError, FileNotFoundError,
               RuntimeError)
@click.option("--greedy", is_flag=True, default=False, help="Greedy decoding: the same as --temperature 0.")
def run(greedy, recipe, silent, **options):
    """Regenerate the assistant turns of SOURCE (a jsonl/json/parquet file or a folder of them,
    ShareGPT or OpenAI shaped) with the target, turn by turn on the regenerated history; or,
    with --synthesize N and no SOURCE, answer N prompts the target writes itself.

    Bad records are reported with their file and line, counted in the manifest and skipped
    (--strict stops instead). Conversations with tools keep their tool results and, where the
    target's calls differ from the recorded ones, the recorded exchange. Rerunning the same
    command resumes. With --tp N (hf backend), launch it under `torchrun --nproc-per-node W`:
    W/N copies of the target split the shards."""
    if greedy and given_on_command_line("temperature"):  # one would be dropped unsaid
        raise CommandError("--greedy is --temperature 0: give one of them")
    cfg = resolve_config(RegenConfig, "regen", recipe, options, **({"temperature": 0.0} if greedy else {}))
    manifest = run_regen(cfg, silent=silent)
    if launch_env()[0] != 0:  # under torchrun, rank 0 reports
        return
    for bad in manifest["bad_inputs"]:
        click.echo(f"bad input: {bad['location']}: {bad['kind']}: {bad['detail']}", err=True)
    t = manifest["totals"]
    synthesised = (f"; synthesised prompts unfinished or empty {t.get('synthetic_prompts_empty', 0)}"
                   if cfg.synthesize else "")
    click.echo(
        f"wrote {t.get('conversations_written', 0)} conversations to {cfg.output} "
        f"(turns ok {t.get('turns_ok', 0)}, empty {t.get('turns_empty', 0)}, truncated {t.get('turns_truncated', 0)}, "
        f"loops trimmed {t.get('turns_loop_trimmed', 0)}, "
        f"failed {t.get('turns_failed', 0)}; bad inputs {len(manifest['bad_inputs'])}{synthesised})"
    )
    if t.get("turns_reasoning_unclosed", 0):  # the counts above do not say why these turns were lost
        click.echo(f"{t['turns_reasoning_unclosed']} answers' reasoning never closed (cut by --max-new-tokens "
                   f"{cfg.sampling.max_new_tokens}, or the turn ended in it): those turns were dropped", err=True)
    if not t.get("conversations_written", 0):  # nothing a later stage could train on: never a success
        no_prompt = cfg.synthesize and not t.get("conversations_in", 0) and t.get("synthetic_prompts_empty", 0)
        hint = (f"no synthesised prompt ended within --max-new-tokens ({cfg.sampling.max_new_tokens})" if no_prompt
                else "see the counts above")
        raise CommandError(f"{cfg.output}: no conversation written: {hint}")
    if t.get("turns_reasoning_joined_unseen", 0):
        click.echo(f"note: {t['turns_reasoning_joined_unseen']} answers' reasoning_content from the server kept as a "
                   "<think> block in the content, without the target's tokenizer to see its template: right for "
                   "Qwen3 and DeepSeek-R1 templates, not for gpt-oss's channels (rerun into a new folder with "
                   "--target)", err=True)
    exchanges = [t.get(f"tool_exchanges_{k}", 0) for k in ("kept", "replaced", "dropped")]
    if any(exchanges):
        click.echo("tool exchanges: kept {}, replaced by the recorded ones {}, dropped {}".format(*exchanges))


if __name__ == "__main__":
    main()
