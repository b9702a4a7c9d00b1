"""DFlash's first loss and its final norm's initial weight, on a captured feature set (CPU).

    python -m benchmarks.dflash_init FEATURES [--inits 1,0.5,0.25,0.1] [--train-inits 1,0.1]
                                     [--steps 100] [--out dflash_init]

FEATURES: a feature set with DFlash's layers (`sf-capture ... --families dflash`), of the
embedded SmolLM2 (or any target whose weights resolve from the manifest).

1. The first loss of a fresh draft (the family's own build, 5 layers, block 16, 64 anchors on the
   first 8 samples) per initial weight of its final RMSNorm (`--final-norm-init`), and with the
   target's own final-norm weight; with the fresh draft's logit spread against the target's.
2. Training from two of those initial weights, with the same seed, batches and anchors: AdamW at
   lr 2e-3 (the SmolLM2 recipes'), 20 warm-up steps then cosine, batches of 3 samples from all but
   the last 8 samples, 24 anchors a sample; every 25 steps the loss on the last 8 (48 anchors,
   a fixed draw) and the first two slots' accuracy. One thread: the figures repeat run to run.
JSON: results/<out>.json (rows: one per (init, step) of part 2; `first_loss`: part 1).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result
from specfoundry.common.target import resolve_target
from specfoundry.common.weights import read_target_tensor, target_lm_head
from specfoundry.families.dflash.family import DFlashFamily
from specfoundry.families.dflash.loss import dflash_loss
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.featureset.store import FeatureSet
from specfoundry.train.loader import BatchDataset

HELD_OUT = 8  # the last samples: the held-out loss of part 2 (and part 1's batch is the first 8)


def fresh_draft(fs: FeatureSet, target_dir: Path, init: float):
    torch.manual_seed(0)
    model, _ = DFlashFamily().build(DFlashOptions(final_norm_init=init), fs, target_dir,
                                    fs.manifest["aux_layer_ids"], None)
    return model.float()


def as_float(batch):
    """The loader's batch decoded as the trainer gets it (scaled storage dtypes dequantised), in float32."""
    return batch.to("cpu", torch.float32)


def loss_of(model, batch, head, anchors: int, seed: int):
    """(loss, per-slot accuracy) of the dflash objective over `anchors` anchors a sample."""
    loss, metrics = dflash_loss(model, batch, head, num_anchors=anchors, attention="sdpa", loss_kernel="reference",
                                seed=seed)
    return loss, [float(m["hits"]) / max(1.0, float(m["valid"])) for m in metrics]


def first_losses(fs, target_dir, head, inits: list[float]) -> list[dict]:
    batch = as_float(BatchDataset(fs, [list(range(HELD_OUT))], None, final=True)[0])
    target_logits = batch.final_hidden.float()[batch.loss_mask] @ head.T  # [rows, V]
    target_gap = (target_logits.max(-1).values - target_logits.mean(-1)).mean().item()
    final_norm = read_target_tensor(target_dir, ("model.norm.weight",)).float()
    rows = []
    for label, init in [(f"{x:g}", x) for x in inits] + [("the target's final-norm weight", None)]:
        model = fresh_draft(fs, target_dir, 1.0 if init is None else init)
        if init is None:
            model.norm.weight.data.copy_(final_norm)
        with torch.no_grad():
            loss, _ = loss_of(model, batch, head, 64, 0)
            states = model.train_forward(model.project_context(batch.aux_hidden), *first_block(model, batch))
            logits = model.block_logits(states.reshape(-1, states.shape[-1]), head)
        gap = (logits.max(-1).values - logits.mean(-1)).mean().item()
        rows.append({"final_norm_init": label, "first_loss": loss.item(), "max_minus_mean_logit": gap,
                     "target_max_minus_mean_logit": target_gap, "ln_V": math.log(head.shape[0])})
        print(f"final norm {label}: first loss {loss.item():.2f}, draft logit max - mean {gap:.1f} "
              f"(the target's {target_gap:.1f}), ln V {math.log(head.shape[0]):.2f}", flush=True)
    return rows


def first_block(model, batch):
    """The training forward's other inputs for 64 anchors a sample (seed 0)."""
    from specfoundry.families.dflash.anchors import batch_anchors, block_inputs

    anchors, keep = batch_anchors(batch, 64, model.cfg.block_size, 0)
    ids, positions = block_inputs(batch.input_ids, anchors, model.cfg.block_size, model.cfg.mask_token_id)
    return ids, positions, anchors, keep, batch.lengths, "sdpa"


def train_curve(fs, target_dir, head, init: float, steps: int) -> list[dict]:
    n = len(fs)
    train = list(range(n - HELD_OUT))
    batches = BatchDataset(fs, [train[i:i + 3] for i in range(0, len(train), 3)], None, final=False)
    data = [as_float(batches[k]) for k in range(len(batches))]
    held = as_float(BatchDataset(fs, [list(range(n - HELD_OUT, n))], None, final=False)[0])
    model = fresh_draft(fs, target_dir, init)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    warm = 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rows, t = [], time.perf_counter()
    for step in range(steps):
        loss, _ = loss_of(model, data[step % len(data)], head, 24, step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            with torch.no_grad():
                held_loss, acc = loss_of(model, held, head, 48, 123)
            rows.append({"final_norm_init": init, "step": step, "train_loss": loss.item(),
                         "held_out_loss": held_loss.item(), "acc_slot1": acc[0], "acc_slot2": acc[1],
                         "final_norm_mean": model.norm.weight.mean().item()})
            print(f"init {init:g} step {step}: train {loss.item():.2f}, held-out {held_loss.item():.2f}, "
                  f"slot 1 acc {acc[0]:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("features", help="A feature set with DFlash's layers.")
    ap.add_argument("--inits", default="1,0.5,0.25,0.1", help="Final-norm weights of part 1.")
    ap.add_argument("--train-inits", default="1,0.1", help="Final-norm weights trained in part 2 (empty: skip it).")
    ap.add_argument("--steps", type=int, default=100, help="Optimizer steps of each part-2 run.")
    ap.add_argument("--out", default="dflash_init", help="Result name under benchmarks/results/.")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fs = FeatureSet(args.features)
    target_dir = Path(fs.manifest["target"]["path"])
    if not target_dir.exists():
        target_dir = resolve_target(fs.manifest["target"]["name"])
    head = target_lm_head(target_dir).float()  # [V, H]
    first = first_losses(fs, target_dir, head, [float(x) for x in args.inits.split(",")])
    rows = [r for init in filter(None, args.train_inits.split(","))
            for r in train_curve(fs, target_dir, head, float(init), args.steps)]
    print_table(first, ["final_norm_init", "first_loss", "max_minus_mean_logit", "target_max_minus_mean_logit"])
    if rows:
        print_table(rows, ["final_norm_init", "step", "train_loss", "held_out_loss", "acc_slot1", "acc_slot2"])
    print(write_result(args.out, rows, {"first_loss": first, "features": str(args.features),
                                         "samples": len(fs), "steps": args.steps}))


if __name__ == "__main__":
    main()
