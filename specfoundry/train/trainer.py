"""sf-train's Trainer: Accelerate for devices, mixed precision, accumulation and sharding.

`Trainer.train` drives build → resume → (train_step, evaluate, checkpoint)* → write_outputs; each is a
method that tests and benchmarks can call alone. `train_step` is one optimizer step over
grad_accum micro-batches, each one `forward_backward` (the TTT forward and its backward).

ZeRO-2 is FSDP SHARD_GRAD_OP through Accelerate (chosen over DeepSpeed: no extra dependency or
JIT build, works with torch.compile and FlexAttention, and Accelerate's FSDP plugin is plain
PyTorch): parameters stay whole on every rank after the forward, gradients are reduce-scattered
and the optimizer state is sharded. The same code runs as one CPU process, one GPU, or many GPUs
under `accelerate launch --config_file recipes/accelerate_zero2.yaml`.

Every file a run writes becomes visible only when complete: files are written aside and renamed,
and a checkpoint is written as `step-N.tmp` and renamed to `step-N` once whole (checkpoints.py);
resume trusts only such complete checkpoints. metrics.py merges and logs what a step reports.
"""

from __future__ import annotations

import math
import pickle
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import SafetensorError

from specfoundry.common.files import atomic_write_json, remove_temporaries, write_dir_whole
from specfoundry.common.placement import check_one_launch, gathered
from specfoundry.common.progress import Progress
from specfoundry.common.settings import (
    Range,
    Settings,
    config_dict,
    resume_settings,
    setting,
    shared,
    unique_options,
)
from specfoundry.common.shards import check_output_folder, record_config
from specfoundry.common.taps import parse_layer_ids
from specfoundry.common.target import (
    COMPLETION,
    EMBEDDED_DEFAULT,
    announce_target,
    load_tokenizer,
    resolve_target,
    target_identity,
)
from specfoundry.common.weights import weight_fingerprint
from specfoundry.families import FAMILIES, family_names
from specfoundry.families.folders import TARGET_FILE, TRAINING_FILE, check_finite, serving_verifier
from specfoundry.featureset.batch import Batch
from specfoundry.featureset.manifest import (
    FeatureSetError,
    check_matches_target,
    manifest_sha256,
    tokenizer_hashes,
)
from specfoundry.featureset.store import FeatureSet
from specfoundry.kernels.lk_loss import TOKEN_LOSSES, TokenLoss
from specfoundry.train.checkpoints import (
    BEST,
    check_process_count,
    check_random_states,
    newest_complete_checkpoint,
    read_best,
    read_best_state,
    read_trainer_state,
    write_best,
    write_checkpoint,
)
from specfoundry.train.loader import FeatureLoader, select_layers, split_indices
from specfoundry.train.metrics import (
    NullTracker,
    TensorboardTracker,
    merge_metrics,
    optimizer_state_bytes,
    summarise,
)
from specfoundry.train.profiling import LoopClock, StepProfiler

ATTENTIONS = ("auto", "flex", "sdpa", "eager")
LOSS_KERNELS = ("auto", "triton", "reference")


@unique_options
@dataclass(frozen=True, kw_only=True)
@FAMILIES.option_groups(after="layers")
class TrainConfig(Settings):
    """Settings of one sf-train run (recorded in train_config.json beside the checkpoints). After
    `layers`, one field per registered family (families/__init__.py) holds its options group: eagle3,
    dflash, ...; every option name is unique across the groups (unique_options, at import)."""

    DECIDED_TOGETHER: ClassVar = {("max_steps", "epochs"): "--max-steps and --epochs both set how long to train: give "
                                  "one (--epochs, when given, replaces --max-steps)"}  # the command line's, over the recipe's

    def unread_groups(self) -> set[str]:
        """The option groups of the families this run's family does not extend: a change to their
        defaults is no change to this run, so a resume does not compare them."""
        return set(FAMILIES.names()) - {f.name for f in FAMILIES.chain(self.family)}

    featureset: str = setting(argument=True, help="Feature-set folder written by sf-capture.")
    output: str = shared("output", resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    family: str = shared("family", FAMILIES.default, choices=family_names(), help=FAMILIES.family_help())
    layers: tuple[int, ...] | None = setting(None, parse=parse_layer_ids,
                                             shown="the set's layers if it holds as many as the family reads, else "
                                                   "the family's default",
                                             help="Comma-separated ids of the stored target layers the draft reads.")
    lr: float = setting(1e-4, valid=Range(0, 1, min_open=True), help="Peak AdamW learning rate.")
    weight_decay: float = setting(0.0, valid=Range(0, 1, zero="off"), help="AdamW weight decay.")
    warmup_steps: int = setting(50, valid=Range(0, zero="no warmup"), help="Linear warmup steps before the cosine "
                                "decay.")
    max_steps: int = shared("max_steps", 1000)
    epochs: float | None = setting(None, shown="none: --max-steps", valid=Range(0, min_open=True),
                                   help="Train this many passes over the training split instead of --max-steps.")
    # per micro-batch and rank; batches are length-grouped
    max_batch_tokens: int = shared("max_batch_tokens", 8192)
    # samples are truncated to it; it may not exceed the length the feature set was captured at
    max_length: int | None = shared("max_length", None, shown="the feature set's")
    pad_multiple: int | None = setting(None, shown="128 with FlexAttention, else 1", valid=Range(1, 4096),
                                       help="Round batch widths up to a multiple of this, so compiled kernels see "
                                            "few shapes.")
    grad_accum: int = setting(1, valid=Range(1, 4096), help="Micro-batches per optimizer step.")
    clip_grad: float = setting(0.5, valid=Range(0, zero="off"), help="Gradient-norm clip.")
    seed: int = shared("seed", 0)
    eval_fraction: float = setting(0.05, valid=Range(0, 1, max_open=True, zero="no evaluation"),
                                   help="Held-out fraction of samples for evaluation.")
    eval_every: int = setting(200, valid=Range(1), help="Evaluate every N optimizer steps (and at the end).")
    save_every: int = setting(500, resume=False, valid=Range(1),
                              help="Checkpoint every N optimizer steps (and at the end).")
    keep_last: int = setting(2, resume=False, valid=Range(0, zero="every one"), help="Complete checkpoints kept.")
    attention: str = setting("auto", choices=ATTENTIONS, help="auto: FlexAttention on CUDA, SDPA with the dense "
                             "tree mask on CPU; eager: the original EAGLE-3 formulation.")
    loss_kernel: str = setting("auto", choices=LOSS_KERNELS, help="The token loss's kernel. auto: the in-place "
                               "Triton kernel on CUDA; reference: plain torch.")
    token_loss: str = setting("ce", choices=TOKEN_LOSSES, before="ce",
                              help="What each predicted token is trained on, by family: "
                                   + FAMILIES.grouped(lambda f: ", ".join(f.token_losses))
                                   + " (docs/families.md, \"Objectives\").")
    lk_kl_scale: float = setting(1.0, valid=Range(0, 100, zero="TV alone"), before=1.0,
                                 help="LK-lambda: the KL weight where alpha is 0.")
    lk_kl_decay: float = setting(3.0, valid=Range(0, 100, zero="a constant KL weight"), before=3.0,
                                 help="LK-lambda: how fast the KL weight falls as alpha rises (the LK paper's eta).")
    keep_best: bool = setting(False, before=False, help="Export the draft of the evaluation with the highest held-out "
                              "simulated acceptance length instead of the last step's (needs held-out samples).")
    num_workers: int = setting(2, resume=False, valid=Range(0, 256, zero="read in the training process"),
                               help="Background loader workers per rank.")
    verify_shards: bool = setting(True, resume=False, help="Check every shard's checksum before training, so a "
                                  "damaged shard is named at the start instead of trained on.")
    init_from: str | None = setting(None, shown="none: a fresh draft", path=True,
                                    help="An exported draft to fine-tune (keeps its vocabulary map).")
    tensorboard: bool = setting(False, resume=False, help="Log to <output>/tensorboard.")
    log_every: int = setting(10, resume=False, valid=Range(1), help="Print metrics every N optimizer steps, with "
                             "the host time a step spent waiting for its batch and in the step itself.")
    # at most 1000: the profiler holds every event of its window in host memory until it ends
    profile_steps: int = setting(0, resume=False, valid=Range(0, 1000, zero="off"),
                                 help="Profile this many optimizer steps (torch.profiler, after the first 3) and "
                                      "write <output>/profile.txt: operators by GPU time and by host time.")

    def __post_init__(self):
        super().__post_init__()
        family = FAMILIES.get(self.family)  # an unknown name is refused however the config is built
        if self.token_loss not in family.token_losses:
            raise ValueError(f"--token-loss {self.token_loss}: the {self.family} family trains with "
                             f"{', '.join(family.token_losses)}")
        if self.keep_best and not self.eval_fraction:
            raise ValueError("--keep-best picks by the held-out evaluation: give --eval-fraction above 0")

    @property
    def objective(self) -> TokenLoss:
        return TokenLoss(self.token_loss, self.lk_kl_scale, self.lk_kl_decay)


class NonFiniteError(ValueError):
    """Training met a non-finite loss: nothing after it is checkpointed or exported."""


class NothingLearnedError(ValueError):
    """No micro-batch of the run held a position the draft could be trained on: nothing is exported."""


def skipped_report(skipped: int, micro_batches: int) -> str | None:
    """What the run's end says of its micro-batches with nothing to learn (over every rank): an error
    (NothingLearnedError) where none of them had a trainable position, a warning where most had none,
    else None."""
    why = ("no supervised token within --max-length, or none where the draft's vocabulary holds the target's own "
           "next token: raise --max-length or --draft-vocab-size, have the target write the answers (sf-regen), "
           "or check the feature set's loss mask")
    if micro_batches and skipped >= micro_batches:
        raise NothingLearnedError(f"every one of the run's {micro_batches} micro-batches had no position to train "
                                  f"({why}); nothing exported, and its checkpoints, the draft as it began, removed")
    if skipped * 2 > micro_batches:
        return f"{skipped} of {micro_batches} micro-batches had no position to train ({why})"
    return None


def check_featureset(fs: FeatureSet, cfg: TrainConfig, target_dir: Path):
    """Refuse a feature set that is incomplete, was captured from another target, or is shorter
    than the run's max_length; each message names what differs. Returns the target's identity."""
    manifest = fs.manifest
    if not manifest.get("complete"):
        raise FeatureSetError(f"feature set {cfg.featureset} is incomplete: rerun its sf-capture command to finish it")
    identity = target_identity(cfg.target, target_dir)
    # a template the capture was given from a file is its own record (the hash in the manifest);
    # the target's own and the completion template are checked against the target's tokenizer
    source = manifest.get("chat_template_source", "target")
    tokenizer_sha256, template_sha256 = tokenizer_hashes(
        load_tokenizer(target_dir, COMPLETION if source == COMPLETION else None))
    if source not in ("target", COMPLETION):
        template_sha256 = None
    check_matches_target(manifest, hidden_size=identity.hidden_size, vocab_size=identity.vocab_size,
                         tokenizer_sha256=tokenizer_sha256, chat_template_sha256=template_sha256,
                         config_sha256=identity.config_sha256, weight_fingerprint=weight_fingerprint(
                             target_dir, like=manifest["target"].get("weight_fingerprint")),
                         source=f"feature set {cfg.featureset}")
    if cfg.max_length is not None and cfg.max_length > manifest["max_length"]:
        raise FeatureSetError(f"--max-length {cfg.max_length} is longer than feature set {cfg.featureset} was "
                              f"captured for (max_length {manifest['max_length']})")
    return identity


def planned_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: --epochs passes over the training split when given, else --max-steps."""
    return int(math.ceil(cfg.epochs * steps_per_epoch)) if cfg.epochs is not None else cfg.max_steps


def resolved_pad_multiple(cfg: TrainConfig, device: torch.device) -> int:
    """Batch width rounding: compiled FlexAttention recompiles for every new shape, so its
    batches are padded to its 128-token block; the dense paths take any width."""
    if cfg.pad_multiple is not None:
        if cfg.pad_multiple < 1:
            raise ValueError(f"--pad-multiple must be >= 1, got {cfg.pad_multiple}")
        return cfg.pad_multiple
    flex = cfg.attention == "flex" or (cfg.attention == "auto" and device.type == "cuda")
    return 128 if flex else 1


def lr_lambda(warmup: int, total: int):
    """Linear warmup, then cosine decay to 10% of the peak; `step` counts optimizer steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Trainer:
    """One sf-train run. `step` counts optimizer steps done; a micro-batch is one of the
    grad_accum batches of an optimizer step; TTT steps live inside the forward (ttt.py)."""

    def __init__(self, cfg: TrainConfig, silent: bool = False, target_dir: Path | None = None):
        """`target_dir`: cfg.target's directory where the caller resolved it already (the gate)."""
        self.cfg, self.silent = cfg, silent
        self.target_dir = target_dir
        self.out = Path(cfg.output)
        self.step = 0
        self.skipped = 0  # micro-batches with nothing to learn, this run
        self.history: list[dict] = []
        self.tracker = NullTracker()

    # ---- build ----------------------------------------------------------------------------------

    def build(self) -> Trainer:
        """Accelerator, feature set, draft, teacher, loader, optimizer and scheduler; writes the
        resolved config and the draft's config into the run folder."""
        cfg = self.cfg
        self.accel = self.build_accelerator()
        self.target_dir = self.target_dir or resolve_target(cfg.target)
        if self.accel.is_main_process:
            announce_target("sf-train", cfg.target, self.target_dir)
        if self.accel.num_processes > 1:  # one command, settings and target on every rank, or one line on each
            check_one_launch(gathered({"command": "sf-train run", "settings": resume_settings(cfg), "target": {
                "config_sha256": target_identity(cfg.target, self.target_dir).config_sha256,
                "weight_fingerprint": weight_fingerprint(self.target_dir)},
                "featureset": {"manifest_sha256": manifest_sha256(cfg.featureset)}}),
                f"every rank of a launch must run the same command, settings and target weights over the same "
                f"feature set ({cfg.featureset})")
        check_output_folder(self.out, "train", cfg)  # before any long work
        self.fs = FeatureSet(cfg.featureset)
        identity = check_featureset(self.fs, cfg, self.target_dir)
        if cfg.verify_shards:
            self.check_shards()
        self.provider = FAMILIES.provider(cfg.family)
        options = FAMILIES.options_for(cfg, cfg.family)
        layers = select_layers(self.fs.manifest, self.provider, options, cfg.layers, identity.num_layers,
                               f"feature set {cfg.featureset}")
        if (self.fs.teacher_k and self.provider.needs_final_state(options)
                and not self.provider.trains_from_topk_teacher(options)):
            raise FeatureSetError(f"feature set {cfg.featureset} stores a top-{self.fs.teacher_k} teacher instead of the "
                                  f"final state, which {cfg.family} reads itself "
                                  f"({self.provider.final_state_use(options)}): capture with --teacher-storage final")
        draft, self.dcfg = self.provider.build(options, self.fs, self.target_dir, layers, cfg.init_from)
        self.check_vocab_coverage(draft)
        self.dtype = torch.bfloat16 if self.accel.device.type == "cuda" else torch.float32
        model = self.provider.module(draft, self.target_dir, self.dtype, options, cfg.seed, cfg.objective)
        held = list(self.fs.manifest["aux_layer_ids"])
        self.features = {"layers": [held.index(i) for i in layers], "final": self.provider.needs_final_state(options)}
        self.build_loader()
        optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, self.total_steps))
        # The scheduler is not prepared: Accelerate would step it num_processes times per step (it
        # assumes a per-process dataloader length), but total_steps already counts optimizer steps.
        self.param_bytes = sum(p.numel() * p.element_size() for p in draft.trainable_parameters())  # unsharded
        self.model, self.optimizer = self.accel.prepare(model, optimizer)
        self.accel.register_for_checkpointing(self.scheduler)
        self.unwrapped = self.accel.unwrap_model(self.model)  # the draft module without Accelerate's wrappers
        if self.accel.is_main_process:
            record_config(self.out, "train", cfg)
            atomic_write_json(self.out / "draft_config.json", self.dcfg.to_dict())
            # the run's target, for its checkpoints before any export (sf-eval, sf-export: folders.trained_for)
            atomic_write_json(self.out / TARGET_FILE, self.target_record())
        return self

    def target_record(self) -> dict:
        """The identity of the target the draft is trained for (the feature set's: it was captured
        from it), as the export and the run folder record it (folders.TARGET_FILE)."""
        return {**self.fs.manifest["target"], "tokenizer_sha256": self.fs.manifest["tokenizer_sha256"]}

    def check_shards(self) -> None:
        """--verify-shards: every shard's checksum, once a run, before the first step. Rank r checks
        shards r, r + world, ..., several at a time; a damaged one is the same FeatureSetError on
        every rank (none waits for another in a collective). The loader's workers then read the
        set unchecked: checked in each worker as it opened a shard, the set was read again per
        worker and per epoch (their processes are made anew each epoch)."""
        accel = self.accel
        mine = list(range(accel.process_index, len(self.fs.shards), accel.num_processes))
        error = None
        with Progress(len(mine), "shard", "sf-train: checking shards", self.silent or not accel.is_main_process,
                      rate=False) as progress:
            try:
                for _ in self.fs.check_shards(mine):
                    progress.update(1)
            except FeatureSetError as e:
                error = str(e)
        if accel.num_processes > 1:
            error = next((r["error"] for r in gathered({"error": error}) if r["error"]), None)
        if error:
            raise FeatureSetError(error)

    def check_vocab_coverage(self, draft) -> None:
        """Say what share of the set's supervised tokens the draft's vocabulary holds; refuse a
        vocabulary that holds none of them (every loss would be 0: nothing to learn)."""
        coverage = self.provider.vocab_coverage(draft, self.fs.token_counts())
        if coverage is None:
            return
        if self.accel.is_main_process and not self.silent:
            print(f"sf-train: the draft vocabulary holds {100 * coverage:.1f}% of the feature set's supervised tokens "
                  "(a position trains where it holds the target's own next token: the same where the target wrote "
                  "the answers)", file=sys.stderr)
        if coverage == 0:
            where = f"--init-from {self.cfg.init_from}'s" if self.cfg.init_from else "the draft's"
            raise FeatureSetError(f"{where} vocabulary holds none of feature set {self.cfg.featureset}'s supervised "
                                  "tokens: every loss would be 0 and nothing learnt (another draft vocabulary, or the "
                                  "set of the data it was made for)")

    def build_accelerator(self):
        from accelerate import Accelerator, DistributedDataParallelKwargs
        from accelerate.utils import set_seed

        cfg = self.cfg
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
        return accel

    def build_loader(self) -> None:
        """The training loader (this rank's share), the held-out indices and the step count."""
        cfg, accel = self.cfg, self.accel
        train_idx, self.eval_idx = split_indices(len(self.fs), cfg.eval_fraction, cfg.seed)
        self.loader = FeatureLoader(self.fs, train_idx, max_tokens=cfg.max_batch_tokens, seed=cfg.seed,
                                    rank=accel.process_index, world=accel.num_processes,
                                    num_workers=cfg.num_workers, max_length=cfg.max_length,
                                    pad_multiple=resolved_pad_multiple(cfg, accel.device),
                                    pin_memory=accel.device.type == "cuda", **self.features)
        if not self.loader.batches_per_epoch():  # the loader would wait for a batch forever
            raise ValueError(f"the training split has no batch: feature set {cfg.featureset} holds {len(self.fs)} "
                             f"samples, --eval-fraction {cfg.eval_fraction:g} holds out {len(self.eval_idx)}, and the "
                             f"{self.loader.describe()}; lower --eval-fraction or --max-batch-tokens, or use fewer "
                             "processes")
        self.total_steps = planned_steps(cfg, max(1, self.loader.batches_per_epoch() // cfg.grad_accum))

    # ---- resume ---------------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest complete checkpoint: weights, optimizer, scheduler, RNG,
        loader position and history (checkpoints.py). Incomplete checkpoints are named in one line
        and removed."""
        accel = self.accel
        newest = newest_complete_checkpoint(accel, self.out)
        if newest is None:
            return
        check_process_count(newest, accel.num_processes)
        try:
            check_random_states(newest, accel.num_processes)
            accel.load_state(str(newest))
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, SafetensorError) as e:  # damaged
            raise ValueError(f"{newest}: the checkpoint is damaged ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}); remove it to "
                             "resume from the one before it") from None
        state = read_trainer_state(newest)
        recorded, now = state.get("featureset_sha256"), manifest_sha256(self.cfg.featureset)
        if recorded is not None and recorded != now:  # (a checkpoint written before it was recorded: not known)
            raise FeatureSetError(f"feature set {self.cfg.featureset} is not the one {newest} was trained on (its "
                                  f"manifest hash {recorded[:12]}, now {str(now)[:12]}: recaptured since?); resuming "
                                  "would train on both: restore it, or train into a new folder")
        self.step = state["step"]
        own = state["loader"][accel.process_index]  # this rank's: where its loader stood, what it skipped
        self.loader.load_state_dict(own)
        self.history = state.get("history", [])  # so history.json covers the whole run, not the last leg
        # (a checkpoint from before the ranks' own counts: the main rank's, from the history, on it alone,
        # which can only undercount the run's skips)
        recorded = self.history[-1].get("skipped_micro_batches", 0) if self.history and accel.is_main_process else 0
        self.skipped = own.get("skipped_micro_batches", recorded)
        if accel.is_main_process and not self.silent:
            print(f"sf-train: resuming from {newest.name} (step {self.step})", file=sys.stderr)

    # ---- steps ----------------------------------------------------------------------------------

    def forward(self, batch: Batch, grad: bool):
        """(total loss, per-position metrics) of one micro-batch, through the wrapped model when
        gradients are wanted (so DDP/FSDP see the forward), else the unwrapped one."""
        cfg = self.cfg
        batch = batch.to(self.accel.device, self.dtype)
        with self.accel.autocast():
            # accel.backward divides the loss by the accumulation steps: that is the gradient into it
            return (self.model if grad else self.unwrapped)(batch, attention=cfg.attention, loss_kernel=cfg.loss_kernel,
                                                      loss_scale=1.0 / cfg.grad_accum)

    def forward_backward(self, batch: Batch) -> list[dict]:
        """One micro-batch: forward, backward, and (on the last micro-batch of an optimizer step,
        where Accelerate syncs gradients) clip, optimizer and scheduler step."""
        accel = self.accel
        with accel.accumulate(self.model):
            loss, metrics = self.forward(batch, grad=True)
            if not loss.requires_grad or sum(int(m["valid"]) for m in metrics) == 0:
                # nothing to learn in this micro-batch (no supervised token the draft can propose): a
                # zero gradient, so every rank still runs the same collectives, and it is counted
                self.skipped += 1
                loss = sum(p.reshape(-1)[0] * 0.0 for p in self.model.parameters() if p.requires_grad)
            accel.backward(loss)
            if accel.sync_gradients and self.cfg.clip_grad:
                accel.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
            self.optimizer.step()
            if accel.sync_gradients:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def train_step(self, batches: Batch | list[Batch]) -> dict:
        """One optimizer step over grad_accum micro-batches (a single Batch when grad_accum is 1).
        Returns its metrics (step, loss_s, acc_s, sim_accept_len, lr), also appended to history."""
        batches = [batches] if isinstance(batches, Batch) else list(batches)
        self.provider.set_progress(self.unwrapped, self.step, self.total_steps)  # a loss scheduled over the run
        if len(batches) != self.cfg.grad_accum:
            raise ValueError(f"train_step takes grad_accum = {self.cfg.grad_accum} micro-batches, got {len(batches)}")
        self.model.train()
        per_micro = [self.forward_backward(batch) for batch in batches]
        self.step += 1
        metrics = {"step": self.step, **summarise(merge_metrics(per_micro, self.accel)),
                   "lr": self.scheduler.get_last_lr()[0], "skipped_micro_batches": self.skipped}
        bad = [k for k, v in metrics.items() if k.startswith("loss_") and not math.isfinite(v)]
        if bad:  # stop before a checkpoint or an export can hold the weights this step has spoilt
            raise NonFiniteError(f"step {self.step}: {', '.join(bad)} not finite (the features were finite: "
                                 "the training diverged); lower --lr or raise --warmup-steps, and rerun into a new "
                                 "folder (the last checkpoint is from before the divergence)")
        self.history.append(metrics)
        self.tracker.log({f"train/{k}": v for k, v in metrics.items() if k != "step"}, self.step)
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Metrics over the held-out samples (this rank's share, merged over ranks); {} if none."""
        cfg, accel = self.cfg, self.accel
        self.unwrapped.eval()
        loader = FeatureLoader(self.fs, self.eval_idx, max_tokens=cfg.max_batch_tokens, seed=cfg.seed,
                               rank=accel.process_index, world=accel.num_processes, num_workers=0,
                               max_length=cfg.max_length, pad_multiple=resolved_pad_multiple(cfg, accel.device),
                               **self.features)
        n = loader.batches_per_epoch()
        per_micro = [self.forward(batch, grad=False)[1] for _, batch in zip(range(n), loader, strict=False)]
        return summarise(merge_metrics(per_micro, accel)) if per_micro else {}

    # ---- checkpoint -----------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """Write checkpoints/step-N whole (checkpoints.py write_checkpoint); keep the newest keep_last."""
        rank_state = {**self.loader.state_dict(), "skipped_micro_batches": self.skipped}  # gathered from every rank
        return write_checkpoint(self.accel, self.out, self.step, rank_state,
                                {"train_config": config_dict(self.cfg), "history": self.history,
                                 "featureset_sha256": manifest_sha256(self.cfg.featureset)}, self.cfg.keep_last)

    def draft_state(self) -> dict[str, torch.Tensor]:
        """The draft's weights by their export names. A collective under FSDP (the full state dict
        is gathered): every rank must call it."""
        accel = self.accel
        state = accel.get_state_dict(self.model) if accel.num_processes > 1 else self.unwrapped.state_dict()
        return {k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}

    def keep_if_best(self, ev: dict) -> None:
        """--keep-best: after an evaluation, keep the draft if its held-out simulated acceptance
        length beats every earlier one (the first of equals stays). Every rank decides alike (the
        metric is merged over ranks) and gathers the state; the main rank writes best/ whole."""
        value = ev.get("sim_accept_len")
        if value is None or (self.best is not None and not value > self.best["eval_sim_accept_len"]):
            return
        state = self.draft_state()
        self.best = {"step": self.step, "eval_sim_accept_len": value}
        if self.accel.is_main_process:
            write_best(self.out, state, self.best)
        self.accel.wait_for_everyone()

    # ---- the outputs ---------------------------------------------------------------------------------

    def write_outputs(self) -> dict:
        """Export the draft and write train_summary.json and history.json (each atomically)."""
        accel = self.accel
        self.tracker.close()
        # ZeRO-2 evidence: each rank's optimizer state (Adam moments) should be ~1/world of the whole
        state_bytes = torch.tensor([optimizer_state_bytes(self.optimizer)], device=accel.device)
        per_rank = accel.gather(state_bytes).tolist()
        counts = accel.gather(torch.tensor([[self.skipped, self.step * self.cfg.grad_accum]], device=accel.device))
        try:
            skipped_warning = skipped_report(*counts.view(-1, 2).sum(0).tolist())
        except NothingLearnedError:  # a checkpoint (or best/) would be offered to sf-eval as a trained draft
            if accel.is_main_process:
                for folder in ("checkpoints", BEST):
                    shutil.rmtree(self.out / folder, ignore_errors=True)
            raise
        draft_state = self.draft_state()
        try:  # weights a finite loss did not read can still have gone non-finite: never exported
            check_finite(draft_state, f"sf-train: the draft after step {self.step}")
        except ValueError as e:
            raise NonFiniteError(f"{e}; nothing exported (lower --lr or raise --warmup-steps, and rerun into a new "
                                 "folder)") from None
        last_eval = next((h["eval_sim_accept_len"] for h in reversed(self.history) if "eval_sim_accept_len" in h),
                         None)
        cfg = self.cfg
        training = {"token_loss": cfg.token_loss, "lk_kl_scale": cfg.lk_kl_scale, "lk_kl_decay": cfg.lk_kl_decay,
                    "kept": "last", "step": self.step, "eval_sim_accept_len": last_eval,
                    # what the feature set's samples were rendered in: sf-eval renders its prompts alike
                    "modes": self.fs.manifest.get("modes") or {},
                    # and with which template (the target's, completion, or a --chat-template file):
                    # sf-eval warns when it renders with another
                    "chat_template_source": self.fs.manifest.get("chat_template_source", "target"),
                    "chat_template_sha256": self.fs.manifest.get("chat_template_sha256")}
        if cfg.keep_best and self.best is not None:
            draft_state = read_best_state(self.out)
            training.update(kept="best", step=self.best["step"], eval_sim_accept_len=self.best["eval_sim_accept_len"],
                            last_step=self.step, last_eval_sim_accept_len=last_eval)
        export = self.out / "export"
        if accel.is_main_process:
            atomic_write_json(self.out / "train_summary.json", {
                "steps": self.step, "world_size": accel.num_processes,
                "distributed_type": str(accel.distributed_type), "optimizer_state_bytes_per_rank": per_rank,
                "trainable_parameter_bytes": self.param_bytes,
            })
            def fill(tmp: Path) -> None:  # written whole aside, or not at all: a full disk is one line
                self.provider.export(draft_state, self.dcfg, tmp, self.target_record(),
                                     verifier=serving_verifier(self.cfg.target, self.target_dir))
                atomic_write_json(tmp / TRAINING_FILE, training)

            write_dir_whole(export, fill)
            atomic_write_json(self.out / "history.json", self.history)
            remove_temporaries(self.out)  # what a run killed mid-write left (.history.json.*.tmp, ...)
        accel.wait_for_everyone()
        return {"steps": self.step, "history": self.history, "export": str(export), "warning": skipped_warning}

    # ---- the loop -------------------------------------------------------------------------------

    def train(self) -> dict:
        """build (unless built) → resume → train_step (with evaluation and checkpoints on their
        schedule) → write_outputs."""
        cfg = self.cfg
        if not hasattr(self, "model"):
            self.build()
        self.resume()
        self.best = read_best(self.out) if cfg.keep_best else None  # kept by an earlier leg of this run
        main = self.accel.is_main_process
        if cfg.tensorboard and main:
            self.tracker = TensorboardTracker(self.out / "tensorboard")
        data = iter(self.loader)
        clock = LoopClock()
        with StepProfiler(self.out, cfg.profile_steps, self.accel.device, write=main) as profiler, \
                Progress(self.total_steps, "step", "sf-train", self.silent or not main, initial=self.step) as progress:
            while self.step < self.total_steps:
                start = time.perf_counter()
                batches = [next(data) for _ in range(cfg.grad_accum)]
                fetched = time.perf_counter()
                metrics = self.train_step(batches)
                clock.add(fetched - start, time.perf_counter() - fetched)
                profiler.step()
                progress.update(1, sum(sum(b.lengths) for b in batches) * self.accel.num_processes)
                if self.step % cfg.log_every == 0 and main and not self.silent:
                    progress.bar.write(f"step {self.step}: loss_0 {metrics['loss_0']:.3f} "
                                       f"acc_0 {metrics['acc_0']:.3f} sim_accept_len {metrics['sim_accept_len']:.2f} "
                                       f"({clock.report()})")
                last = self.step == self.total_steps
                if self.eval_idx and (self.step % cfg.eval_every == 0 or last):
                    ev = self.evaluate()
                    self.history[-1].update({f"eval_{k}": v for k, v in ev.items()})
                    self.tracker.log({f"eval/{k}": v for k, v in ev.items()}, self.step)
                    if cfg.keep_best:
                        self.keep_if_best(ev)
                    if main and not self.silent and ev:
                        best = f" (best {self.best['eval_sim_accept_len']:.3f} at step {self.best['step']})" \
                            if self.best else ""
                        progress.bar.write(f"step {self.step}: held-out sim_accept_len "
                                           f"{ev['sim_accept_len']:.3f}{best}")
                if self.step % cfg.save_every == 0 or last:
                    self.checkpoint()
        return self.write_outputs()


def run_train(cfg: TrainConfig, silent: bool = False, target_dir: Path | None = None) -> dict:
    """Train (or resume) one run; returns {steps, history, export}. `target_dir`: cfg.target's
    directory, where the caller resolved it already."""
    return Trainer(cfg, silent, target_dir).train()
