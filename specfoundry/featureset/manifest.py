"""The feature-set manifest and the checks a reader applies before trusting a set."""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "specfoundry.featureset"
# 4: `teacher`: {"kind": "final_state"} (the final state stored, as before), or {"kind": "topk", "k": K}
#    (teacher_ids / teacher_probs arrays, the teacher's K most probable next tokens, and no final
#    state); sets of versions 1-3 hold the final state.
# 3: final_storage_dtype (the final state may be stored in another dtype than the aux states),
#    and float8_e4m3fn storage with one scale per row (aux_scale / final_scale arrays).
# 2: the format/format_version keys of every specfoundry manifest, shards named shard-NNNNNN.
# 1: schema/schema_version keys, shards named rank000-NNNNNN. All three are read.
FORMAT_VERSION = 4
READS_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"
# what storage dtypes mean on disk (docs/featureset.md); neither zarr nor numpy has bfloat16 or
# float8, so those are stored as their uint16 / uint8 bit patterns; fp6_e2m3 and fp4_e2m1 are
# packed codes with block scales, as bytes (featureset/blockfp.py). A reader that predates a dtype
# refuses the set naming it, so adding one needs no new format version.
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "fp6_e2m3", "fp4_e2m1")
FINAL_STATE = {"kind": "final_state"}
"""The teacher of a set that stores the final state (every set before version 4)."""


def stored_topk(manifest: dict) -> int | None:
    """K where the set stores a top-K teacher instead of the final state, else None."""
    teacher = manifest.get("teacher", FINAL_STATE)
    return teacher["k"] if teacher["kind"] == "topk" else None


def tokenizer_hashes(tokenizer) -> tuple[str, str]:
    """(vocabulary hash, chat template hash): what identifies a tokenizer in the manifest."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template or ""
    return hashlib.sha256(vocab.encode()).hexdigest(), hashlib.sha256(template.encode()).hexdigest()


def new_manifest(*, target: dict, aux_layer_ids, hidden_size: int, storage_dtype: str, codec: str,
                 final_storage_dtype: str | None = None, teacher_k: int | None = None, **fields) -> dict:
    """A manifest's opening: the format and its version, the target (its identity: at least
    hidden_size and vocab_size), the stored layers, the width and the storage (codec, the aux states'
    dtype, the final state's, by default the same), then `fields` (a capture's tokenizer and
    template hashes, max length, counts, its config). The writer adds `shards` (each with its path,
    sha256, num_samples and sample_lengths). teacher_k: the set stores the teacher's top K instead
    of the final state (whose dtype is then recorded but unused). Every manifest is built here:
    sf-capture's, and the random sets of testing.py."""
    if storage_dtype not in STORAGE_DTYPES or (final_storage_dtype or storage_dtype) not in STORAGE_DTYPES:
        raise ValueError(f"storage dtypes {storage_dtype}, {final_storage_dtype} must be among {STORAGE_DTYPES}")
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "target": target, "aux_layer_ids": list(aux_layer_ids),
            "hidden_size": hidden_size, "storage_dtype": storage_dtype,
            "final_storage_dtype": final_storage_dtype or storage_dtype, "codec": codec,
            "teacher": FINAL_STATE if teacher_k is None else {"kind": "topk", "k": teacher_k}, **fields}


def manifest_sha256(root: str | Path) -> str | None:
    """A feature set's identity: the hash of its manifest, which lists every shard's checksum (None
    where there is none). sf-train's ranks compare it, and a resume compares it with its checkpoint's:
    a set recaptured at the same path is other data."""
    from specfoundry.common.files import checksum

    path = Path(root) / MANIFEST
    return checksum(path) if path.is_file() else None


class FeatureSetError(ValueError):
    """A feature set is missing, damaged, or does not match what it is used with."""


CAPTURE_RECORD = "capture_config.json"
"""Beside the manifest: the capture's resolved settings (the manifest holds a copy of those that decide
the features, capture_config: not the device, placement or output folder)."""


def record_disagreements(root: Path, manifest: dict) -> list[str]:
    """What the manifest says that the capture's own records (its capture_config copy, and the
    folder's capture_config.json) say otherwise: the stored layers, their dtypes, the codec, the
    maximum length. A hand-edited manifest would have a reader train on layer ids the features do
    not come from. One line per disagreement; none for a set without a record (testing.py's)."""
    records = [("the manifest's capture_config", manifest.get("capture_config"))]
    if (Path(root) / CAPTURE_RECORD).is_file():
        try:
            records.append((CAPTURE_RECORD, json.loads((Path(root) / CAPTURE_RECORD).read_text())))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return [f"{Path(root) / CAPTURE_RECORD}: not valid JSON ({e})"]
    out = []
    for where, record in records:
        if not isinstance(record, dict):
            continue
        expected = {"aux_layer_ids": ("aux_layers", record.get("aux_layers")),
                    "storage_dtype": ("storage_dtype", record.get("storage_dtype")),
                    "final_storage_dtype": ("final_storage_dtype",
                                            record.get("final_storage_dtype") or record.get("storage_dtype")),
                    "codec": ("codec", record.get("codec")), "max_length": ("max_length", record.get("max_length"))}
        for field, (key, value) in expected.items():
            if value is not None and manifest.get(field) != (list(value) if isinstance(value, list | tuple) else value):
                out.append(f"{Path(root) / MANIFEST}: {field} {manifest.get(field)} disagrees with {where}'s {key} "
                           f"{value}: the manifest was edited (restore it, or recapture)")
    return out


def read_manifest(root: Path) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not root.exists():
        raise FeatureSetError(f"{root} does not exist")
    if not path.is_file() and (root / "capture_config.json").is_file():  # killed, or still capturing
        raise FeatureSetError(f"{root} is a feature set whose sf-capture has not finished (no {MANIFEST} yet): rerun "
                              "its sf-capture command to finish it")
    if not path.is_file():
        raise FeatureSetError(f"{root} is not a feature set (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FeatureSetError(f"{path}: not valid JSON ({e})") from e
    if "schema" in manifest:  # version 1 spelled the format keys so
        manifest["format"], manifest["format_version"] = manifest.pop("schema"), manifest.pop("schema_version", None)
    if manifest.get("format") != FORMAT:
        raise FeatureSetError(f"{path}: not a specfoundry feature set (format {manifest.get('format')!r})")
    if manifest.get("format_version") not in READS_VERSIONS:
        raise FeatureSetError(f"{path}: format version {manifest.get('format_version')} is not supported "
                              f"(this specfoundry reads versions {', '.join(map(str, READS_VERSIONS))})")
    if manifest["format_version"] < 3:  # the final state was stored as the aux states were
        manifest["final_storage_dtype"] = manifest.get("storage_dtype")
    if manifest["format_version"] < 4:
        manifest["teacher"] = FINAL_STATE
    teacher = manifest.get("teacher")
    if not (teacher == FINAL_STATE or (isinstance(teacher, dict) and teacher.get("kind") == "topk"
                                       and isinstance(teacher.get("k"), int) and teacher["k"] >= 1)):
        raise FeatureSetError(f"{path}: teacher {teacher!r} is not one this specfoundry reads "
                              "({'kind': 'final_state'} or {'kind': 'topk', 'k': K})")
    for key in ("storage_dtype", "final_storage_dtype"):
        if manifest.get(key) not in STORAGE_DTYPES:
            raise FeatureSetError(f"{path}: {key} {manifest.get(key)!r} is not one this specfoundry reads "
                                  f"({', '.join(STORAGE_DTYPES)})")
    return manifest


def check_matches_target(manifest: dict, *, hidden_size: int, vocab_size: int, tokenizer_sha256: str | None,
                         aux_layer_ids: list[int] | None = None, config_sha256: str | None = None,
                         weight_fingerprint: str | None = None, chat_template_sha256: str | None = None,
                         source: str = "feature set") -> None:
    """Refuse a set captured from another target; the message names every mismatch."""
    target = manifest["target"]
    problems = []
    if config_sha256 is not None and target.get("config_sha256") != config_sha256:
        problems.append("the target's config hash differs from the one it was captured from")
    if weight_fingerprint is not None and target.get("weight_fingerprint") != weight_fingerprint:
        problems.append("the target's weight fingerprint differs from the one it was captured from")
    if target["hidden_size"] != hidden_size:
        problems.append(f"hidden size {target['hidden_size']} != target's {hidden_size}")
    if target["vocab_size"] != vocab_size:
        problems.append(f"vocab size {target['vocab_size']} != target's {vocab_size}")
    if chat_template_sha256 is not None and manifest.get("chat_template_sha256") != chat_template_sha256:
        problems.append("chat template hash differs from the target's chat template")
    if tokenizer_sha256 is not None and manifest["tokenizer_sha256"] != tokenizer_sha256:
        problems.append("tokenizer hash differs from the target's tokenizer")
    if aux_layer_ids is not None and list(manifest["aux_layer_ids"]) != list(aux_layer_ids):
        problems.append(f"aux layer ids {manifest['aux_layer_ids']} != expected {list(aux_layer_ids)}")
    if problems:
        raise FeatureSetError(f"{source} does not match the target: " + "; ".join(problems))
