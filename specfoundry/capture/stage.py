"""The capture stage as a library function: conversations in, a feature set out.

Work is cut into fixed shards of the (deterministic) sample order; with several processes
(`accelerate launch` / `torchrun`) rank r takes shards r, r+W, r+2W... Each finished shard is
renamed into place and then marked by a small `<shard>.done.json` (checksum, counts, lengths);
the manifest lists exactly the shards with a done mark, so a crash never exposes a half shard.
A rerun with the same settings skips marked shards whose checksum still matches: since a
shard's samples and batches are fixed, the resumed set is byte-identical to an uninterrupted one.
Writing runs in a background thread, overlapping the next shard's prefill.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specfoundry import __version__
from specfoundry.capture.runner import HFCaptureRunner, default_aux_layers
from specfoundry.capture.template import TemplateMaskError, render_with_mask
from specfoundry.common.conversations import BadInput, ConversationFormatError, load_conversations
from specfoundry.common.files import atomic_write_json, sha256_text
from specfoundry.common.progress import Progress
from specfoundry.common.target import load_target
from specfoundry.featureset.manifest import (
    MANIFEST,
    SCHEMA,
    SCHEMA_VERSION,
    STORAGE_DTYPES,
    TOKEN_COUNTS,
    tokenizer_hashes,
)
from specfoundry.featureset.store import CODECS, TORCH_DTYPES, checksum, shard_name, write_shard


class CaptureError(ValueError):
    """A user-facing problem with a capture run."""


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """Settings of one sf-capture run (written into the manifest)."""

    source: str
    """Conversation file/folder, or an sf-regen output folder."""
    output: str
    """Feature-set folder; a rerun into it resumes."""
    target: str = "smollm2"
    """Local model directory or 'smollm2'."""
    backend: str = "hf"
    aux_layers: tuple[int, ...] | None = None
    """Decoder layers whose outputs are captured; default [1, L//2-1, L-4]."""
    max_length: int = 2048
    """Tokens per sample after the chat template; longer samples are truncated."""
    shard_size: int | None = None
    """Samples per shard (the unit of resumption and of data-parallel work); None: auto_shard_size."""
    max_batch_tokens: int = 16384
    """Padded tokens per prefill batch (batches are length-sorted inside a shard)."""
    codec: str = "zarr"
    storage_dtype: str = "bfloat16"
    strict: bool = False
    limit: int | None = None
    device: str | None = None
    writers: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    """Background threads writing finished shards (more keep up with a fast GPU; each shard
    waiting to be written holds its features in memory)."""

    def settings(self) -> dict:
        d = asdict(self)
        for k in ("output", "device", "writers"):  # where and how fast, not what is written
            d.pop(k)
        d["aux_layers"] = list(self.aux_layers) if self.aux_layers is not None else None
        return d


SHARD_BYTES = 4 << 30  # features one automatically sized shard may hold at max_length
MAX_AUTO_SHARD_SIZE = 256


def auto_shard_size(hidden_size: int, max_length: int, storage_dtype: str) -> int:
    """Samples per shard when none is given: as many as keep a shard's features (4 states of
    hidden_size per token, at max_length) within SHARD_BYTES, and at most 256. A shard stays in
    host memory from its capture until written, up to writers + 2 of them at once, so a fixed
    256 would hold 6 x 34 GB for an 8B target at 4096 tokens. SmolLM2 (hidden 576) at 2048
    tokens gets 256; an 8B target (hidden 4096) at 4096 tokens gets 32."""
    per_sample = max_length * 4 * hidden_size * TORCH_DTYPES[storage_dtype].itemsize
    return max(1, min(MAX_AUTO_SHARD_SIZE, SHARD_BYTES // per_sample))


def weight_fingerprint(model_dir: Path) -> str:
    """sha256 over each safetensors file's size and its first and last MiB: cheap on a 70B
    checkpoint, and changes when the weights do."""
    parts = []
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read()
        parts.append(f"{f.name}:{size}:{sha256_text(head.hex())}:{sha256_text(tail.hex())}")
    return sha256_text("\n".join(parts))


def prepare_samples(cfg: CaptureConfig, tokenizer) -> tuple[list[dict], list[BadInput], int]:
    """Render every conversation; returns (samples, bad inputs, samples skipped as untrainable)."""
    try:
        loaded = load_conversations(cfg.source, strict=cfg.strict)
    except (ConversationFormatError, FileNotFoundError) as e:
        raise CaptureError(str(e)) from e
    samples, bad, skipped = [], list(loaded.bad), 0
    for conv in loaded.conversations:
        if cfg.limit is not None and len(samples) >= cfg.limit:
            break
        try:
            r = render_with_mask(tokenizer, conv.to_messages(), cfg.max_length)
        except TemplateMaskError as e:
            bad.append(BadInput(conv.location, "template", str(e)))
            continue
        if not any(r.loss_mask):
            skipped += 1  # nothing trainable left after truncation
            continue
        samples.append({"id": conv.id, "input_ids": r.input_ids, "loss_mask": r.loss_mask})
    return samples, bad, skipped


def length_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that padded tokens per batch stay under the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and width * (len(current) + 1) > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def done_path(root: Path, rel: str) -> Path:
    return root / (rel + ".done.json")


def finished_entry(root: Path, rel: str) -> dict | None:
    """The done mark of a shard if the shard is intact, else None (it will be redone)."""
    mark = done_path(root, rel)
    if not mark.is_file() or not (root / rel).exists():
        return None
    entry = json.loads(mark.read_text())
    return entry if checksum(root / rel) == entry["sha256"] else None


def build_manifest(root: Path, base: dict, num_shards: int, vocab_size: int) -> dict:
    """Assemble the manifest from the done marks; complete when every shard has one."""
    entries, counts = [], Counter()
    for s in range(num_shards):
        rel = shard_name(s, base["codec"])
        mark = done_path(root, rel)
        if mark.is_file():
            e = json.loads(mark.read_text())
            entries.append(e)
            counts.update({int(k): v for k, v in e.pop("token_counts").items()})
    manifest = dict(base)
    manifest["shards"] = entries
    manifest["counts"] = {
        **base["counts"],
        "samples": sum(e["num_samples"] for e in entries),
        "tokens": sum(e["num_tokens"] for e in entries),
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
    }
    manifest["complete"] = len(entries) == num_shards
    if manifest["complete"]:
        from safetensors.torch import save_file

        tc = torch.zeros(vocab_size, dtype=torch.int64)
        for k, v in counts.items():
            tc[k] = v
        tmp = root / f".{TOKEN_COUNTS}.tmp"
        save_file({"counts": tc}, str(tmp))
        os.replace(tmp, root / TOKEN_COUNTS)
    atomic_write_json(root / MANIFEST, manifest)
    return manifest


def run_capture(cfg: CaptureConfig, rank: int = 0, world: int = 1, silent: bool = False) -> dict:
    if cfg.codec not in CODECS:
        raise CaptureError(f"unknown codec {cfg.codec!r}: choose {', '.join(CODECS)}")
    if cfg.storage_dtype not in STORAGE_DTYPES:
        raise CaptureError(f"unknown storage dtype {cfg.storage_dtype!r}: choose {', '.join(STORAGE_DTYPES)}")
    if cfg.backend != "hf":
        raise CaptureError("sf-capture supports --backend hf only for now; the sglang capture backend "
                           "(SGLang's aux-hidden-state capture) is not implemented")
    root = Path(cfg.output)
    model, tokenizer, identity = load_target(cfg.target, device=cfg.device)
    if cfg.shard_size is None:  # resolved here and recorded, so a resume compares the value itself
        cfg = replace(cfg, shard_size=auto_shard_size(identity.hidden_size, cfg.max_length, cfg.storage_dtype))
    aux_layers = list(cfg.aux_layers) if cfg.aux_layers else default_aux_layers(identity.num_layers)
    runner = HFCaptureRunner(model, aux_layers)
    samples, bad, skipped = prepare_samples(cfg, tokenizer)
    if not samples:
        raise CaptureError(f"{cfg.source}: no sample with a trainable (assistant) token")

    settings_file = root / "capture_config.json"
    if settings_file.is_file() and json.loads(settings_file.read_text()) != cfg.settings():
        raise CaptureError(f"{root} holds a capture with other settings; rerun with the same settings to "
                           "resume, or choose a new folder")
    root.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        atomic_write_json(settings_file, cfg.settings())
    tok_hash, template_hash = tokenizer_hashes(tokenizer)
    base = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "target": {**identity.to_dict(), "weight_fingerprint": weight_fingerprint(Path(identity.path))},
        "tokenizer_sha256": tok_hash,
        "chat_template_sha256": template_hash,
        "aux_layer_ids": aux_layers,
        "hidden_size": identity.hidden_size,
        "storage_dtype": cfg.storage_dtype,
        "codec": cfg.codec,
        "max_length": cfg.max_length,
        "counts": {"skipped_untrainable": skipped, "bad_inputs": len(bad)},
        "bad_inputs": [asdict(b) for b in bad],
        "capture_config": cfg.settings(),
    }
    num_shards = (len(samples) + cfg.shard_size - 1) // cfg.shard_size
    mine = [s for s in range(num_shards) if s % world == rank]
    todo = [s for s in mine if finished_entry(root, shard_name(s, cfg.codec)) is None]
    done_samples = sum(min(cfg.shard_size, len(samples) - s * cfg.shard_size) for s in mine if s not in todo)

    writer = BackgroundWriter(lambda s, part, outputs: write_one(root, s, part, outputs, cfg), cfg.writers)
    total = sum(min(cfg.shard_size, len(samples) - s * cfg.shard_size) for s in mine)
    try:
        with Progress(total, "sample", f"sf-capture[{rank}]", silent, initial=done_samples) as progress:
            # every batch of every shard still to do, in order; the runner keeps one batch
            # computing while the previous one is copied out, across shard boundaries too
            jobs = []
            for s in todo:
                part = samples[s * cfg.shard_size : (s + 1) * cfg.shard_size]
                batches = length_batches([len(x["input_ids"]) for x in part], cfg.max_batch_tokens)
                jobs += [(s, part, batch, k == len(batches) - 1) for k, batch in enumerate(batches)]
            results = runner.capture_all([part[i]["input_ids"] for i in batch] for _, part, batch, _ in jobs)
            outputs: list = []
            for (s, part, batch, last), features in zip(jobs, results, strict=True):
                outputs = outputs or [None] * len(part)
                for i, aux_final in zip(batch, features, strict=True):
                    outputs[i] = aux_final
                progress.update(len(batch), sum(len(part[i]["input_ids"]) for i in batch))
                if last:
                    writer.put(s, part, outputs)
                    outputs = []
    except BaseException:
        writer.close(quiet=True)
        raise
    writer.close()
    if world > 1:  # every rank's shards must be marked before rank 0 lists them
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if rank != 0:
            return base
    return build_manifest(root, base, num_shards, identity.vocab_size)


class BackgroundWriter:
    """Runs fn(*job) for queued jobs on `threads` daemon threads, so shards are written while
    the GPU goes on. One job waits at most (put() blocks while one does): a shard's features
    are in memory from capture until written, so at most threads + 2 shards are held (being
    written, waiting, being captured). The first error is raised by put() or close()."""

    def __init__(self, fn, threads: int):
        self.fn = fn
        self.jobs: queue.Queue = queue.Queue(maxsize=1)
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(max(1, threads))]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.errors:
                continue  # drain: after a failure nothing more is written
            try:
                self.fn(*job)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self.errors.append(e)

    def put(self, *job) -> None:
        if self.errors:
            raise self.errors[0]
        self.jobs.put(job)

    def close(self, quiet: bool = False) -> None:
        """Wait for every queued job; raise the first error unless quiet."""
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        if self.errors and not quiet:
            raise self.errors[0]


def write_one(root: Path, shard: int, part: list[dict], outputs: list, cfg: CaptureConfig) -> None:
    rel = shard_name(shard, cfg.codec)
    rows = [{
        "input_ids": torch.tensor(x["input_ids"]),
        "loss_mask": torch.tensor(x["loss_mask"], dtype=torch.bool),
        "aux_hidden": aux,
        "final_hidden": final,
    } for x, (aux, final) in zip(part, outputs, strict=True)]
    digest = write_shard(root, rel, rows, cfg.codec, cfg.storage_dtype)
    counts = Counter()
    for x in part:
        counts.update(t for t, m in zip(x["input_ids"], x["loss_mask"], strict=True) if m)
    atomic_write_json(done_path(root, rel), {
        "index": shard,
        "path": rel,
        "sha256": digest,
        "num_samples": len(part),
        "num_tokens": sum(len(x["input_ids"]) for x in part),
        "loss_tokens": sum(sum(x["loss_mask"]) for x in part),
        "sample_ids": [x["id"] for x in part],
        "sample_lengths": [len(x["input_ids"]) for x in part],
        "token_counts": {str(k): v for k, v in sorted(counts.items())},
    })

