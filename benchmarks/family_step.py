"""The DFlash-backbone families' training step at SmolLM2's shape, by how each loss takes its gradient.

    python -m benchmarks.family_step [--samples 48] [--seq 340] [--steps 6] [--families dflash,domino,dspark,dflash2]
                                     [--out family_step]

DFlash, Domino and DSpark drafts of SmolLM2-135M as recipes/smollm2-h200-dflash.yaml trains them
(5 layers, H 576, 9 query / 3 KV heads of 64, target vocab 49,152, block 16, 256 anchors a sample;
the options' defaults: GRU 1024, correction 256, Markov rank 256; DFlash2's convolution of 2 taps in
groups of 16, its selector of rank 256 over the top 16), on one in-memory batch of random
features (--samples rows of --seq tokens: ~16k tokens, the recipe's batch; each row's loss region
one contiguous answer after a prompt). The step is the module's forward and backward under bf16
autocast (no optimizer: it is the same for all). DFlash's loss takes its gradient by hand. Domino's
and DSpark's run both ways: by hand (`gradient="manual"`, their default), and through autograd,
chunk by chunk under activation checkpointing (their reference path). Each hand-written loss runs
twice (`chunk_math`): its [c, V] chunk math compiled, as sf-train runs it on a GPU, and eager, as
it ran before (the same module with the loss's compile switch held off). DFlash runs with each
teacher (`teacher_loss`): the hard labels, and the soft teacher (the target's distribution through
its lm_head over the stored final state) with the cross-entropy and with LK-lambda, whose compiled
chunk math is the teacher's softmax. CUDA events after warm-up (compiles included there); peak from
max_memory_allocated. DFlash2 (its gold selector objective) runs as sf-train runs it and against two
baselines: its selector loss in the unary loss's 1,024-row chunks (SELECTOR_PER_SLOT: launches a step)
and its convolution eager (CONV_EAGER: the shifted copies its backward keeps, in peak memory).
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack, nullcontext
from unittest import mock

import torch

from benchmarks.common import print_table, write_result
from benchmarks.train_step import time_steps
from specfoundry.families.dflash.config import DFlashConfig
from specfoundry.families.dflash.loss import DFlashModule
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dflash2.config import DFLASH2_FIELDS, DFlash2Config
from specfoundry.families.dflash2.conv import GroupedDynamicCausalConv
from specfoundry.families.dflash2.loss import DFlash2Module
from specfoundry.families.dflash2.model import DFlash2Draft
from specfoundry.families.dflash2.options import DFlash2Options
from specfoundry.families.domino.config import DominoConfig
from specfoundry.families.domino.loss import DominoModule
from specfoundry.families.domino.model import DominoDraft
from specfoundry.families.dspark.config import DSparkConfig
from specfoundry.families.dspark.loss import DSparkModule
from specfoundry.families.dspark.model import DSparkDraft
from specfoundry.featureset.batch import Batch
from specfoundry.kernels.lk_loss import TokenLoss

LOSS_MODULES = ("specfoundry.families.dflash.loss", "specfoundry.families.domino.loss",
                "specfoundry.families.dspark.loss")
"""The modules whose hand-written chunk math follows the draft's compile switch (compiles_elementwise)."""


def eager_chunk_math():
    """Hold each loss's chunk math eager while the draft's own chains stay compiled: the baseline."""
    stack = ExitStack()
    for name in LOSS_MODULES:
        stack.enter_context(mock.patch(f"{name}.compiles_elementwise", lambda model: False))
    return stack

SMOL_DFLASH = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                   vocab_size=49152, target_hidden_size=576, target_layer_ids=(1, 7, 14, 21, 27), block_size=16,
                   mask_token_id=0)
ANCHORS = 256


def random_batch(samples: int, seq: int, cfg: DFlashConfig) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (samples, seq), generator=g)
    # the loss region as in a conversation: one contiguous answer after a prompt of 10-40% of the row
    # (DSpark counts a block's supervised prefix only, so a scattered mask would undercount its rows)
    starts = (torch.rand(samples, 1, generator=g) * 0.3 + 0.1) * seq
    mask = torch.arange(seq)[None] >= starts
    aux = torch.randn(samples, seq, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=g)
    final = torch.randn(samples, seq, cfg.hidden_size, generator=g)
    return Batch(ids, mask, aux, final, [seq] * samples, list(range(samples)), 0).to("cuda", torch.bfloat16)


SELECTOR_PER_SLOT = "compiled, selector in 1,024-row chunks"
CONV_EAGER = "compiled, convolution eager"
"""DFlash2's baselines: its selector loss in the unary loss's chunks of 1,024 rows (as it ran before
loss.py's selector_rows), and its convolution eager (as before it joined the compiled chains)."""

# family, teacher and token loss, gradient, chunk math: the rows, in order
ROWS = (("dflash", "hard ce", "manual", "eager"), ("dflash", "hard ce", "manual", "compiled"),
        ("dflash", "soft ce", "manual", "eager"), ("dflash", "soft ce", "manual", "compiled"),
        ("dflash", "soft lk-lambda", "manual", "eager"), ("dflash", "soft lk-lambda", "manual", "compiled"),
        ("domino", "hard ce", "autograd", "-"), ("domino", "hard ce", "manual", "eager"),
        ("domino", "hard ce", "manual", "compiled"), ("dspark", "hard ce", "autograd", "-"),
        ("dspark", "hard ce", "manual", "eager"), ("dspark", "hard ce", "manual", "compiled"),
        ("dflash2", "hard ce", "manual", SELECTOR_PER_SLOT), ("dflash2", "hard ce", "manual", CONV_EAGER),
        ("dflash2", "hard ce", "manual", "compiled"))



def module(family: str, teacher_loss: str, gradient: str):
    torch.manual_seed(0)
    head = (torch.randn(SMOL_DFLASH["vocab_size"], SMOL_DFLASH["hidden_size"]) * 0.02).to(torch.bfloat16)
    if family == "dflash":
        teacher, loss = teacher_loss.split()
        return DFlashModule(DFlashDraft(DFlashConfig(**SMOL_DFLASH)), head, num_anchors=ANCHORS, teacher=teacher,
                            token_loss=TokenLoss(loss))
    if family == "domino":
        draft = DominoDraft(DominoConfig(**SMOL_DFLASH, gru_hidden_dim=1024, emb_dim=256))
        return DominoModule(draft, head, num_anchors=ANCHORS, gradient=gradient)
    if family == "dspark":
        draft = DSparkDraft(DSparkConfig(**SMOL_DFLASH, markov_rank=256))
        return DSparkModule(draft, head, num_anchors=ANCHORS, gradient=gradient)
    own = DFlash2Options()
    draft = DFlash2Draft(DFlash2Config(**SMOL_DFLASH, **{name: getattr(own, name) for name in DFLASH2_FIELDS}))
    return DFlash2Module(draft, head, num_anchors=ANCHORS)


def dflash2_baseline(math: str):
    """The patch that runs a DFlash2 row's baseline (SELECTOR_PER_SLOT, CONV_EAGER); none for the others."""
    if math == SELECTOR_PER_SLOT:
        return mock.patch("specfoundry.families.dflash2.loss.selector_rows", lambda *_: 1024)
    if math == CONV_EAGER:
        return mock.patch.object(GroupedDynamicCausalConv, "elementwise", lambda self, fn, *args: fn(*args))
    return nullcontext()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48, help="Rows in the batch (default: %(default)s).")
    ap.add_argument("--seq", type=int, default=340, help="Tokens per row (default: %(default)s).")
    ap.add_argument("--steps", type=int, default=6, help="Timed steps after 2 warm-up steps (default: %(default)s).")
    ap.add_argument("--families", default="dflash,domino,dspark,dflash2",
                    help="The families measured, comma-separated (default: %(default)s).")
    ap.add_argument("--out", default="family_step", help="The result's name under benchmarks/results/ (or a path; default: %(default)s).")
    args = ap.parse_args()
    families = args.families.split(",")
    known = sorted({row[0] for row in ROWS})
    unknown = sorted(set(families) - set(known))
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)} ({', '.join(known)})")
    batch = random_batch(args.samples, args.seq, DFlashConfig(**SMOL_DFLASH))
    rows = []
    for family, teacher_loss, gradient, math in (row for row in ROWS if row[0] in families):
        model = module(family, teacher_loss, gradient).cuda()

        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = model(batch, attention="flex")
            loss.backward()
            model.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        with eager_chunk_math() if math == "eager" else dflash2_baseline(math):
            ms = time_steps(step, args.steps)
        rows.append({"family": family, "teacher_loss": teacher_loss, "loss_gradient": gradient, "chunk_math": math,
                     "ms_per_step": ms,
                     "tokens_per_s": args.samples * args.seq / (ms * 1e-3),
                     "peak_GiB": torch.cuda.max_memory_allocated() / 2**30})
        print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    print_table(rows, ["family", "teacher_loss", "loss_gradient", "chunk_math", "ms_per_step", "tokens_per_s",
                       "peak_GiB"])
    print(write_result(args.out, rows, {"settings": vars(args)}))


if __name__ == "__main__":
    main()
