"""The training loop: Accelerate for devices, mixed precision, accumulation and sharding.

ZeRO-2 is FSDP SHARD_GRAD_OP through Accelerate (chosen over DeepSpeed: no extra dependency or
JIT build, works with torch.compile and FlexAttention, and Accelerate's FSDP plugin is plain
PyTorch): parameters stay whole on every rank after the forward, gradients are reduce-scattered
and the optimizer state is sharded. The same code runs as one CPU process, one GPU, or many GPUs
under `accelerate launch --config_file recipes/accelerate_zero2.yaml`.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specfoundry.common.progress import Progress
from specfoundry.common.target import load_tokenizer, resolve_target, target_identity
from specfoundry.featureset.manifest import check_matches_target, tokenizer_hashes
from specfoundry.featureset.store import FeatureSet
from specfoundry.train.config import draft_config_from_target
from specfoundry.train.export import export_draft
from specfoundry.train.loader import Batch, FeatureLoader, split_indices
from specfoundry.train.model import Eagle3Draft
from specfoundry.train.teacher import target_embeddings, target_lm_head
from specfoundry.train.ttt import TTTModule, summarise
from specfoundry.train.vocab import choose_draft_vocab, vocab_maps


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of one sf-train run (the resolved config is written next to the checkpoints)."""

    featureset: str
    output: str
    target: str = "smollm2"
    draft_vocab_size: int = 32000
    ttt_length: int = 7
    loss_decay: float = 0.8
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_steps: int = 1000
    epochs: float | None = None
    """If set, train this many passes over the data instead of max_steps."""
    max_tokens: int = 8192
    """Padded tokens per micro-batch per rank."""
    max_length: int | None = None
    pad_multiple: int | None = None
    """Round batch widths up to a multiple of this; None: 128 (FlexAttention's block) when the
    attention is compiled FlexAttention, else 1 (no rounding)."""
    grad_accum: int = 1
    clip_grad: float = 0.5
    seed: int = 0
    eval_fraction: float = 0.05
    eval_every: int = 200
    save_every: int = 500
    keep_last: int = 2
    attention: str = "auto"
    """auto (flex on CUDA, SDPA dense mask on CPU), flex, sdpa, or eager (original EAGLE-3)."""
    loss: str = "auto"
    """auto (Triton in-place on CUDA), triton, or reference (plain torch)."""
    num_workers: int = 2
    init_from: str | None = None
    """An exported draft to fine-tune (keeps its vocabulary map)."""
    tensorboard: bool = False
    log_every: int = 10


def resolved_pad_multiple(cfg: TrainConfig, device: torch.device) -> int:
    """Batch width rounding: compiled FlexAttention recompiles for every new shape, so its
    batches are padded to its 128-token block; the dense paths take any width."""
    if cfg.pad_multiple is not None:
        if cfg.pad_multiple < 1:
            raise ValueError(f"--pad-multiple must be >= 1, got {cfg.pad_multiple}")
        return cfg.pad_multiple
    flex = cfg.attention == "flex" or (cfg.attention == "auto" and device.type == "cuda")
    return 128 if flex else 1


class NullTracker:
    def log(self, values: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorboardTracker:
    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(logdir))

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def lr_lambda(warmup: int, total: int):
    """Linear warmup, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_draft(cfg: TrainConfig, fs: FeatureSet, target_dir: Path):
    manifest = fs.manifest
    if cfg.init_from:
        from specfoundry.train.export import load_export

        dcfg, tensors = load_export(cfg.init_from)
        model = Eagle3Draft(dcfg)
        model.load_state_dict(tensors, strict=False)
    else:
        counts = fs.token_counts()
        draft_ids = choose_draft_vocab(counts, min(cfg.draft_vocab_size, counts.numel()))
        dcfg = draft_config_from_target(target_dir, len(draft_ids), manifest["aux_layer_ids"])
        model = Eagle3Draft(dcfg)
        d2t, t2d = vocab_maps(draft_ids, dcfg.vocab_size)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    model.embed_tokens.weight.data.copy_(target_embeddings(target_dir).float())
    return model, dcfg


def checkpoint_dirs(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def train(cfg: TrainConfig, silent: bool = False) -> dict:
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed

    # cpu=True on a machine without CUDA: without it Accelerate does not set up gloo under
    # torchrun and every process would silently train the whole set on its own.
    # Every buffer (frozen embeddings, vocab maps, teacher head) is constant: DDP need not
    # broadcast them at each forward.
    accel = Accelerator(gradient_accumulation_steps=cfg.grad_accum, cpu=not torch.cuda.is_available(),
                        mixed_precision="bf16" if torch.cuda.is_available() else "no",
                        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    set_seed(cfg.seed)
    if cfg.attention == "flex" and accel.device.type != "cuda":
        # torch implements FlexAttention's forward but not its backward on CPU
        raise ValueError("--attention flex needs a GPU (FlexAttention has no backward on CPU); "
                         "use --attention auto or sdpa here")
    out = Path(cfg.output)
    target_dir = resolve_target(cfg.target)
    fs = FeatureSet(cfg.featureset)
    identity = target_identity(cfg.target, target_dir)
    check_matches_target(fs.manifest, hidden_size=identity.hidden_size, vocab_size=identity.vocab_size,
                         tokenizer_sha256=tokenizer_hashes(load_tokenizer(target_dir))[0],
                         source=f"feature set {cfg.featureset}")
    draft, dcfg = build_draft(cfg, fs, target_dir)
    dtype = torch.bfloat16 if accel.device.type == "cuda" else torch.float32
    model = TTTModule(draft, target_lm_head(target_dir).to(dtype))

    train_idx, eval_idx = split_indices(len(fs), cfg.eval_fraction, cfg.seed)
    pad = resolved_pad_multiple(cfg, accel.device)
    loader = FeatureLoader(fs, train_idx, max_tokens=cfg.max_tokens, seed=cfg.seed, rank=accel.process_index,
                           world=accel.num_processes, num_workers=cfg.num_workers, max_length=cfg.max_length,
                           pad_multiple=pad, pin_memory=accel.device.type == "cuda")
    per_epoch = max(1, loader.batches_per_epoch() // cfg.grad_accum)
    total_steps = int(math.ceil(cfg.epochs * per_epoch)) if cfg.epochs else cfg.max_steps
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, total_steps))
    # The scheduler is not prepared: Accelerate would step it num_processes times per step (it
    # assumes a per-process dataloader length), but total_steps already counts optimizer steps.
    param_bytes = sum(p.numel() * p.element_size() for p in draft.trainable_parameters())  # before sharding
    model, optimizer = accel.prepare(model, optimizer)
    accel.register_for_checkpointing(scheduler)
    raw = accel.unwrap_model(model)
    if accel.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        (out / "draft_config.json").write_text(json.dumps(dcfg.to_dict(), indent=2) + "\n")

    step, history = 0, []
    existing = checkpoint_dirs(out)
    if existing:  # resume from the newest checkpoint: weights, optimizer, scheduler, RNG, loader, history
        accel.load_state(str(existing[-1]))
        state = json.loads((existing[-1] / "trainer_state.json").read_text())
        step = state["step"]
        loader.load_state_dict(state["loader"][accel.process_index])
        history = state.get("history", [])  # so history.json covers the whole run, not the last leg

    tracker = TensorboardTracker(out / "tensorboard") if cfg.tensorboard and accel.is_main_process else NullTracker()
    data = iter(loader)

    def run_batch(batch: Batch, grad: bool):
        batch = batch.to(accel.device, dtype)
        with accel.autocast():
            # accel.backward divides the loss by the accumulation steps: that is the gradient into it
            return (model if grad else raw)(batch, ttt_length=cfg.ttt_length, decay=cfg.loss_decay,
                                            attention=cfg.attention, loss_kernel=cfg.loss,
                                            loss_scale=1.0 / cfg.grad_accum)

    with Progress(total_steps, "step", "sf-train", silent or not accel.is_main_process, initial=step) as progress:
        while step < total_steps:
            model.train()
            step_metrics, tokens = [], 0
            for _ in range(cfg.grad_accum):
                batch = next(data)
                tokens += sum(batch.lengths)
                with accel.accumulate(model):
                    loss, metrics = run_batch(batch, grad=True)
                    accel.backward(loss)
                    if accel.sync_gradients and cfg.clip_grad:
                        accel.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                    optimizer.step()
                    if accel.sync_gradients:
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                step_metrics.append(metrics)
            step += 1
            summary = summarise(merge_metrics(step_metrics, accel))
            summary["lr"] = scheduler.get_last_lr()[0]
            history.append({"step": step, **summary})
            tracker.log({f"train/{k}": v for k, v in summary.items()}, step)
            progress.update(1, tokens * accel.num_processes)
            if step % cfg.log_every == 0 and accel.is_main_process and not silent:
                progress.bar.write(f"step {step}: loss_0 {summary['loss_0']:.3f} acc_0 {summary['acc_0']:.3f} "
                                   f"sim_accept_len {summary['sim_accept_len']:.2f}")
            if eval_idx and (step % cfg.eval_every == 0 or step == total_steps):
                ev = evaluate(raw, fs, eval_idx, cfg, accel, run_batch)
                history[-1].update({f"eval_{k}": v for k, v in ev.items()})
                tracker.log({f"eval/{k}": v for k, v in ev.items()}, step)
            if step % cfg.save_every == 0 or step == total_steps:
                save_checkpoint(accel, out, step, loader, cfg.keep_last, history)
    tracker.close()
    # ZeRO-2 evidence: each rank's optimizer state (Adam moments) should be ~1/world of the whole
    state_bytes = torch.tensor([optimizer_state_bytes(optimizer)], device=accel.device)
    per_rank = accel.gather(state_bytes).tolist()
    # a collective under FSDP (the full state dict is gathered): every rank must call it
    state = accel.get_state_dict(model) if accel.num_processes > 1 else raw.state_dict()
    if accel.is_main_process:
        (out / "train_summary.json").write_text(json.dumps({
            "steps": step, "world_size": accel.num_processes, "distributed_type": str(accel.distributed_type),
            "optimizer_state_bytes_per_rank": per_rank,
            "trainable_parameter_bytes": param_bytes,
        }, indent=1) + "\n")
        export_draft({k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}, dcfg,
                     out / "export")
        (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")
    accel.wait_for_everyone()
    return {"steps": step, "history": history, "export": str(out / "export")}


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors this rank keeps in the optimizer state."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def merge_metrics(per_micro: list[list[dict]], accel) -> list[dict]:
    """Sum hits/valid over micro-batches and ranks; average losses."""
    merged = []
    for s in range(min(len(m) for m in per_micro)):
        hits = sum(m[s]["hits"] for m in per_micro)
        valid = sum(m[s]["valid"] for m in per_micro)
        loss = sum(m[s]["loss"] for m in per_micro) / len(per_micro)
        stacked = torch.stack([hits.float(), valid.float(), loss.float()])
        if accel.num_processes > 1:
            stacked = accel.reduce(stacked, reduction="sum")
            stacked[2] /= accel.num_processes
        merged.append({"hits": stacked[0], "valid": stacked[1], "loss": stacked[2]})
    return merged


@torch.no_grad()
def evaluate(model, fs, eval_idx, cfg, accel, run_batch) -> dict:
    model.eval()
    loader = FeatureLoader(fs, eval_idx, max_tokens=cfg.max_tokens, seed=cfg.seed, rank=accel.process_index,
                           world=accel.num_processes, num_workers=0, max_length=cfg.max_length,
                           pad_multiple=resolved_pad_multiple(cfg, accel.device))
    n = loader.batches_per_epoch()
    per_micro = []
    for _, batch in zip(range(n), loader, strict=False):
        _, metrics = run_batch(batch, grad=False)
        per_micro.append(metrics)
    return summarise(merge_metrics(per_micro, accel)) if per_micro else {}


def save_checkpoint(accel, out: Path, step: int, loader: FeatureLoader, keep_last: int, history: list[dict]) -> None:
    path = out / "checkpoints" / f"step-{step:07d}"
    accel.save_state(str(path))
    states = [None] * accel.num_processes
    if accel.num_processes > 1:
        import torch.distributed as dist

        dist.all_gather_object(states, loader.state_dict())
    else:
        states = [loader.state_dict()]
    if accel.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "loader": states, "history": history}) + "\n")
        for old in checkpoint_dirs(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accel.wait_for_everyone()
