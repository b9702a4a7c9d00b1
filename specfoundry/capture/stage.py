"""The capture stage: conversations in, a feature set out.

`plan_capture` renders every conversation and fixes the shards (fixed slices of the
deterministic sample order); `capture_shards` runs the target over the shards still to do and
writes them through common/shards.py (partial name, rename, done mark), so a rerun with the
same settings skips finished shards and ends byte-identical to an uninterrupted run. With
several processes (`torchrun`) the target's copies (common/placement.py: one process each, or
--tp N ranks each) split the shards: copy g of G takes shards g, g+G, g+2G..., its first rank
writes them, and rank 0 assembles the manifest from the done marks once every rank is done.
Writing runs in background threads, overlapping the next shard's prefill.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from jinja2 import TemplateError

from specfoundry import __version__
from specfoundry.capture.runner import HFCaptureRunner, NonFiniteFeatures
from specfoundry.capture.template import TemplateMaskError, render_with_mask
from specfoundry.capture.writer import BackgroundWriter
from specfoundry.common.compiled_layers import COMPILE_LAYERS, compile_layers
from specfoundry.common.files import atomic_write_bytes, atomic_write_json, checksum
from specfoundry.common.placement import FUSED_EXPERTS, Placement
from specfoundry.common.progress import Progress
from specfoundry.common.settings import (
    TEMPLATE_KWARGS_HELP,
    Range,
    Settings,
    parse_template_kwargs,
    resume_settings,
    setting,
    shared,
)
from specfoundry.common.shards import (
    ShardedOutput,
    check_output_folder,
    output_inside_source,
    record_config,
    writable_folder,
)
from specfoundry.common.taps import parse_layer_ids
from specfoundry.common.target import EMBEDDED_DEFAULT, Target, chat_template_source
from specfoundry.common.weights import weight_fingerprint
from specfoundry.conversations.records import BadInput, ChatMessages, Conversation, ConversationFormatError
from specfoundry.conversations.sources import data_files, load_conversations
from specfoundry.conversations.templates import (
    template_bad_input,
    tools_template_problem,
    unread_template_kwargs,
)
from specfoundry.families import FAMILIES
from specfoundry.featureset.manifest import (
    MANIFEST,
    STORAGE_DTYPES,
    TOKEN_COUNTS,
    new_manifest,
    stored_topk,
    tokenizer_hashes,
)
from specfoundry.featureset.store import CODECS, bytes_per_value, shard_name, write_shard_file
from specfoundry.featureset.teacher import MAX_K, parse_teacher


class CaptureError(ValueError):
    """A user-facing problem with a capture run."""


def parse_families(spec) -> tuple[str, ...]:
    """--families: comma-separated family names (a recipe may give a list)."""
    if not isinstance(spec, str | list | tuple):
        raise ValueError(f"{spec!r} is not a comma-separated list of draft families")
    names = tuple(str(x).strip() for x in (spec.split(",") if isinstance(spec, str) else spec))
    check_families(names)
    return names


def check_families(names: tuple[str, ...]) -> None:
    """Refuse an unknown family name (or none), naming it and the registered ones."""
    unknown = [n for n in names if n not in FAMILIES.names()]
    if unknown or not names:
        raise ValueError(f"unknown draft famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown) or '(none)'}: "
                         f"choose from {', '.join(FAMILIES.names())}")


def stored_layers(cfg: CaptureConfig, num_layers: int) -> list[int]:
    """The layers a capture stores, ascending (the order engines concatenate them in): --aux-layers,
    else the union of the families' defaults for a target of num_layers layers."""
    if cfg.aux_layers:
        layers = list(cfg.aux_layers)
        if len(set(layers)) != len(layers):
            raise CaptureError(f"--aux-layers {','.join(map(str, layers))} names a layer twice")
    else:
        layers = [i for name in cfg.families for i in FAMILIES.default_layers(name, num_layers)]
    bad = [i for i in layers if not 0 <= i < num_layers - 1]
    if bad:  # the last layer's output is the final state before the norm, which no engine taps
        raise CaptureError(f"layer ids {bad} are outside 0..{num_layers - 2} (the target has {num_layers} layers; "
                           "id i is the output of layer i, and the last one is not tapped)")
    return sorted(set(layers))


@dataclass(frozen=True, kw_only=True)
class CaptureConfig(Settings):
    """Settings of one sf-capture run (recorded in capture_config.json and the manifest)."""

    DECIDED_TOGETHER: ClassVar = {("aux_layers", "families"): "--aux-layers names the layers stored, --families picks "
                                  "them from families' defaults: give one"}

    source: str = setting(argument=True, help="Conversation file or folder, or an sf-regen output folder.")
    output: str = shared("output", resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    chat_template_kwargs: dict | None = setting(
        None, parse=parse_template_kwargs, shown="each conversation's recorded mode (sf-regen's rows), else none",
        help=TEMPLATE_KWARGS_HELP)
    aux_layers: tuple[int, ...] | None = setting(
        None, parse=parse_layer_ids, shown="the union of --families' defaults",
        help="Comma-separated ids of the decoder layers whose outputs are stored (id i: the output of layer i, "
             "HF's hidden_states[i + 1]); stored in ascending order.")
    families: tuple[str, ...] = setting(
        (FAMILIES.default,), parse=parse_families,
        help="Without --aux-layers, store the union of these families' default layers (at a 32-layer target: "
             + FAMILIES.layers_shown(32) + ").")
    max_length: int = shared("max_length", 2048)
    shard_size: int | None = setting(
        None, shown="as many samples as fit 4 GiB of features at --max-length, at most 256", valid=Range(1),
        help="Samples per shard, the unit of resumption and of work per rank (a shard's features stay in host "
             "memory until written).")
    max_batch_tokens: int = shared("max_batch_tokens", 16384)
    codec: str = setting("zarr", choices=CODECS, help="The shards' container: zarr (Zarr v3, chunked and compressed) "
                         "or safetensors (memory-mapped, uncompressed), either holding any --storage-dtype.")
    storage_dtype: str = setting(
        "bfloat16", choices=STORAGE_DTYPES,
        help="dtype of the stored hidden states (the final state's too, unless --final-storage-dtype); "
             "float8_e4m3fn, fp6_e2m3, fp4_e2m1: 1/2, 0.41, 0.28 of bfloat16's bytes, lossy (docs/featureset.md).")
    final_storage_dtype: str | None = setting(
        None, choices=STORAGE_DTYPES, shown="--storage-dtype",
        help="dtype of the stored final state (the teacher's input), such as bfloat16 beside a float8 "
             "--storage-dtype.")
    teacher_storage: str = setting("final", before="final", parse=lambda v: str(v).strip(),
                           help="What the teacher is stored as: final (the final state, H values a token) or "
                                f"topk:K (its K most probable next tokens, K from 1 to {MAX_K}, 6K bytes a token; docs/featureset.md).")
    strict: bool = shared("strict", False)
    partial: bool = setting(False, help="Take the finished shards of an incomplete sf-regen run instead of "
                            "refusing it.")
    limit: int | None = shared("limit", None)
    device: str | None = shared("device", None, resume=False)
    placement: Placement = Placement()
    compile_layers: str = setting(
        "off", resume=False, choices=COMPILE_LAYERS,
        help="Compile each decoder layer's attention block and norms (attention) or the whole layer (layer) with "
             "torch.compile; docs/stages.md, \"Targets and chat templates\".")
    writers: int = setting(factory=lambda: min(4, os.cpu_count() or 1), resume=False,
                           shown="min(4, CPU cores)", valid=Range(1, 256),
                           help="Threads writing finished shards in the background; up to writers + 2 shards "
                                "are held in memory at once.")

    def __post_init__(self):
        super().__post_init__()
        check_families(self.families)
        problem = output_inside_source(self.source, self.output)
        if problem:
            raise ValueError(problem)


@dataclass
class CapturePlan:
    """What a capture writes: the resolved config, the samples, the shards and the manifest's base."""

    cfg: CaptureConfig
    samples: list[dict]
    num_shards: int
    base: dict
    vocab_size: int

    def part(self, shard: int) -> list[dict]:
        return self.samples[shard * self.cfg.shard_size : (shard + 1) * self.cfg.shard_size]

    def rels(self) -> list[str]:
        return [shard_name(s, self.cfg.codec) for s in range(self.num_shards)]

    def made_from(self) -> dict[str, str]:
        """Per shard, the hash of its samples (what its done mark records)."""
        return {shard_name(s, self.cfg.codec): samples_sha256(self.part(s)) for s in range(self.num_shards)}


def samples_sha256(part: list[dict]) -> str:
    """What a shard is made from: a hash of its samples' ids, tokens and loss masks."""
    h = hashlib.sha256()
    for x in part:
        h.update(str(x["id"]).encode() + b"\0")
        h.update(np.asarray(x["input_ids"], dtype=np.int64).tobytes())
        h.update(np.asarray(x["loss_mask"], dtype=np.uint8).tobytes())
    return h.hexdigest()


SHARD_BYTES = 4 << 30  # features one automatically sized shard may hold at max_length
MAX_AUTO_SHARD_SIZE = 256


def auto_shard_size(hidden_size: int, max_length: int, storage_dtype: str, final_storage_dtype: str | None = None,
                    *, num_layers: int, teacher_k: int | None = None) -> int:
    """Samples per shard when none is given: as many as keep a shard's features (the num_layers
    stored layers' states and the final one, of hidden_size per token, at max_length) within
    SHARD_BYTES, and at most 256. A shard stays in host memory from its capture until written, up to
    writers + 2 of them at once, so a fixed 256 would hold 6 shards of 256 x 4096 tokens x 32 KiB
    for an 8B target at 4096 tokens with 3 layers. With 3 layers, SmolLM2 (hidden 576) at 2048
    tokens gets 256; an 8B target (hidden 4096) at 4096 tokens gets 32 in bfloat16, 64 in float8;
    a capture for every family stores more layers and gets fewer samples a shard. A top-K teacher
    (teacher_k) takes the final state's place at 6 bytes a kept token."""
    aux, final = bytes_per_value(storage_dtype), bytes_per_value(final_storage_dtype or storage_dtype)
    per_sample = max_length * (hidden_size * num_layers * aux + (hidden_size * final if teacher_k is None
                                                                  else 6 * teacher_k))
    return max(1, min(MAX_AUTO_SHARD_SIZE, int(SHARD_BYTES // per_sample)))


def rendered_mode(conv: Conversation, given: dict | None) -> tuple[ChatMessages, dict]:
    """(conv's messages to render, carrying its template arguments; its mode {chat_template_kwargs,
    reasoning}). A conversation renders in the mode it records; --chat-template-kwargs (`given`)
    applies to one that records none, and one that records other arguments is refused: rendered in
    another mode than it was generated in, its text is not what the target saw."""
    recorded = conv.mode
    if recorded is not None and given is not None and dict(recorded.get("chat_template_kwargs") or {}) != given:
        raise CaptureError(f"{conv.location}: generated with chat-template arguments "
                           f"{json.dumps(recorded.get('chat_template_kwargs') or {}, sort_keys=True)}, not "
                           f"--chat-template-kwargs {json.dumps(given, sort_keys=True)}: leave the option out to render "
                           "each conversation in its own mode, or regenerate it in this one")
    kwargs = conv.template_kwargs if recorded is not None else dict(given or {})
    messages = conv.to_messages()
    messages.template_kwargs = kwargs
    return messages, {"chat_template_kwargs": kwargs, "reasoning": (recorded or {}).get("reasoning")}


def prepare_samples(cfg: CaptureConfig, tokenizer) -> tuple[list[dict], list[BadInput], int, Counter]:
    """Render every conversation, each in its mode (rendered_mode); returns (samples, bad inputs,
    samples skipped as untrainable, the samples' modes counted by their JSON)."""
    try:
        loaded = load_conversations(cfg.source, strict=cfg.strict, partial=cfg.partial)
    except (ConversationFormatError, FileNotFoundError) as e:
        raise CaptureError(str(e)) from e
    problem = tools_template_problem(loaded.conversations, tokenizer)  # the check sf-regen applies too
    if problem:
        raise CaptureError(problem)
    samples, bad, skipped, modes = [], list(loaded.bad), 0, Counter()
    for conv in loaded.conversations:
        if cfg.limit is not None and len(samples) >= cfg.limit:
            break
        empty = empty_answer(conv)
        if empty:
            bad.append(empty)
            continue
        messages, mode = rendered_mode(conv, cfg.chat_template_kwargs)
        try:
            r = render_with_mask(tokenizer, messages, cfg.max_length)
        except (TemplateMaskError, TemplateError) as e:  # (TemplateError: the template's raise_exception)
            bad.append(template_bad_input(conv, e))
            continue
        if not any(r.loss_mask):
            skipped += 1  # nothing trainable left after truncation
            continue
        samples.append({"id": conv.id, "input_ids": r.input_ids, "loss_mask": r.loss_mask})
        modes[json.dumps(mode, sort_keys=True)] += 1
    return samples, bad, skipped, modes


def empty_answer(conv: Conversation) -> BadInput | None:
    """An assistant turn with no text and no tool call: no token of it to learn (sf-regen
    regenerates such a turn; a capture takes the text as it is)."""
    for t, m in enumerate(conv.messages):
        if m.role == "assistant" and not m.content.strip() and not m.tool_calls:
            return BadInput(conv.location, "empty_answer", f"turn {t} is an empty assistant message: nothing to learn")
    return None


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


def why_none(bad: list[BadInput], skipped: int, cfg: CaptureConfig) -> str:
    """Why no record gave a sample, in one line: the bad inputs by kind with the first of them, and the
    records left with nothing trainable within max_length."""
    reasons = []
    if bad:
        kinds = Counter(b.kind for b in bad)
        reasons.append(f"{len(bad)} bad input{'s' if len(bad) > 1 else ''} "
                       f"({', '.join(f'{kind} {n}' for kind, n in kinds.most_common())}; the first: {bad[0]})")
    if skipped:
        reasons.append(f"{skipped} with no assistant token within --max-length {cfg.max_length}")
    return "; ".join(reasons) or "the source holds no record"


def plan_capture(cfg: CaptureConfig, tokenizer, identity) -> CapturePlan:
    """Render the samples and resolve what the run writes; refuses a folder of other settings."""
    aux_layers = stored_layers(cfg, identity.num_layers)
    cfg = replace(cfg, aux_layers=tuple(aux_layers))
    try:
        teacher_k = parse_teacher(cfg.teacher_storage)
    except ValueError as e:
        raise CaptureError(str(e)) from None
    if cfg.shard_size is None:  # resolved here and recorded, so a resume compares the value itself
        cfg = replace(cfg, shard_size=auto_shard_size(identity.hidden_size, cfg.max_length, cfg.storage_dtype,
                                                      cfg.final_storage_dtype, num_layers=len(aux_layers),
                                                      teacher_k=teacher_k))
    check_output_folder(Path(cfg.output), "capture", cfg)
    problem = unread_template_kwargs(tokenizer, cfg.chat_template_kwargs)
    if problem:
        raise CaptureError(problem)
    samples, bad, skipped, modes = prepare_samples(cfg, tokenizer)
    if not samples:
        raise CaptureError(f"{cfg.source}: no sample with a trainable (assistant) token: {why_none(bad, skipped, cfg)}")
    tok_hash, template_hash = tokenizer_hashes(tokenizer)
    base = new_manifest(
        target={**identity.to_dict(), "weight_fingerprint": weight_fingerprint(Path(identity.path))},
        aux_layer_ids=aux_layers, hidden_size=identity.hidden_size, storage_dtype=cfg.storage_dtype,
        final_storage_dtype=cfg.final_storage_dtype, codec=cfg.codec, teacher_k=teacher_k,
        tool_version=__version__,
        tokenizer_sha256=tok_hash,
        chat_template_sha256=template_hash,
        chat_template_source=chat_template_source(tokenizer),
        max_length=cfg.max_length,
        counts={"skipped_untrainable": skipped, "bad_inputs": len(bad)},
        modes=dict(modes),  # {mode JSON: samples}: the chat-template arguments and reasoning they render in
        bad_inputs=[asdict(b) for b in bad],
        # the settings that decide the features, not how this run was placed or where it wrote: the
        # manifest's hash is the set's identity (sf-train's resume compares it), and a rerun of a
        # finished capture on another device or placement rewrites the manifest
        capture_config=resume_settings(cfg))
    num_shards = (len(samples) + cfg.shard_size - 1) // cfg.shard_size
    plan = CapturePlan(cfg, samples, num_shards, base, identity.vocab_size)
    # a finished shard made from other tokens than the source now gives (an edited record, the same
    # ids) loses its done mark here, once the folder is known to hold this run: it is captured again
    ShardedOutput(Path(cfg.output), plan.made_from(), cfg.source).pending(plan.rels())
    return plan


def capture_shards(plan: CapturePlan, runner: HFCaptureRunner, shards: list[int], out: ShardedOutput,
                   progress: Progress, write: bool = True) -> None:
    """Capture and write `shards` (`write` False: a tensor-parallel rank that runs the same batches
    as its group's writer and keeps nothing). Every batch of every shard is queued in order, so the
    runner keeps one batch computing while the previous one is copied out, across shard boundaries."""
    jobs = []
    for s in shards:
        part = plan.part(s)
        batches = length_batches([len(x["input_ids"]) for x in part], plan.cfg.max_batch_tokens)
        jobs += [(s, part, batch, k == len(batches) - 1) for k, batch in enumerate(batches)]
    writer = BackgroundWriter(lambda s, part, outputs: write_one(out, s, part, outputs, plan.cfg), plan.cfg.writers)
    try:
        results = runner.capture_all([part[i]["input_ids"] for i in batch] for _, part, batch, _ in jobs)
        outputs: list = []
        for (s, part, batch, last), features in zip(jobs, results, strict=True):
            outputs = outputs or [None] * len(part)
            for i, arrays in zip(batch, features, strict=True):
                outputs[i] = arrays
            progress.update(len(batch), sum(len(part[i]["input_ids"]) for i in batch))
            if last:
                if write:
                    writer.put(s, part, outputs)
                outputs = []
    except NonFiniteFeatures as e:
        writer.close(quiet=True)
        _, part, batch, _ = jobs[e.batch]
        raise CaptureError(f"{plan.cfg.source}: sample {part[batch[e.row]]['id']}: token {e.token}, {e.layer}: the "
                           f"target's hidden state has absmax {e.absmax}, which float8_e4m3fn storage cannot "
                           "scale (the target overflows on this input: capture it in bfloat16, or leave the sample "
                           "out)") from e
    except BaseException:
        writer.close(quiet=True)
        raise
    writer.close()


def build_manifest(plan: CapturePlan, out: ShardedOutput) -> dict:
    """Assemble the manifest from the done marks; complete (with token counts) when every shard has one."""
    entries, counts = out.marks(plan.rels()), Counter()
    for e in entries:
        counts.update({int(k): v for k, v in e.pop("token_counts").items()})
    manifest = dict(plan.base)
    manifest["shards"] = entries
    manifest["counts"] = {
        **plan.base["counts"],
        "samples": sum(e["num_samples"] for e in entries),
        "tokens": sum(e["num_tokens"] for e in entries),
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
    }
    if stored_topk(manifest) is not None and manifest["counts"]["tokens"]:
        # the mass outside the kept K: what the stored teacher lacks (ModelOpt warns below 0.999)
        tokens = manifest["counts"]["tokens"]
        manifest["teacher"] = {**manifest["teacher"],
                               "kept_mass_mean": sum(e.pop("teacher_kept_mass_sum") for e in entries) / tokens,
                               "kept_below_0999": sum(e.pop("teacher_kept_below_0999") for e in entries) / tokens}
    manifest["complete"] = len(entries) == plan.num_shards
    if manifest["complete"]:
        from safetensors.torch import save

        tc = torch.zeros(plan.vocab_size, dtype=torch.int64)
        for k, v in counts.items():
            tc[k] = v
        out.remove_partials("shards")
        # through the shared writer: a full disk is an OSError naming the file, not a SafetensorError
        atomic_write_bytes(out.root / TOKEN_COUNTS, save({"counts": tc}))
        manifest["token_counts_sha256"] = checksum(out.root / TOKEN_COUNTS)  # verify and sf-train check it
    atomic_write_json(out.root / MANIFEST, manifest)
    return manifest


def run_capture(cfg: CaptureConfig, silent: bool = False, target: Target | None = None) -> dict:
    """Run (or resume) a capture into cfg.output; returns the manifest (rank 0) or its base.
    `target`: the target already loaded (the gate), else cfg's is loaded and placed."""
    writable_folder(Path(cfg.output))  # before loading the target; the settings once they are resolved
    try:  # the source too: loading a large target takes minutes
        data_files(cfg.source, cfg.partial)
    except (ConversationFormatError, FileNotFoundError) as e:
        raise CaptureError(str(e)) from e
    if target is None:
        from specfoundry.kernels.fused_moe import register_fused_experts

        register_fused_experts(FUSED_EXPERTS)  # so that --experts-implementation can name it
        target = Target.load(cfg.target, device=cfg.device, placement=cfg.placement, chat_template=cfg.chat_template,
                             command="sf-capture run",
                             settings=resume_settings(cfg))
    if cfg.compile_layers != "off":
        try:
            compile_layers(target.model, cfg.compile_layers)  # all layers or none (undone below)
        except ValueError as e:  # an architecture without the parts `attention` compiles
            raise CaptureError(str(e)) from e
    try:
        return capture_with(cfg, target, silent)
    finally:
        if cfg.compile_layers != "off":
            compile_layers(target.model, "off")  # (a target the caller passed in goes back as it came)


def capture_with(cfg: CaptureConfig, target: Target, silent: bool) -> dict:
    """run_capture's work once the target is loaded (and its layers compiled as asked)."""
    ranks = target.ranks
    plan = plan_capture(cfg, target.tokenizer, target.identity)
    if ranks.world > 1:  # each rank read the source itself: another copy at the same path (a node's stale
        # disk) would put other data in its shards of one feature set (one pass over every sample: not alone)
        ranks.check_same({"source": {"samples_sha256": samples_sha256(plan.samples)}},
                         f"every rank of a launch must read the same source ({cfg.source})")
    out = ShardedOutput(Path(cfg.output))
    if ranks.rank == 0:
        # the placement as it runs: an MoE target's experts implementation resolved from auto
        record_config(out.root, "capture", replace(plan.cfg, placement=target.placement))
    ranks.barrier()  # no rank writes into the folder before rank 0 has checked it and recorded the run
    mine = [s for s in range(plan.num_shards) if s % ranks.groups == ranks.group]
    todo = None
    if ranks.is_writer:
        # a kept shard must hold the samples the plan puts there (a --partial source may have grown since)
        expected = {shard_name(s, plan.cfg.codec): [x["id"] for x in plan.part(s)] for s in mine}
        pending = set(out.pending(list(expected), holds=lambda rel, mark: mark.get("sample_ids") == expected[rel]))
        todo = [s for s in mine if shard_name(s, plan.cfg.codec) in pending]
    todo = ranks.from_writer(todo)  # the group's other ranks run the same batches
    total = sum(len(plan.part(s)) for s in mine)
    done = total - sum(len(plan.part(s)) for s in todo)
    runner = HFCaptureRunner(target, list(plan.cfg.aux_layers), storage=(plan.base["storage_dtype"],
                                                                         plan.base["final_storage_dtype"]),
                             keep=ranks.is_writer, teacher_k=stored_topk(plan.base))
    try:
        with Progress(total, "sample", f"sf-capture[{ranks.group}]", silent or not ranks.is_writer,
                      initial=done) as progress:
            capture_shards(plan, runner, todo, out, progress, write=ranks.is_writer)
    finally:
        runner.close()
    ranks.barrier()  # every copy's shards must be marked before rank 0 lists them
    if ranks.rank != 0:
        return plan.base
    return build_manifest(plan, out)


def write_one(out: ShardedOutput, shard: int, part: list[dict], outputs: list, cfg: CaptureConfig) -> None:
    rows = [{
        "input_ids": torch.tensor(x["input_ids"]),
        "loss_mask": torch.tensor(x["loss_mask"], dtype=torch.bool),
        **arrays,  # aux_hidden, final_hidden (and float8's scales), as the runner encoded them
    } for x, arrays in zip(part, outputs, strict=True)]
    counts = Counter()
    for x in part:
        counts.update(t for t, m in zip(x["input_ids"], x["loss_mask"], strict=True) if m)
    kept = {}  # a top-K teacher's kept mass over the shard's tokens, for the manifest
    if rows and "teacher_probs" in rows[0]:
        mass = torch.cat([r["teacher_probs"].float().sum(-1) for r in rows])  # [tokens]
        kept = {"teacher_kept_mass_sum": float(mass.sum()), "teacher_kept_below_0999": int((mass < 0.999).sum())}
    out.commit(shard_name(shard, cfg.codec), lambda path: write_shard_file(path, rows, cfg.codec, cfg.storage_dtype,
                                                                     cfg.final_storage_dtype), {
        "index": shard,
        "num_samples": len(part),
        "num_tokens": sum(len(x["input_ids"]) for x in part),
        "loss_tokens": sum(sum(x["loss_mask"]) for x in part),
        "sample_ids": [x["id"] for x in part],
        "source_sha256": samples_sha256(part),  # what plan_capture compares on a rerun
        "sample_lengths": [len(x["input_ids"]) for x in part],
        "token_counts": {str(k): v for k, v in sorted(counts.items())},
        **kept,
    })
