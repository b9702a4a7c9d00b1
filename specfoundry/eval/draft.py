"""Load a draft for decoding: an exported directory, a training run, or one of its checkpoints.

Exports carry no token embeddings (SGLang shares the target's), so they are read from the
target, exactly as a server would do it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specfoundry.common.target import load_tokenizer, target_identity
from specfoundry.common.weights import target_embeddings, weight_fingerprint
from specfoundry.featureset.manifest import tokenizer_hashes
from specfoundry.train.eagle3.config import Eagle3Config
from specfoundry.train.eagle3.model import Eagle3Draft
from specfoundry.train.family import DRAFT_FILE, TARGET_FILE


class DraftLoadError(ValueError):
    pass


def config_from_sglang(config: dict) -> Eagle3Config:
    """A Eagle3Config from an SGLang EAGLE-3 config.json (drafts exported by other tools)."""
    eagle = config.get("eagle_config") or {}
    try:
        return Eagle3Config(
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
            target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
            aux_layer_ids=tuple(eagle.get("eagle_aux_hidden_state_layer_ids", ())),
            fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
        )
    except KeyError as e:
        raise DraftLoadError(f"draft config.json lacks {e.args[0]!r}") from None


def find_draft_files(path: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """(config, tensors named as in Eagle3Draft) from whichever kind of folder `path` is."""
    if (path / "export" / "config.json").is_file():  # a training run: use its export
        path = path / "export"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():  # an export
        ours = path / DRAFT_FILE
        # The SGLang config.json is what a server reads; it wins where it says something
        # (a hand-edited layer list must be honoured, not silently replaced by ours).
        sglang = json.loads((path / "config.json").read_text())
        cfg = config_from_sglang(sglang)
        if ours.is_file():
            own = Eagle3Config.from_dict(json.loads(ours.read_text())).to_dict()
            own["aux_layer_ids"] = cfg.aux_layer_ids or tuple(own["aux_layer_ids"])
            cfg = Eagle3Config.from_dict(own)
        return cfg, load_file(str(path / "model.safetensors"))
    run = path.parent.parent  # <run>/checkpoints/step-N
    if (path / "model.safetensors").is_file() and (run / "draft_config.json").is_file():
        cfg = Eagle3Config.from_dict(json.loads((run / "draft_config.json").read_text()))
        tensors = load_file(str(path / "model.safetensors"))
        return cfg, {k.removeprefix("draft."): v for k, v in tensors.items() if k.startswith("draft.")}
    raise DraftLoadError(f"{path} is not an exported draft (config.json + model.safetensors), an sf-train run "
                         "folder or one of its checkpoints/step-N folders")


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


def load_draft(path: str | Path, target_dir: Path, device: torch.device, dtype: torch.dtype) -> Eagle3Draft:
    cfg, tensors = find_draft_files(Path(path))
    draft = Eagle3Draft(cfg)
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


def untrained_like(draft: Eagle3Draft, seed: int = 0) -> Eagle3Draft:
    """A freshly initialised draft with the same config, vocabulary map and embeddings: the
    baseline a trained draft must beat."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = Eagle3Draft(draft.cfg)
    param = next(draft.parameters())
    fresh.to(device=param.device, dtype=param.dtype)
    for name in ("d2t", "t2d"):
        getattr(fresh, name).copy_(getattr(draft, name))
    fresh.embed_tokens.weight.data.copy_(draft.embed_tokens.weight)
    return fresh.eval().requires_grad_(False)
