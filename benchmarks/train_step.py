"""sf-train step throughput on one GPU at the Llama-3.1-8B draft shape, features from disk.

    python benchmarks/train_step.py [--seq 4096] [--steps 8] [--profile]

Shape: H 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336, target vocab 128256,
draft vocab 32000, T = 4096, TTT 7, batch 1. Random features are written to a safetensors
feature-set shard first and read back through the training loader (background workers).
Ours (FlexAttention BlockMask + in-place Triton loss + compiled elementwise chains), ours with
the elementwise chains eager, and the plain torch path (eager EAGLE-3 attention + reference
loss) run the same loop: teacher, 7-step TTT forward, backward, AdamW. --profile also prints
where ours spends its GPU time (torch.profiler, CUDA kernels by total time).

FLOPs per token (written out so the MFU can be checked), with A = 2*H*H*... per layer:
    fc        2 * 3H * H                              (step 0 only)
    per step  2 * 2H * (nh + 2*nkv) * hd  (q, k, v)   + 2 * nh*hd * H  (o)
              + 2 * 3 * H * I (SwiGLU) + 2 * H * Vd (lm_head) + 4 * (T/2 + s) * nh * hd (attention)
    training  3 x forward (backward = 2 x forward), plus the teacher 2 * H * V (forward only)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

# the repo root replaces this script's folder on the path: transformers imports a package
# named "kernels" if it can find one, and this folder holds kernels.py
sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.common import MATMUL_TFLOPS, print_table, write_result  # noqa: E402
from benchmarks.kernels import LLAMA8B_DRAFT  # noqa: E402
from specfoundry.common.files import atomic_write_json  # noqa: E402
from specfoundry.featureset.manifest import MANIFEST, SCHEMA, SCHEMA_VERSION  # noqa: E402
from specfoundry.featureset.store import FeatureSet, shard_name, write_shard  # noqa: E402
from specfoundry.train.loader import FeatureLoader  # noqa: E402
from specfoundry.train.model import Eagle3Draft  # noqa: E402
from specfoundry.train.ttt import TTTModule  # noqa: E402
from specfoundry.train.vocab import vocab_maps  # noqa: E402


def flops_per_token(cfg, t: int, steps: int) -> float:
    h, i, nh, nkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fwd = 2 * 3 * h * h
    for s in range(steps):
        fwd += 2 * 2 * h * (nh + 2 * nkv) * hd + 2 * nh * hd * h + 2 * 3 * h * i + 2 * h * cfg.draft_vocab_size
        fwd += 4 * (t / 2 + s) * nh * hd
    return 3 * fwd + 2 * h * cfg.vocab_size


def write_random_featureset(root: Path, n: int, t: int, cfg) -> FeatureSet:
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, cfg.vocab_size, (t,), generator=g),
                "loss_mask": torch.ones(t, dtype=torch.bool),
                "aux_hidden": torch.randn(t, 3 * cfg.hidden_size, generator=g).to(torch.bfloat16),
                "final_hidden": torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16)} for _ in range(n)]
    rel = shard_name(0, "safetensors")
    digest = write_shard(root, rel, samples, "safetensors", "bfloat16")
    atomic_write_json(root / MANIFEST, {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "codec": "safetensors", "storage_dtype": "bfloat16",
        "aux_layer_ids": list(cfg.aux_layer_ids), "hidden_size": cfg.hidden_size,
        "target": {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        "shards": [{"path": rel, "sha256": digest, "num_samples": n, "sample_lengths": [t] * n}]})
    return FeatureSet(root)


def random_ttt_module(cfg, vocab_stride: int, head_scale: float, fuse_elementwise: bool = True) -> TTTModule:
    """A draft of shape `cfg` with random weights (seed 0), every `vocab_stride`-th target token
    in its vocabulary, and a random bf16 teacher head of scale `head_scale`, on the CPU: the
    caller moves or wraps it. fuse_elementwise: as TTTModule's."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    d2t, t2d = vocab_maps(torch.arange(0, cfg.vocab_size, vocab_stride)[: cfg.draft_vocab_size], cfg.vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * head_scale).to(torch.bfloat16)
    return TTTModule(draft, lm_head, fuse_elementwise)


def llama8b_ttt_module(fuse_elementwise: bool = True) -> TTTModule:
    """The 8B-shaped draft (every 4th token in the draft vocab, teacher head scale 0.02)."""
    return random_ttt_module(LLAMA8B_DRAFT, vocab_stride=4, head_scale=0.02, fuse_elementwise=fuse_elementwise)


def time_steps(step, steps: int, warmup: int = 2) -> float:
    """ms per step(), by CUDA events over `steps` calls after `warmup` untimed ones (compile,
    mask build, allocator, communicators); the peak-memory counter is reset after the warm-up."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


IMPLS = {  # name: (attention, loss, compiled elementwise chains)
    "ours (flex + triton + fused elementwise)": ("flex", "triton", True),
    "ours, eager elementwise": ("flex", "triton", False),
    "plain (eager + reference)": ("eager", "reference", False),
}


PROFILED_STEPS = 2


def profile_table(step, steps: int = PROFILED_STEPS) -> str:
    """CUDA kernels by total GPU time over `steps` steps (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)


def run(impl: str, fs: FeatureSet, t: int, steps: int, ttt: int, profile: bool = False) -> dict:
    cfg = LLAMA8B_DRAFT
    attention, loss_impl, fused = IMPLS[impl]
    model = llama8b_ttt_module(fused).cuda()
    opt = torch.optim.AdamW(model.draft.trainable_parameters(), lr=1e-4, fused=True)
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t, seed=0, num_workers=2, pin_memory=True))

    def step():
        batch = next(loader).to("cuda", torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(batch, ttt_length=ttt, attention=attention, loss_impl=loss_impl)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row = {"impl": impl, "T": t, "ttt": ttt}
    try:
        ms = time_steps(step, steps)
        if profile:
            print(f"== where {impl} spends its GPU time ({PROFILED_STEPS} steps) ==\n{profile_table(step)}", flush=True)
        row.update(ms_per_step=ms, tokens_per_s=t / (ms * 1e-3), peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
        row["TFLOPs"] = flops_per_token(cfg, t, ttt) * t / (ms * 1e-3) / 1e12
        row["MFU_%"] = 100 * row["TFLOPs"] / MATMUL_TFLOPS
    except torch.cuda.OutOfMemoryError:
        row["ms_per_step"] = "OOM"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096, help="Tokens per sample.")
    ap.add_argument("--steps", type=int, default=8, help="Timed steps after 2 warm-up steps.")
    ap.add_argument("--ttt", type=int, default=7, help="TTT length.")
    ap.add_argument("--profile", action="store_true", help="Also print the top CUDA kernels of ours.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        # every run reads steps + warm-up (+ profiled) samples
        fs = write_random_featureset(Path(d), args.steps + 6, args.seq, LLAMA8B_DRAFT)
        rows = [run(impl, fs, args.seq, args.steps, args.ttt, profile=args.profile and k == 0)
                for k, impl in enumerate(IMPLS)]
    plain = rows[-1].get("ms_per_step")
    for row in rows[:-1]:
        if isinstance(plain, float) and isinstance(row.get("ms_per_step"), float):
            row["speedup_vs_plain"] = plain / row["ms_per_step"]
    print_table(rows, ["impl", "T", "ttt", "ms_per_step", "tokens_per_s", "TFLOPs", "MFU_%", "peak_GiB", "speedup_vs_plain"])
    print(write_result("train_step", rows, {"flops_per_token": flops_per_token(LLAMA8B_DRAFT, args.seq, args.ttt)}))


if __name__ == "__main__":
    main()
