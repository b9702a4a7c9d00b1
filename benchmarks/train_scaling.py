"""sf-train data-parallel scaling on one host: the Llama-3.1-8B draft shape, T=4096, TTT 7,
one sample per GPU per step, features from disk, at 1, 2, ... GPUs.

    python -m benchmarks.train_scaling [--worlds 1,2] [--steps 8]

For each world size W the script launches W processes with `accelerate launch` (W > 1: ZeRO-2
through FSDP SHARD_GRAD_OP, recipes/accelerate_zero2.yaml, NCCL), each rank reading its own
samples of one random feature set written to disk first. The step is sf-train's: the TTTModule
(teacher head, 7-step unroll, FlexAttention BlockMask, in-place Triton loss) prepared by
Accelerate, backward, gradient reduce-scatter, AdamW. Each rank times its steps with CUDA
events after 2 warm-up steps, data loading included; a step's time is the slowest rank's.

    tokens/s (all GPUs)   = W * T / step time
    scaling efficiency    = tokens/s at W / (W * tokens/s at 1)
    reduce-scatter bytes  = trainable parameters * 4 (fp32 gradients) * (W-1)/W per rank per step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import MATMUL_TFLOPS, print_table, write_result
from benchmarks.train_step import flops_per_token, time_steps
from specfoundry.families.eagle3.shapes import LLAMA8B_DRAFT, llama8b_ttt_module
from specfoundry.testing import write_random_featureset

ROOT = Path(__file__).resolve().parents[1]


def worker(featureset: str, steps: int, ttt: int, out: str) -> None:
    """One rank of one world size (run under accelerate launch)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from specfoundry.featureset.store import FeatureSet
    from specfoundry.train.loader import FeatureLoader
    from specfoundry.train.metrics import optimizer_state_bytes

    accel = Accelerator(mixed_precision="bf16", kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    model = llama8b_ttt_module()
    trainable = sum(p.numel() for p in model.draft.trainable_parameters())
    opt = torch.optim.AdamW(model.draft.trainable_parameters(), lr=1e-4)
    model, opt = accel.prepare(model, opt)
    fs = FeatureSet(featureset)
    t = fs[0].input_ids.numel()  # every sample has the same length
    loader = iter(FeatureLoader(fs, list(range(len(fs))), max_tokens=t, seed=0, rank=accel.process_index,
                                world=accel.num_processes, num_workers=2, pin_memory=True))

    def step():
        batch = next(loader).to(accel.device, torch.bfloat16)
        with accel.autocast():
            loss, _ = model(batch, ttt_length=ttt, attention="flex", loss_kernel="triton")
        accel.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = torch.tensor([time_steps(step, steps)], device=accel.device)
    stats = torch.tensor([[ms.item(), float(optimizer_state_bytes(opt)), torch.cuda.max_memory_allocated() / 2**30]],
                         device=accel.device)
    gathered = accel.gather(stats).cpu().tolist()  # [W, 3]
    if accel.is_main_process:
        Path(out).write_text(json.dumps({"world": accel.num_processes, "T": t, "trainable_params": trainable,
                                         "per_rank": gathered, "distributed_type": str(accel.distributed_type)}))
    accel.wait_for_everyone()


def launch(world: int, featureset: Path, steps: int, ttt: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world)]
    if world > 1:
        cmd += ["--config_file", str(ROOT / "recipes" / "accelerate_zero2.yaml")]
    else:
        cmd += ["--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no"]
    # as a module, like python -m: the script's own folder never lands on sys.path
    cmd += ["--module", "benchmarks.train_scaling", "--worker", "--featureset", str(featureset), "--steps", str(steps), "--ttt", str(ttt),
            "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2", help="Comma-separated GPU counts to run.")
    ap.add_argument("--seq", type=int, default=4096, help="Tokens per sample (one sample per GPU per step).")
    ap.add_argument("--steps", type=int, default=8, help="Timed steps after 2 warm-up steps.")
    ap.add_argument("--ttt", type=int, default=7, help="TTT length.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--featureset", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.featureset, args.steps, args.ttt, args.out)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        fs_dir = Path(d) / "fs"
        fs_dir.mkdir()
        write_random_featureset(fs_dir, max(worlds) * (args.steps + 3), args.seq, LLAMA8B_DRAFT)
        for w in worlds:
            r = launch(w, fs_dir, args.steps, args.ttt, Path(d) / f"w{w}.json")
            ms = max(p[0] for p in r["per_rank"])
            tps = w * r["T"] / (ms * 1e-3)
            rows.append({"GPUs": w, "ms_per_step": ms, "tokens_per_s": tps, "tokens_per_s_per_GPU": tps / w,
                         "MFU_%_per_GPU": 100 * flops_per_token(LLAMA8B_DRAFT, r["T"], args.ttt) * tps / w / 1e12
                         / MATMUL_TFLOPS,
                         "optimizer_state_GiB_per_rank": [round(p[1] / 2**30, 3) for p in r["per_rank"]],
                         "peak_GiB_max": max(p[2] for p in r["per_rank"]),
                         "reduce_scatter_MB_per_rank": r["trainable_params"] * 4 * (w - 1) / w / 1e6,
                         "distributed_type": r["distributed_type"]})
    one = next((r for r in rows if r["GPUs"] == 1), None)
    for r in rows:
        if one:
            r["scaling_efficiency_%"] = 100 * r["tokens_per_s"] / (r["GPUs"] * one["tokens_per_s"])
    print_table(rows, ["GPUs", "ms_per_step", "tokens_per_s", "tokens_per_s_per_GPU", "MFU_%_per_GPU",
                       "scaling_efficiency_%", "peak_GiB_max", "optimizer_state_GiB_per_rank",
                       "reduce_scatter_MB_per_rank"])
    print(write_result("train_scaling", rows, {"seq": args.seq, "ttt": args.ttt, "steps": args.steps}))


if __name__ == "__main__":
    main()
