"""Reading a target's tensors and fingerprint straight from its safetensors files.

Training needs the frozen embeddings and lm_head, decoding the embeddings, capture a cheap
fingerprint of the weights: none of them loads the whole model.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from specfoundry.common.files import sha256_text

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight",)


def read_target_tensor(model_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """Read one tensor (the first of `names` present) from a safetensors checkpoint."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for n in names:
            if n in weight_map:
                with safe_open(str(model_dir / weight_map[n]), framework="pt") as f:
                    return f.get_tensor(n)
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for n in names:
                if n in f.keys():
                    return f.get_tensor(n)
    raise FileNotFoundError(f"none of {names} in the safetensors files of {model_dir}")


@functools.lru_cache(maxsize=8)
def embedding_scale(model_dir: Path) -> float:
    """The factor the target's input embedding module multiplies its rows by: sqrt(hidden_size) for
    Gemma (1, 2, 3: `Gemma3TextScaledWordEmbedding`), 1 for Llama, Qwen, Mistral and most others.
    Read from transformers itself, on a skeleton of the model built on the meta device (no weights
    are read or allocated), so every architecture transformers scales is covered."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return float(getattr(skeleton.get_input_embeddings(), "scalar_embed_scale", 1.0))


def target_embeddings(model_dir: Path) -> torch.Tensor:
    """[V, H] fp32: the token embeddings as the target's first decoder layer sees them, the matrix
    times embedding_scale (Gemma's sqrt(H) included). The drafts' frozen embedding is this: SGLang's
    DFlash worker embeds the block through the target's own (scaling) embedding module, and the
    EAGLE-3 draft, which SGLang hands the raw matrix, norms its embedding first, so the scale
    changes nothing there but the norm's eps."""
    embed = read_target_tensor(model_dir, EMBED_NAMES).float()
    scale = embedding_scale(Path(model_dir))
    return embed if scale == 1.0 else embed * scale


def target_lm_head(model_dir: Path) -> torch.Tensor:
    """[V, H]; a tied model's lm_head is its embedding matrix, unscaled (Gemma scales only the
    embedding's output, never the logits' weight)."""
    try:
        return read_target_tensor(model_dir, HEAD_NAMES)
    except FileNotFoundError:
        return read_target_tensor(model_dir, EMBED_NAMES)


FINGERPRINT_VERSION = "v2"
SAMPLE_BLOCK = 16 << 10  # bytes read per sample
SAMPLES_PER_FILE = 64  # at most: 1 MiB of each file
SAMPLE_BUDGET = 64 << 20  # at most, over the whole checkpoint


def weight_fingerprint(model_dir: Path, like: str | None = None) -> str:
    """A fingerprint of the weights that reads megabytes, whatever the checkpoint's size.

    Rule (v2): sha256 over model.safetensors.index.json where there is one, then, for each
    *.safetensors file in name order, its name, its size, its header (the JSON of every tensor's
    name, dtype, shape and offsets) and n samples of 16 KiB of its data at evenly spaced offsets,
    from the first byte of the data to the last block, n = min(64, 64 MiB / (16 KiB x files)) and at
    least 2: 1 MiB of each file, 64 MiB in all at most. Retrained, fine-tuned or re-quantised
    weights change every tensor, so they change the samples; a renamed, added, resized or
    re-typed tensor changes a header. A change confined to bytes between samples is not seen:
    this identifies a checkpoint, it does not verify one (its own checksums do that).

    `like`: a recorded fingerprint: computed by that one's rule, so that what older runs
    recorded (v1: sha256 over each file's size and its first and last MiB) still compares."""
    if like is not None and not like.startswith(FINGERPRINT_VERSION + ":"):
        return weight_fingerprint_v1(model_dir)
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    samples = max(2, min(SAMPLES_PER_FILE, SAMPLE_BUDGET // (SAMPLE_BLOCK * max(1, len(files)))))
    h = hashlib.sha256()
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        h.update(index.read_bytes())
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = fh.read(min(header_len, size - 8))
            h.update(f"{f.name}:{size}:".encode() + head + header)
            start = 8 + len(header)
            last = max(start, size - SAMPLE_BLOCK)
            for i in range(samples):
                fh.seek(start + (last - start) * i // (samples - 1))
                h.update(fh.read(SAMPLE_BLOCK))
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"


def weight_fingerprint_v1(model_dir: Path) -> str:
    """The fingerprint runs before v2 recorded: sha256 over each safetensors file's size and its
    first and last MiB."""
    parts = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read()
        parts.append(f"{f.name}:{size}:{sha256_text(head.hex())}:{sha256_text(tail.hex())}")
    return sha256_text("\n".join(parts))
