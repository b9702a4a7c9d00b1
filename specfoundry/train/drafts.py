"""Reading a draft back from whichever folder holds it: an export (ours, or another tool's in
SGLang or speculators layout), an sf-train run folder (its export), or one of its
checkpoints/step-N. sf-eval, sf-export, the gate and --init-from all read drafts through here.

The family of an export is what the catalogue recognises from its config.json's architectures
(families.py); the family of a checkpoint is the one its run's draft_config.json records. A
folder that names no known family is refused in one line, never read as another family's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfoundry.families import FAMILIES, DraftLoadError, UnknownFamilyError
from specfoundry.train.family import TARGET_FILE, DraftFamily, load_tensors, read_config_json

__all__ = ["DraftLoadError", "family_of", "family_of_export", "find_draft_files", "locate_draft", "read_config",
           "target_num_layers", "trained_for"]


def target_num_layers(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def family_of_export(path: Path) -> str:
    """The family of an exported draft folder, from its config.json (ours or another tool's)."""
    return FAMILIES.family_of_config(read_config_json(path), str(Path(path) / "config.json"))


def family_of(cfg) -> DraftFamily:
    """The provider of a draft config's family."""
    return FAMILIES.provider(cfg.family)


def read_config(path: Path, num_target_layers: int | None = None):
    """The config of an exported draft folder (`num_target_layers`: where its config names no
    layers, the engines' default for that target)."""
    return FAMILIES.provider(family_of_export(path)).read_config(Path(path), num_target_layers)


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))


def checkpoint_config(run: Path):
    """The draft config a training run records (draft_config.json), of the family it names."""
    d = read_config_json(run, "draft_config.json")
    if "family" not in d:
        raise DraftLoadError(f"{run / 'draft_config.json'} names no family (one of {', '.join(FAMILIES.names())})")
    try:
        return FAMILIES.provider(d["family"]).config_from_dict(d)
    except UnknownFamilyError as e:
        raise DraftLoadError(f"{run / 'draft_config.json'}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DraftLoadError(f"{run / 'draft_config.json'}: {e}") from None


def locate_draft(path: Path, num_target_layers: int | None = None) -> tuple[object, Path, str]:
    """(config, the folder or tensor file holding it, the prefix of the draft's names in it) for
    whichever kind of folder `path` is: an export, a training run (its export), or one of its
    checkpoints/step-N."""
    path = Path(path)
    if is_export(path / "export"):  # a training run: use its export
        path = path / "export"
    if is_export(path):
        return read_config(path, num_target_layers), path, ""
    run = path.parent.parent  # <run>/checkpoints/step-N
    if (path / "model.safetensors").is_file() and (run / "draft_config.json").is_file():
        return checkpoint_config(run), path / "model.safetensors", "draft."
    raise DraftLoadError(f"{path} is not an exported draft (config.json + model.safetensors), an sf-train run "
                         "folder or one of its checkpoints/step-N folders")


def find_draft_files(path: Path, num_target_layers: int | None = None) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, tensors named as in the family's draft module) from whichever kind of folder `path`
    is; an export comes back as its family reads it (an EAGLE-3 one of any layout checked, under
    our names, with its maps)."""
    cfg, where, prefix = locate_draft(Path(path), num_target_layers)
    if where.is_dir():
        return family_of(cfg).read_export(where, num_target_layers)
    tensors = load_tensors(where)
    return cfg, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def trained_for(path: str | Path) -> dict | None:
    """The target identity an export (or a run's export) records, or None where it records none."""
    path = Path(path)
    for folder in (path, path / "export", path.parent.parent / "export"):
        if (folder / TARGET_FILE).is_file():
            return read_config_json(folder, TARGET_FILE)
    return None
