"""Load a draft for decoding: an exported directory, a training run, or one of its checkpoints.

Exports carry no token embeddings (SGLang shares the target's), so they are read from the
target, exactly as a server would do it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from specfoundry.common.target import load_tokenizer, target_identity
from specfoundry.common.weights import target_embeddings, weight_fingerprint
from specfoundry.featureset.manifest import tokenizer_hashes
from specfoundry.train.dflash.config import DFlashConfig
from specfoundry.train.dflash.export import config_from_sglang as dflash_config_from_sglang
from specfoundry.train.dflash.model import DFlashDraft
from specfoundry.train.eagle3.config import Eagle3Config
from specfoundry.train.eagle3.export import config_from_sglang
from specfoundry.train.eagle3.model import Eagle3Draft
from specfoundry.train.family import DRAFT_FILE, TARGET_FILE, family_of_export, get_family


class DraftLoadError(ValueError):
    pass


def read_config(path: Path) -> Eagle3Config | DFlashConfig:
    """The config of an exported draft folder. The engine's config.json is what a server reads; it
    wins where it says something (a hand-edited layer list must be honoured, not silently replaced
    by ours), and ours (specfoundry_draft.json) fills in the rest."""
    engine = json.loads((path / "config.json").read_text())
    ours = json.loads((path / DRAFT_FILE).read_text()) if (path / DRAFT_FILE).is_file() else None
    try:
        if family_of_export(path) == "dflash":
            cfg = dflash_config_from_sglang(engine)
            return cfg if ours is None else replace(DFlashConfig.from_dict(ours), target_layer_ids=cfg.target_layer_ids,
                                                    mask_token_id=cfg.mask_token_id, block_size=cfg.block_size)
        cfg = config_from_sglang(engine)
    except KeyError as e:
        raise DraftLoadError(f"draft {path / 'config.json'} lacks {e.args[0]!r}") from None
    if ours is None:
        return cfg
    own = Eagle3Config.from_dict(ours)
    return replace(own, aux_layer_ids=cfg.aux_layer_ids or own.aux_layer_ids)


def locate_draft(path: Path) -> tuple[Eagle3Config | DFlashConfig, Path, str]:
    """(config, its tensor file, the prefix of the draft's names in it) for whichever kind of folder
    `path` is: an export, a training run (its export), or one of its checkpoints/step-N."""
    if (path / "export" / "config.json").is_file():  # a training run: use its export
        path = path / "export"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():  # an export
        return read_config(path), path / "model.safetensors", ""
    run = path.parent.parent  # <run>/checkpoints/step-N
    if (path / "model.safetensors").is_file() and (run / "draft_config.json").is_file():
        d = json.loads((run / "draft_config.json").read_text())
        return get_family(d.get("family", "eagle3")).config_from_dict(d), path / "model.safetensors", "draft."
    raise DraftLoadError(f"{path} is not an exported draft (config.json + model.safetensors), an sf-train run "
                         "folder or one of its checkpoints/step-N folders")


def find_draft_files(path: Path) -> tuple[Eagle3Config | DFlashConfig, dict[str, torch.Tensor]]:
    """(config, tensors named as in the family's draft module) from whichever kind of folder `path` is."""
    cfg, file, prefix = locate_draft(path)
    tensors = load_file(str(file))
    return cfg, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def draft_module(cfg: Eagle3Config | DFlashConfig) -> Eagle3Draft | DFlashDraft:
    return DFlashDraft(cfg) if isinstance(cfg, DFlashConfig) else Eagle3Draft(cfg)


def trained_for(path: str | Path) -> dict | None:
    """The target identity an export (or a run's export) records, or None where it records none."""
    path = Path(path)
    for folder in (path, path / "export", path.parent.parent / "export"):
        if (folder / TARGET_FILE).is_file():
            return json.loads((folder / TARGET_FILE).read_text())
    return None


def check_trained_for(path: str | Path, target_dir: Path, allow_other: bool) -> str | None:
    """Refuse a draft trained for another target (its config hash or weight fingerprint differ);
    with allow_other, the difference as a warning instead. None when they agree or the draft
    records no target."""
    recorded = trained_for(path)
    if recorded is None:
        return None
    here = {"config_sha256": target_identity(str(target_dir), target_dir).config_sha256,
            "weight_fingerprint": weight_fingerprint(target_dir),
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
               dtype: torch.dtype) -> Eagle3Draft | DFlashDraft:
    cfg, tensors = find_draft_files(Path(path))
    draft = draft_module(cfg)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens.")}
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens.", "rotary."))]
    if missing or unexpected:
        raise DraftLoadError(f"draft {path}: missing tensors {missing}, unexpected {unexpected}")
    embed = target_embeddings(target_dir)
    if tuple(embed.shape) != tuple(draft.embed_tokens.weight.shape):
        raise DraftLoadError(f"draft {path} expects embeddings {tuple(draft.embed_tokens.weight.shape)}, "
                             f"the target has {tuple(embed.shape)}")
    draft.embed_tokens.weight.data.copy_(embed)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def untrained_like(draft: Eagle3Draft | DFlashDraft, seed: int = 0) -> Eagle3Draft | DFlashDraft:
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
