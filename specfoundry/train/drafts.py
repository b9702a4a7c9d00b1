"""Reading a draft back from whichever folder holds it: an export (ours, or another tool's in
SGLang or speculators layout), an sf-train run folder (its export), or one of its
checkpoints/step-N. sf-eval, sf-export, the gate and --init-from all read drafts through here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfoundry.train.dflash.config import DFlashConfig
from specfoundry.train.dflash.export import config_from_sglang as dflash_config_from_sglang
from specfoundry.train.eagle3.config import Eagle3Config
from specfoundry.train.eagle3.formats import read_eagle3, read_eagle3_config
from specfoundry.train.family import (
    TARGET_FILE,
    DraftLoadError,
    family_of_export,
    get_family,
    load_tensors,
    read_config_json,
)

__all__ = ["DraftLoadError", "find_draft_files", "locate_draft", "read_config", "target_num_layers", "trained_for"]


def target_num_layers(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def read_dflash_config(path: Path) -> DFlashConfig:
    """A DFlash export's config, read from its config.json alone, as SGLang reads it (a hand-edited
    field must be honoured, and every field our export records is there)."""
    engine = read_config_json(path)
    try:
        return dflash_config_from_sglang(engine)
    except KeyError as e:
        raise DraftLoadError(f"draft {path / 'config.json'} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise DraftLoadError(f"draft {path / 'config.json'}: {e}") from None


def read_config(path: Path, num_target_layers: int | None = None) -> Eagle3Config | DFlashConfig:
    """The config of an exported draft folder (`num_target_layers`: where its config names no
    layers, the engines' default for that target)."""
    if family_of_export(path) == "dflash":
        return read_dflash_config(path)
    return read_eagle3_config(path, num_target_layers)[0]


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))


def locate_draft(path: Path, num_target_layers: int | None = None) -> tuple[Eagle3Config | DFlashConfig, Path, str]:
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
        d = read_config_json(run, "draft_config.json")
        try:
            return get_family(d.get("family", "eagle3")).config_from_dict(d), path / "model.safetensors", "draft."
        except (KeyError, TypeError, ValueError) as e:
            raise DraftLoadError(f"{run / 'draft_config.json'}: {e}") from None
    raise DraftLoadError(f"{path} is not an exported draft (config.json + model.safetensors), an sf-train run "
                         "folder or one of its checkpoints/step-N folders")


def find_draft_files(path: Path, num_target_layers: int | None = None) -> tuple[Eagle3Config | DFlashConfig,
                                                                                dict[str, torch.Tensor]]:
    """(config, tensors named as in the family's draft module) from whichever kind of folder `path`
    is; an EAGLE-3 export of any layout comes back checked, under our names, with its maps."""
    cfg, where, prefix = locate_draft(Path(path), num_target_layers)
    if where.is_dir():
        if isinstance(cfg, Eagle3Config):
            return read_eagle3(where, num_target_layers)
        where = where / "model.safetensors"
    tensors = load_tensors(where)
    return cfg, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def trained_for(path: str | Path) -> dict | None:
    """The target identity an export (or a run's export) records, or None where it records none."""
    path = Path(path)
    for folder in (path, path / "export", path.parent.parent / "export"):
        if (folder / TARGET_FILE).is_file():
            return read_config_json(folder, TARGET_FILE)
    return None
