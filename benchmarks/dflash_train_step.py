"""sf-train's DFlash step on one GPU at the Qwen3-8B DFlash shape, context features from disk.

    python -m benchmarks.dflash_train_step [--seq 3072] [--steps 6] [--batches 1,2,4,6] [--profile]

Shape: 5 layers, H 4096, intermediate 12288, 32 query / 8 KV heads of 128, block 16, target vocab
151936, 512 anchors per sample, T = 3072 context tokens per sample. Random features of 5 target
layers are written to a safetensors feature-set shard and read back through the training loader
(background workers, pinned memory). Each step is the whole of training's: anchors and the mask,
forward, loss, backward, AdamW. Ours (FlexAttention BlockMask from the mask_mod, compiled
elementwise chains, chunked loss) and our plain path (dense SDPA mask from the same mask_mod,
eager elementwise) run the same loop at each batch size; tokens/s counts the T context tokens
of each sample. --profile: where one step of ours spends its GPU time at the largest batch that
ran (torch.profiler: the top kernels and the time per kind), in the JSON's summary.profile.

FLOPs per sample (Q = anchors * block query tokens, K = 5 layers of H, A the mean keys a query
sees: half the context plus its block):
    fc          2 * T * K*H * H                                  (weight gradient only: x2)
    per layer   2 * Q * H * (2 nh + 2 nkv) hd  +  2 * T * H * 2 nkv hd  (q, o; k, v of block and context)
                + 2 * 3 * Q * H * I  +  4 * Q * nh * hd * A        (SwiGLU; attention)   (x3)
    lm_head     2 * Q * (B-1)/B * H * V                          (frozen: input gradient only, x2)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import MATMUL_TFLOPS, print_profile_summary, print_table, profile_summary, write_result
from benchmarks.train_step import time_steps
from specfoundry.families.dflash.loss import DFlashModule
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dflash.shapes import QWEN3_8B_DFLASH
from specfoundry.testing import write_random_featureset
from specfoundry.train.loader import FeatureLoader

ANCHORS = 512


def flops_per_sample(cfg, t: int, anchors: int = ANCHORS) -> float:
    h, i, nh, nkv, hd, b = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.block_size)
    q = anchors * b
    k = len(cfg.target_layer_ids)
    layer = (2 * q * h * (2 * nh + 2 * nkv) * hd + 2 * t * h * 2 * nkv * hd + 2 * 3 * q * h * i
             + 4 * q * nh * hd * (t / 2 + b))
    lm_head = 2 * q * (b - 1) / b * h * cfg.vocab_size
    return 2 * (2 * t * k * h * h) + 3 * cfg.num_hidden_layers * layer + 2 * lm_head


IMPLS = {  # name: (attention, compiled elementwise chains)
    "ours (flex BlockMask + compiled elementwise)": ("flex", True),
    "plain (dense SDPA mask, eager)": ("sdpa", False),
}


def module(compiled: bool) -> DFlashModule:
    torch.manual_seed(0)
    cfg = QWEN3_8B_DFLASH
    draft = DFlashDraft(cfg)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(torch.bfloat16)
    return DFlashModule(draft, lm_head, num_anchors=ANCHORS, gamma=7.0, compile_elementwise=compiled).cuda()


def profile_step(step) -> dict:
    """One step under torch.profiler (CUDA kernels), after the timing's warm-up."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return profile_summary(prof, top=15)


def run(impl: str, fs, t: int, batch: int, steps: int, profile: bool = False) -> dict:
    attention, compiled = IMPLS[impl]
    row = {"impl": impl, "T": t, "batch": batch}
    model = module(compiled)
    opt = torch.optim.AdamW(model.draft.trainable_parameters(), lr=1e-4, fused=True)
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t * batch, seed=0, num_workers=4,
                                pin_memory=True, final=False))

    def step():
        b = next(loader).to("cuda", torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(b, attention=attention)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        ms = time_steps(step, steps)
        row.update(ms_per_step=ms, context_tokens_per_s=batch * t / (ms * 1e-3),
                   peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
        row["TFLOPs"] = batch * flops_per_sample(QWEN3_8B_DFLASH, t) / (ms * 1e-3) / 1e12
        row["MFU_%"] = 100 * row["TFLOPs"] / MATMUL_TFLOPS
        row["flop_limit_ms"] = batch * flops_per_sample(QWEN3_8B_DFLASH, t) / (MATMUL_TFLOPS * 1e12) * 1e3
        if profile:
            row["profile"] = profile_step(step)
            print_profile_summary(f"one step of {impl} at batch {batch}", row["profile"])
    except torch.cuda.OutOfMemoryError:
        row["ms_per_step"] = "OOM"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=3072, help="Context tokens per sample.")
    ap.add_argument("--steps", type=int, default=6, help="Timed steps after 2 warm-up steps.")
    ap.add_argument("--batches", default="1,2,4,6", help="Batch sizes (samples per step) to run.")
    ap.add_argument("--impls", default="ours,plain", help="Which of ours, plain to run.")
    ap.add_argument("--profile", action="store_true", help="Profile one step of ours at the largest batch.")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    impls = [name for name in IMPLS if name.split()[0] in args.impls.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        # every run reads (steps + 2 warm-up + 1 profiled) * batch samples, all in the loader's first
        # epoch (a new epoch starts new loader workers, which a timed step would wait for)
        fs = write_random_featureset(Path(d), (args.steps + 4) * max(batches), args.seq, QWEN3_8B_DFLASH)
        for batch in batches:
            for impl in impls:
                rows.append(run(impl, fs, args.seq, batch, args.steps,
                                profile=args.profile and batch == max(batches) and impl.startswith("ours")))
                torch.cuda.empty_cache()  # the run's model, optimizer state and loader are gone with it
                print_table(rows[-1:], [k for k in rows[-1] if k != "profile"])
                path = save(rows, args.seq)  # after every row: a run cut short keeps what it measured
    print_table(rows, ["impl", "T", "batch", "ms_per_step", "context_tokens_per_s", "TFLOPs", "MFU_%", "peak_GiB",
                       "flop_limit_ms"])
    print(path)


def save(rows: list[dict], t: int):
    ours = [r for r in rows if r["impl"].startswith("ours") and isinstance(r.get("ms_per_step"), float)]
    best = max(ours, key=lambda r: r["context_tokens_per_s"]) if ours else {}
    flops = flops_per_sample(QWEN3_8B_DFLASH, t)
    summary = {"context_tokens_per_s": best.get("context_tokens_per_s"), "peak_GiB": best.get("peak_GiB"),
               "batch": best.get("batch"), "flop_limit_ms_per_sample": flops / (MATMUL_TFLOPS * 1e12) * 1e3}
    if best:
        summary["ms_per_step"] = best["ms_per_step"]
        summary["flop_limit_ms"] = best["flop_limit_ms"]
        summary["times_flop_limit"] = best["ms_per_step"] / best["flop_limit_ms"]
        summary["MFU_%"] = best["MFU_%"]
    profiled = next((r for r in rows if "profile" in r), None)
    if profiled:
        summary["profile"] = {"batch": profiled["batch"], **profiled["profile"]}
    return write_result("dflash_train_step", rows, {"summary": summary, "flops_per_sample": flops})


if __name__ == "__main__":
    main()
