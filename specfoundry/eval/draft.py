"""Load a draft for decoding: an exported directory (ours, or another tool's in SGLang or
speculators layout), a training run, or one of its checkpoints (train/drafts.py reads them; the
draft's family, from the catalogue, builds its module).

Exports carry no token embeddings (the engines share the target's), so they are read from the
target, exactly as a server would do it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.target import load_tokenizer, target_identity
from specfoundry.common.weights import target_embeddings, weight_fingerprint
from specfoundry.featureset.manifest import tokenizer_hashes
from specfoundry.train.drafts import (
    DraftLoadError,
    family_of,
    find_draft_files,
    locate_draft,
    read_config,
    target_num_layers,
    trained_for,
)

__all__ = ["DraftLoadError", "check_trained_for", "draft_module", "find_draft_files", "load_draft", "locate_draft",
           "read_config", "trained_for", "untrained_like"]


def draft_module(cfg) -> torch.nn.Module:
    """A fresh draft of config `cfg`, built by its family."""
    return family_of(cfg).draft_module(cfg)


def check_trained_for(path: str | Path, target_dir: Path, allow_other: bool) -> str | None:
    """Refuse a draft trained for another target (its config hash or weight fingerprint differ);
    with allow_other, the difference as a warning instead. None when they agree or the draft
    records no target."""
    recorded = trained_for(path)
    if recorded is None:
        return None
    here = {"config_sha256": target_identity(str(target_dir), target_dir).config_sha256,
            "weight_fingerprint": weight_fingerprint(target_dir, like=recorded.get("weight_fingerprint")),
            "tokenizer_sha256": tokenizer_hashes(load_tokenizer(target_dir))[0]}
    differ = [k for k, v in here.items() if recorded.get(k) is not None and recorded[k] != v]
    if not differ:
        return None
    message = (f"draft {path} was trained for target {recorded.get('name')!r} ({recorded.get('path')}), whose "
               f"{' and '.join(k.replace('_', ' ') for k in differ)} differ from this target's")
    if not allow_other:
        raise DraftLoadError(message + "; pass --allow-other-target to evaluate it anyway")
    return message


def load_draft(path: str | Path, target_dir: Path, device: torch.device,
               dtype: torch.dtype) -> torch.nn.Module:
    cfg, tensors = find_draft_files(Path(path), target_num_layers(target_dir))
    draft = draft_module(cfg)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens.")}
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens.", "rotary."))]
    if missing or unexpected:  # named as its config.json was read: a family's field left out shows here
        parts = ([f"missing tensors {missing}"] if missing else []) + (
            [f"tensors a {cfg.family} draft does not have {unexpected}"] if unexpected else [])
        raise DraftLoadError(f"draft {path}, read as {cfg.family} from its config.json: {'; '.join(parts)}")
    embed = target_embeddings(target_dir)
    if tuple(embed.shape) != tuple(draft.embed_tokens.weight.shape):
        raise DraftLoadError(f"draft {path} expects embeddings {tuple(draft.embed_tokens.weight.shape)}, "
                             f"the target has {tuple(embed.shape)}")
    draft.embed_tokens.weight.data.copy_(embed)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def untrained_like(draft: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised draft with the same config, vocabulary map and embeddings: the
    baseline a trained draft must beat."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = draft_module(draft.cfg)
    param = next(draft.parameters())
    fresh.to(device=param.device, dtype=param.dtype)
    for name in ("d2t", "t2d"):
        if hasattr(draft, name):
            getattr(fresh, name).copy_(getattr(draft, name))
    fresh.embed_tokens.weight.data.copy_(draft.embed_tokens.weight)
    return fresh.eval().requires_grad_(False)
