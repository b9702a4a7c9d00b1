"""The feature-set manifest and the checks a reader applies before trusting a set."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "specfoundry.featureset"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"
# what storage dtypes mean on disk; zarr has no bfloat16, so bf16 is stored as its uint16 bits
STORAGE_DTYPES = ("bfloat16", "float16", "float32")


def tokenizer_hashes(tokenizer) -> tuple[str, str]:
    """(vocabulary hash, chat template hash): what identifies a tokenizer in the manifest."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template or ""
    return hashlib.sha256(vocab.encode()).hexdigest(), hashlib.sha256(template.encode()).hexdigest()


class FeatureSetError(ValueError):
    """A feature set is missing, damaged, or does not match what it is used with."""


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FeatureSetError(f"{root} is not a feature set (no {MANIFEST})")
    manifest = json.loads(path.read_text())
    if manifest.get("schema") != SCHEMA:
        raise FeatureSetError(f"{path}: not a specfoundry feature set (schema {manifest.get('schema')!r})")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise FeatureSetError(f"{path}: schema version {manifest.get('schema_version')} is not supported "
                              f"(this specfoundry reads version {SCHEMA_VERSION})")
    return manifest


def check_matches_target(manifest: dict, *, hidden_size: int, vocab_size: int, tokenizer_sha256: str | None,
                         aux_layer_ids: list[int] | None = None, source: str = "feature set") -> None:
    """Refuse a set captured from another target; the message names every mismatch."""
    target = manifest["target"]
    problems = []
    if target["hidden_size"] != hidden_size:
        problems.append(f"hidden size {target['hidden_size']} != target's {hidden_size}")
    if target["vocab_size"] != vocab_size:
        problems.append(f"vocab size {target['vocab_size']} != target's {vocab_size}")
    if tokenizer_sha256 is not None and manifest["tokenizer_sha256"] != tokenizer_sha256:
        problems.append("tokenizer hash differs from the target's tokenizer")
    if aux_layer_ids is not None and list(manifest["aux_layer_ids"]) != list(aux_layer_ids):
        problems.append(f"aux layer ids {manifest['aux_layer_ids']} != expected {list(aux_layer_ids)}")
    if problems:
        raise FeatureSetError(f"{source} does not match the target: " + "; ".join(problems))
