"""Compiled FlexAttention on variable-length batches: time lost to recompiling per shape.

    python -m benchmarks.flex_shapes [--batches 16] [--budget-s 35]

torch.compile specialises FlexAttention on every input shape, and a TTT step's shape is
(batch rows, width, step): data of varied lengths can spend its time compiling. This runs the
7-step TTT loss forward and backward at the SmolLM2 draft shape (H 576, 9 heads, 3 KV heads,
draft vocab 16k, bf16) over the same variable-length batches (lengths uniform in [64, 2048],
16k tokens per batch at widths rounded to 128, planned by the training loader's `plan_batches`)
four ways:

    sdpa             dense boolean mask through SDPA (no compile; the baseline)
    flex exact       compiled FlexAttention, batches as wide as their longest sample
    flex pad128      compiled FlexAttention, widths rounded up to 128 (sf-train --pad-multiple)
    flex pad128 dyn  as pad128, compiled with dynamic=True (one kernel for many shapes)
    flex pad128 dynT as dyn, with the mask's width T read from a tensor instead of a Python int
                     (dynamo guards on a closure's int, so every width would recompile)

Each variant starts from a reset dynamo cache and gets --budget-s seconds for its first pass
over the batches (compiles included); if it finishes, a second pass over the same batches gives
the steady ms per batch. Reported: batches done in the first pass, distinct (rows, width)
shapes, graphs compiled, first-pass seconds, steady ms/batch, and the loss of batch 0 (the same
samples in every variant, and padding is masked out: the four must agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import print_table, write_result
from benchmarks.flex_args import FlexArgsAttention
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.shapes import SMOL_DRAFT, random_ttt_module
from specfoundry.featureset.batch import Batch
from specfoundry.kernels import tree_attention as ta
from specfoundry.train.loader import padded_width, plan_batches


def make_batches(n: int, max_tokens: int, seed: int = 0, pad: int = 128) -> list[list[int]]:
    """Sample lengths of the first n batches planned from 2,000 random lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = {i: int(x) for i, x in enumerate(torch.randint(64, 2049, (2000,), generator=gen))}
    plan = plan_batches(lengths, list(lengths), max_tokens, epoch=0, seed=seed, rank=0, world=1, pad_multiple=pad)
    return [[lengths[i] for i in b] for b in plan[:n]]


def to_batch(lengths: list[int], pad: int, cfg: Eagle3Config) -> Batch:
    """Random features drawn at the 128-rounded width and cut to this variant's width, so every
    variant sees the same values at the same valid positions."""
    b, wide, h = len(lengths), padded_width(max(lengths), 128), cfg.target_hidden_size
    t = padded_width(max(lengths), pad)
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    mask = torch.arange(t, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]  # [B, T]
    ids = torch.randint(0, cfg.vocab_size, (b, wide), device="cuda", generator=gen)[:, :t]
    aux = torch.randn(b, wide, 3 * h, device="cuda", generator=gen, dtype=torch.bfloat16)[:, :t]
    final = torch.randn(b, wide, h, device="cuda", generator=gen, dtype=torch.bfloat16)[:, :t]
    return Batch(ids, mask, aux.contiguous(), final.contiguous(), lengths)


def tensor_width_mask_mod(lengths: torch.Tensor, seq_len: int):
    """ttt_mask_mod with T as a 0-d tensor: no guard on its value (variant dynT)."""
    width = torch.tensor(seq_len, dtype=torch.int32, device=lengths.device)

    def ttt_tree_mask(b, h, q_idx, kv_idx):
        block = kv_idx // width
        j = kv_idx - block * width
        return (j < lengths[b]) & (((block == 0) & (j <= q_idx)) | ((block > 0) & (j == q_idx)))

    return ttt_tree_mask


def run_variant(name: str, attention: str, pad: int, dynamic: bool, args, tensor_width: bool = False) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ta.BLOCK_MASKS.entries.clear()
    model = random_ttt_module(SMOL_DRAFT, vocab_stride=3, head_scale=0.05).cuda()
    if attention == "flex":  # the draft's attention with this variant's compile and mask
        layer = model.draft.midlayer
        layer.self_attn = FlexArgsAttention(layer.self_attn, compiled=ta.compiled_flex(dynamic=dynamic),
                                            mask_mod=tensor_width_mask_mod if tensor_width else ta.ttt_mask_mod)
    shapes = make_batches(args.batches, args.max_tokens)
    batches = [to_batch(s, pad, SMOL_DRAFT) for s in shapes]

    def step(batch) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(batch, ttt_length=7, attention=attention, loss_kernel="triton")
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    row = {"variant": name, "batches": len(batches),
           "shapes": len({(b.input_ids.shape[0], b.input_ids.shape[1]) for b in batches})}
    start, done, first_loss = time.perf_counter(), 0, None
    try:
        for batch in batches:
            loss = step(batch)
            first_loss = loss if first_loss is None else first_loss
            done += 1
            if time.perf_counter() - start > args.budget_s:
                break
        torch.cuda.synchronize()
        row.update(first_pass_done=done, first_pass_s=time.perf_counter() - start, loss_0=first_loss)
        if done == len(batches):
            t0 = time.perf_counter()
            for batch in batches:
                step(batch)
            torch.cuda.synchronize()
            row["steady_ms_per_batch"] = (time.perf_counter() - t0) * 1e3 / len(batches)
    except Exception as e:  # noqa: BLE001 - a variant that breaks is reported, the others still run
        row.update(first_pass_done=done, error=f"{type(e).__name__}: {str(e)[:200]}")
    row["graphs_compiled"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=16, help="Batches per variant.")
    ap.add_argument("--max-tokens", type=int, default=16384, help="Padded tokens per batch.")
    ap.add_argument("--budget-s", type=float, default=35.0, help="Seconds a variant's first pass may take.")
    args = ap.parse_args()
    variants = [("sdpa", "sdpa", 1, False, False), ("flex exact", "flex", 1, False, False),
                ("flex pad128", "flex", 128, False, False), ("flex pad128 dyn", "flex", 128, True, False),
                ("flex pad128 dynT", "flex", 128, True, True)]
    rows = []
    for name, attention, pad, dynamic, tensor_width in variants:
        rows.append(run_variant(name, attention, pad, dynamic, args, tensor_width))
        print(rows[-1], flush=True)
        write_result("flex_shapes", rows, vars(args))  # kept if a later variant runs past a time limit
    cols = ["variant", "batches", "shapes", "first_pass_done", "first_pass_s", "graphs_compiled",
            "steady_ms_per_batch", "loss_0", "error"]
    print_table(rows, cols)
    print(write_result("flex_shapes", rows, vars(args)))


if __name__ == "__main__":
    main()
