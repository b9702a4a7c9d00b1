"""A draft's read of a prompt (sf-eval's `start` phase) beside the target's prefill of it, on one GPU:
the eager read (the path before the captured-step kit) and the captured one in the prompt's bucket.

    python -m benchmarks.prompt_read [--shape smollm2] [--lengths 37,61,100,151,230,313,419] [--iters 10]

A random target of SmolLM2-135M's shape (bf16, decode_step.py's SHAPES) and random drafts of its
shape: EAGLE-3 (one layer over three target layers), DFlash (5 layers, the context append alone)
and P-EAGLE (two layers, its start's forward over the prompt's rows). For each prompt length, each
draft's read is timed four ways (CUDA events, median ms; the target's prefill alone in `prefill`):
    eager_first   the eager read at a length never met before (the first prompt of that length in a
                  run: what every sf-eval prompt cost when each set's prompts had distinct lengths)
    eager         the same read again at that length (its shape met before)
    captured      the captured read, padded to the prompt's bucket (decoding/steps.py prompt_bucket),
                  after one warm-up of that bucket
    prefill       the target's captured prefill of the same prompt (its bucket), for the ratio
eager_first - eager is what a new shape costs the host (kernel selection and plan building of the
eager ops); eager - captured is the launches a graph saves. JSON: results/prompt_read.json
(`summary.ms`: draft -> column -> median over the lengths; rows per length).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from benchmarks.common import call_ms, print_table, write_result
from benchmarks.decode_step import AUX, DFLASH_LAYERS, SHAPES

LENGTHS = (37, 61, 100, 151, 230, 313, 419)


def median_ms(fn, iters: int) -> float:
    return statistics.median(call_ms(fn) for _ in range(iters))


def drafts(shape: str, device: torch.device, graphs: bool) -> dict:
    """name -> (runner, its read of a prompt's features: read(tokens, aux)), random drafts of the shape."""
    from specfoundry.families.dflash.block import BlockDraftRunner
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.dflash.model import DFlashDraft
    from specfoundry.families.eagle3.chain import DraftRunner
    from specfoundry.families.eagle3.config import draft_config_from_target
    from specfoundry.families.eagle3.model import Eagle3Draft
    from specfoundry.families.peagle.config import peagle_config_from_target
    from specfoundry.families.peagle.decode import PEagleRunner
    from specfoundry.families.peagle.model import PEagleDraft

    cfg = SHAPES[shape]
    vocab = cfg["vocab_size"]
    torch.manual_seed(2)

    def placed(draft):
        return draft.to(device, torch.bfloat16).eval().requires_grad_(False)

    head = torch.randn(vocab, cfg["hidden_size"], device=device, dtype=torch.bfloat16)
    eagle = DraftRunner(placed(Eagle3Draft(draft_config_from_target(cfg, min(32000, vocab), AUX[shape]))), graphs=graphs)
    dflash = BlockDraftRunner(placed(DFlashDraft(dflash_config_from_target(cfg, DFLASH_LAYERS[shape], 5, 16, vocab - 1))),
                              head, graphs=graphs)
    peagle = PEagleRunner(placed(PEagleDraft(peagle_config_from_target(cfg, min(32000, vocab), AUX[shape],
                                                                       num_hidden_layers=2, num_depths=7,
                                                                       mask_token_id=vocab - 1))), graphs=graphs)

    def read(runner, start):
        def go(tokens, aux):  # aux [T, n*H] of the widest draft: each reads its own layers' width
            runner.reset(len(tokens) + 128)
            start(runner, tokens, aux[:, : runner.draft.fc.in_features])
        return go

    return {"eagle3": read(eagle, lambda r, t, a: r.extend(t, a)),
            "dflash": read(dflash, lambda r, t, a: r.extend(a)),
            "peagle": read(peagle, lambda r, t, a: r.start(t, a))}


def rows_of(shape: str, lengths: tuple[int, ...], iters: int, device: torch.device) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specfoundry.common.target import Target
    from specfoundry.decoding.target import TargetRunner

    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(device, torch.bfloat16).eval()
    target = TargetRunner(Target.wrap(model), AUX[shape], graphs=True)
    eager, captured = drafts(shape, device, graphs=False), drafts(shape, device, graphs=True)
    widest = 5 * SHAPES[shape]["hidden_size"]  # the DFlash draft's five layers; the others read the first three
    rows = []
    for n in lengths:
        tokens = torch.randint(SHAPES[shape]["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
        aux = torch.randn(n, widest, device=device, dtype=torch.bfloat16)

        def prefill(tokens=tokens):
            target.reset(len(tokens) + 128)
            target.forward(tokens)

        row = {"shape": shape, "tokens": n, "prefill": (prefill(), median_ms(prefill, iters))[1]}
        for name in eager:
            e, c = (partial(f, tokens, aux) for f in (eager[name], captured[name]))
            row[f"{name}_eager_first"] = call_ms(e)
            row[f"{name}_eager"] = median_ms(e, iters)
            c()  # the bucket's capture
            row[f"{name}_captured"] = median_ms(c, iters)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda; cpu checks the script (graphs' CPU stand-in, no file)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = rows_of(args.shape, tuple(int(n) for n in args.lengths.split(",")), args.iters, torch.device(args.device))
    columns = ["tokens", "prefill"] + [f"{d}_{c}" for d in ("eagle3", "dflash", "peagle")
                                       for c in ("eager_first", "eager", "captured")]
    print_table(rows, columns)
    summary = {d: {c: statistics.median(r[f"{d}_{c}"] for r in rows) for c in ("eager_first", "eager", "captured")}
               for d in ("eagle3", "dflash", "peagle")}
    summary["prefill"] = statistics.median(r["prefill"] for r in rows)
    print("median ms over the lengths:", {k: ({c: round(v, 3) for c, v in s.items()} if isinstance(s, dict) else
                                                round(s, 3)) for k, s in summary.items()})
    if args.device == "cuda":
        write_result("prompt_read", rows, {"summary": {"ms": summary}, "wall_s": time.perf_counter() - started})


if __name__ == "__main__":
    main()
