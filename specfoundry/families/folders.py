"""Reading a draft back from whichever folder holds it: an export (ours, or another tool's in
SGLang or speculators layout), an sf-train run folder (its export), or one of its
checkpoints/step-N. sf-eval, sf-export, the gate and --init-from all read drafts through here.

The family of an export is what the catalogue recognises from its config.json's architectures
(families/__init__.py); the family of a checkpoint is the one its run's draft_config.json records. A
folder that names no known family is refused in one line, never read as another family's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specfoundry.common.files import TMP_SUFFIX
from specfoundry.common.target import load_tokenizer, target_identity
from specfoundry.common.weights import target_embeddings, weight_fingerprint
from specfoundry.families import FAMILIES, DraftLoadError, UnknownFamilyError
from specfoundry.families.interface import (
    TARGET_FILE,
    TRAINING_FILE,
    DraftFamily,
    load_tensors,
    read_config_json,
)
from specfoundry.featureset.manifest import tokenizer_hashes

__all__ = ["DraftLoadError", "DraftRef", "check_trained_for", "complete_checkpoints", "draft_module", "family_of",
           "family_of_export", "find_draft_files", "load_draft", "locate_draft", "target_num_layers", "trained_for",
           "untrained_like"]


def target_num_layers(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def family_of_export(path: Path) -> str:
    """The family of an exported draft folder, from its config.json (ours or another tool's)."""
    return FAMILIES.family_of_config(read_config_json(path), str(Path(path) / "config.json"))


def family_of(cfg) -> DraftFamily:
    """The provider of a draft config's family."""
    return FAMILIES.provider(cfg.family)


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


@dataclass(frozen=True)
class DraftRef:
    """A draft located once: what the folder the user named holds, of which family, read how. Every
    reader of a draft (sf-eval, sf-export, the gate, the family's read_export) takes this."""

    path: Path
    """The folder as given: an export, an sf-train run folder, or one of its checkpoints/step-N."""
    family: str
    config: object
    """The draft's config (its family's config class), as an engine would read it."""
    where: Path
    """The export folder, or the checkpoint's tensor file."""
    prefix: str
    """The prefix of the draft's tensor names in `where` ('' in an export)."""
    num_target_layers: int | None = None
    """The target's layer count the config was read for (an EAGLE-3 config that names no layers
    takes the engines' default for it); None: not known yet."""

    @property
    def provider(self) -> DraftFamily:
        return FAMILIES.provider(self.family)

    @property
    def is_export(self) -> bool:
        return self.where.is_dir()

    def for_target(self, num_target_layers: int) -> DraftRef:
        """This draft as read for a target of `num_target_layers` layers: an export's config is read
        again from its config.json with that count (a config that names no layers takes the
        engines' default); a checkpoint's config names its layers already."""
        if not self.is_export or self.num_target_layers == num_target_layers:
            return self
        return replace(self, config=self.provider.read_config(self.where, num_target_layers),
                       num_target_layers=num_target_layers)


def locate_draft(path: str | Path, num_target_layers: int | None = None) -> DraftRef:
    """The draft whichever kind of folder `path` is holds: an export, a training run (its export), or
    one of its checkpoints/step-N; the family recognised once (DraftLoadError, one line, otherwise)."""
    given = path = Path(path)
    if is_export(path / "export"):  # a training run: use its export
        path = path / "export"
    if is_export(path):
        family = family_of_export(path)
        config = FAMILIES.provider(family).read_config(path, num_target_layers)
        return DraftRef(given, family, config, path, "", num_target_layers)
    run = path.parent.parent  # <run>/checkpoints/step-N
    if (path / "model.safetensors").is_file() and (run / "draft_config.json").is_file():
        config = checkpoint_config(run)
        return DraftRef(given, config.family, config, path / "model.safetensors", "draft.", num_target_layers)
    if not given.exists():
        raise DraftLoadError(f"{given} does not exist")
    if (given / "train_config.json").is_file():  # a run that has not exported yet (killed, or still training)
        kept = complete_checkpoints(given)
        then = f", or name its newest checkpoint {kept[-1]}" if kept else ""
        raise DraftLoadError(f"{given} is an sf-train run that has not finished (no export/ yet): rerun its sf-train "
                             f"command to finish it{then}")
    raise DraftLoadError(f"{path} is not an exported draft (config.json + model.safetensors), an sf-train run "
                         "folder or one of its checkpoints/step-N folders")


def find_draft_files(ref: DraftRef) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, tensors named as in the family's draft module) of a located draft; an export comes
    back as its family reads it (an EAGLE-3 one of any layout checked, under our names, with its maps)."""
    if ref.is_export:
        return ref.provider.read_export(ref)
    tensors = load_tensors(ref.where)
    return ref.config, {k.removeprefix(ref.prefix): v for k, v in tensors.items() if k.startswith(ref.prefix)}


def trained_for(ref: DraftRef) -> dict | None:
    """The target identity an export (or a run's export) records, or None where it records none."""
    for folder in (ref.path, ref.path / "export", ref.path.parent.parent / "export"):
        if (folder / TARGET_FILE).is_file():
            return read_config_json(folder, TARGET_FILE)
    return None


RUN_WIDE = ("token_loss", "lk_kl_scale", "lk_kl_decay", "modes")
"""The fields of a training record that hold for every step of its run (not the step kept and its
evaluation)."""


def training_record(ref: DraftRef) -> dict | None:
    """How the draft was trained (sf-train's TRAINING_FILE beside its export: the token loss, the
    step kept, the feature set's modes), or None where it records nothing. A checkpoint's: its
    run's fields that hold for every step, kept 'checkpoint' at its own step."""
    if ref.prefix:  # <run>/checkpoints/step-N
        export = ref.path.parent.parent / "export"
        if not (export / TRAINING_FILE).is_file():
            return None
        step = ref.path.name.removeprefix("step-")
        run = read_config_json(export, TRAINING_FILE)
        return {**{k: run[k] for k in RUN_WIDE if k in run}, "kept": "checkpoint",
                "step": int(step) if step.isdigit() else None}
    for folder in (ref.path, ref.path / "export"):
        if (folder / TRAINING_FILE).is_file():
            return read_config_json(folder, TRAINING_FILE)
    return None


def draft_module(cfg) -> torch.nn.Module:
    """A fresh draft of config `cfg`, built by its family."""
    return family_of(cfg).draft_module(cfg)


def check_trained_for(ref: DraftRef, target_dir: Path, allow_other: bool) -> str | None:
    """Refuse a draft trained for another target (its config hash or weight fingerprint differ);
    with allow_other, the difference as a warning instead. None when they agree or the draft
    records no target."""
    recorded = trained_for(ref)
    if recorded is None:
        return None
    here = {"config_sha256": target_identity(str(target_dir), target_dir).config_sha256,
            "weight_fingerprint": weight_fingerprint(target_dir, like=recorded.get("weight_fingerprint")),
            "tokenizer_sha256": tokenizer_hashes(load_tokenizer(target_dir))[0]}
    differ = [k for k, v in here.items() if recorded.get(k) is not None and recorded[k] != v]
    if not differ:
        return None
    message = (f"draft {ref.path} was trained for target {recorded.get('name')!r} ({recorded.get('path')}), whose "
               f"{' and '.join(k.replace('_', ' ') for k in differ)} differ from this target's")
    if not allow_other:
        raise DraftLoadError(message + "; pass --allow-other-target to evaluate it anyway")
    return message


def load_draft(ref: DraftRef, target_dir: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The located draft's module for the target in `target_dir` (its embeddings: the target's), on
    `device` in `dtype`, frozen."""
    cfg, tensors = find_draft_files(ref.for_target(target_num_layers(target_dir)))
    path = ref.path
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
        (rows, width), (theirs, their_width) = draft.embed_tokens.weight.shape, embed.shape
        field = (f"vocab_size {rows}, the target's vocabulary {theirs}" if rows != theirs else
                 f"a width of {width}, the target's hidden_size {their_width}")
        raise DraftLoadError(f"draft {path}: its config.json gives {field}")
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


# ---- checkpoints: step-N is complete by construction; step-N.tmp is one being written ----------

TRAINER_STATE = "trainer_state.json"


def checkpoint_dirs(out: Path) -> list[Path]:
    """Every `step-N` directory under out/checkpoints (complete or not), oldest first."""
    found = [p for p in (out / "checkpoints").glob("step-*") if p.is_dir() and not p.name.endswith(TMP_SUFFIX)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def complete_checkpoints(out: Path) -> list[Path]:
    """The checkpoints resume may trust, oldest first: trainer_state.json is written last."""
    return [p for p in checkpoint_dirs(out) if (p / TRAINER_STATE).is_file()]


def incomplete_checkpoints(out: Path) -> list[Path]:
    """Leftovers of a checkpoint that was being written: `step-N.tmp` dirs, and `step-N` dirs
    without trainer_state.json (never made by this trainer's rename, but by a hand copy or an
    older layout)."""
    temps = sorted((out / "checkpoints").glob(f"step-*{TMP_SUFFIX}"))
    return temps + [p for p in checkpoint_dirs(out) if not (p / TRAINER_STATE).is_file()]
