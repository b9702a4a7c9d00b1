"""Reading a draft back from whichever folder holds it: an export (ours, or another tool's in
SGLang or speculators layout), an sf-train run folder (its export), or one of its
checkpoints/step-N. sf-eval, sf-export, the gate and --init-from all read drafts through here.

The family of an export is what the catalogue recognises from its config.json's architectures
(families/__init__.py); the family of a checkpoint is the one its run's draft_config.json records. A
folder that names no known family is refused in one line, never read as another family's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specfoundry.common.embedded import EMBEDDED_DEFAULT
from specfoundry.common.files import TMP_SUFFIX
from specfoundry.common.target import load_tokenizer, target_identity
from specfoundry.common.weights import target_embeddings, weight_fingerprint
from specfoundry.families import FAMILIES, DraftLoadError, UnknownFamilyError
from specfoundry.families.interface import DraftFamily
from specfoundry.featureset.manifest import tokenizer_hashes

__all__ = ["DraftLoadError", "DraftRef", "check_trained_for", "complete_checkpoints", "draft_module",
           "family_of_export", "find_draft_files", "load_draft", "locate_draft", "target_num_layers", "trained_for",
           "training_record", "untrained_like"]

TRAINING_FILE = "specfoundry_training.json"
"""Beside an export sf-train writes: how it was trained (token loss, the step kept and why)."""
TARGET_FILE = "specfoundry_target.json"
"""Beside every export: the identity of the target it was trained for (from the feature set)."""
DRAFT_FILE = "specfoundry_draft.json"
"""Beside every export: our own config of the draft, with its family."""



def target_num_layers(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def family_of_export(path: Path) -> str:
    """The family of an exported draft folder, from its config.json (ours or another tool's)."""
    return FAMILIES.family_of_config(read_config_json(path), str(Path(path) / "config.json"))


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
    """The target identity an export records, or a run (its export's, else the run folder's own, which
    sf-train writes as it starts: a checkpoint of a run killed before its export names its target too),
    or None where nothing records one."""
    run = ref.path.parent.parent if ref.prefix else ref.path  # a checkpoint's run, or the folder given
    for folder in (run / "export", ref.path, run):  # (an export given: ref.path, run / "export" not there)
        if (folder / TARGET_FILE).is_file():
            return read_config_json(folder, TARGET_FILE)
    return None


RUN_WIDE = ("token_loss", "lk_kl_scale", "lk_kl_decay", "modes", "chat_template_source", "chat_template_sha256")
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
    return FAMILIES.provider(cfg.family).draft_module(cfg)


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
    """Every `step-N` directory (N digits) under out/checkpoints, complete or not, oldest first; any
    other folder there (a user's `step-backup`) is not a checkpoint, never read nor removed."""
    found = [p for p in (out / "checkpoints").glob("step-*") if p.is_dir() and re.fullmatch(r"step-\d+", p.name)]
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


# ---- what an export holds, and reading a draft folder's files: each failure one line naming the file ----

EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hugging Face id of the embedded default target: what a vLLM machine loads for it."""


def serving_verifier(target: str, target_dir: Path, given: str | None = None) -> dict:
    """A speculators export's verifier {name_or_path, architectures}: `given`, else the target as a
    serving machine names it: the embedded default's Hugging Face id (not this machine's converted
    copy), a local folder's absolute path, or the id as given. sf-train's export and sf-export's
    write the same one."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    name = given or (EMBEDDED_HF_ID if target == EMBEDDED_DEFAULT else
                     str(Path(target).resolve()) if Path(target).is_dir() else target)
    return {"name_or_path": name, "architectures": config.get("architectures") or []}


def write_export(out: Path, tensors: dict[str, torch.Tensor], config: dict, draft_config,
                 target: dict | None) -> Path:
    """An export folder: `tensors` as model.safetensors, the engine's `config` as config.json, our
    config of the draft (DRAFT_FILE) and, when known, the identity of the target it was trained for
    (TARGET_FILE)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / DRAFT_FILE).write_text(json.dumps(draft_config.to_dict(), indent=2) + "\n")
    if target is not None:
        (out / TARGET_FILE).write_text(json.dumps(target, indent=2) + "\n")
    return out


def exported_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                     skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors an export writes: on the CPU, contiguous, floating ones in `dtype`, without the
    names starting with `skip` (the target's embeddings, which the engines use; RoPE buffers)."""
    out = {}
    for name, t in state_dict.items():
        if not name.startswith(skip):
            t = t.detach().cpu()
            out[name] = t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
    return out


def check_tensors(tensors: dict[str, torch.Tensor], spec: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
                  engine: str, family: str) -> None:
    """Exactly the names of `spec` (an engine's loader, which ignores unknown names silently), each of
    its shape and, where the spec gives one, its dtype; ValueError naming the first that differs."""
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if missing or extra:
        raise ValueError(f"export tensors do not match {engine}'s {family} names: missing {missing}, "
                         f"unexpected {extra}")
    for name, (shape, dtype) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"export tensor {name} has shape {tuple(t.shape)}, {engine} expects {shape}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"export tensor {name} has dtype {t.dtype}, expected {dtype}")


INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
              "block_size", "mask_token_id", "sliding_window")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
ID_LISTS = ("eagle_aux_hidden_state_layer_ids", "target_layer_ids", "aux_layer_ids")


def expect_family(path: Path, name: str) -> None:
    """Refuse a draft folder whose config.json names another family than `name`, or none (one line)."""
    found = FAMILIES.family_of_config(read_config_json(path), str(Path(path) / "config.json"))
    if found != name:
        raise DraftLoadError(f"{path} is a draft of family {found}, not {name}: pass --family {found}")


def read_json(file: Path):
    try:
        return json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise DraftLoadError(f"{Path(file).parent} has no {Path(file).name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftLoadError(f"{file}: not JSON ({e})") from None


def read_config_json(path: Path, name: str = "config.json") -> dict:
    """A draft folder's config.json (or draft_config.json) as a mapping whose numeric settings are
    numbers: an engine, and every reader here, would fail on anything else further on."""
    file = Path(path) / name
    config = read_json(file)
    if not isinstance(config, dict):
        raise DraftLoadError(f"{file}: not a JSON object of settings, but a {type(config).__name__}")
    check_numbers(config, file)
    return config


def check_numbers(config: dict, file: Path, where: str = "") -> None:
    """Refuse a setting the draft's math reads that is not what it runs, naming the file and the field
    ('a.b' nested): a numeric one that is no number (a float one also NaN, inf or <= 0), an
    activation other than SiLU."""
    for key, value in config.items():
        if isinstance(value, dict):
            check_numbers(value, file, f"{where}{key}.")
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if key in INT_FIELDS and value is not None and not whole:
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not an integer")
        if key in FLOAT_FIELDS and value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                                          or not math.isfinite(value) or value <= 0):
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not a positive finite number")
        if key == "hidden_act" and value is not None and value != "silu":  # the drafts' MLP is SwiGLU, SiLU-gated
            raise DraftLoadError(f"{file}: {where}hidden_act is {value!r}: specfoundry's drafts run SiLU (SwiGLU), so "
                                 "the draft measured would not be the one served; restore \"silu\"")
        if key in ID_LISTS and value is not None and not (
                isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not a list of layer ids")


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, every floating one finite (check_finite): the one reader of a
    draft's weights (an export, a checkpoint, --init-from). A damaged or truncated file, or a NaN or
    inf in a weight, is one line naming the file (and the tensor), not a SafetensorError or a draft
    that decodes garbage."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(file).is_file():
        raise DraftLoadError(f"{Path(file).parent} holds no {Path(file).name}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, ValueError) as e:
        raise DraftLoadError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]}): it is damaged "
                             "or truncated") from None
    try:
        check_finite(tensors, str(file))
    except ValueError as e:
        raise DraftLoadError(f"{e}: the draft is broken (retrain it, or use an earlier checkpoint)") from None
    return tensors


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming `source` and the first floating tensor (by name) holding a NaN or an inf."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise ValueError(f"{source}: {name}: {bad} of {t.numel()} values are not finite")
