"""sf-export: write a draft in the layout a serving engine loads.

It reads any draft families/folders.py reads (an export of ours or another tool's, SGLang or
speculators layout; an sf-train run; a checkpoint) and writes one layout: `sglang` (what sf-train
writes; SGLang and vLLM both load it) or `speculators` (vLLM's own format: `vllm serve DIR`
alone). Why a command of its own and not an sf-train option: docs/serving.md.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specfoundry.common.files import atomic_write_json, write_dir_whole
from specfoundry.common.settings import Settings, config_dict, setting, shared
from specfoundry.common.shards import check_output_folder, sibling_lock
from specfoundry.common.target import EMBEDDED_DEFAULT, announce_target, resolve_target, target_identity
from specfoundry.families import FAMILIES
from specfoundry.families.folders import (
    TRAINING_FILE,
    DraftLoadError,
    check_trained_for,
    find_draft_files,
    locate_draft,
    serving_verifier,
    trained_for,
    training_record,
)


@dataclass(frozen=True, kw_only=True)
class ExportConfig(Settings):
    """Settings of one sf-export run (recorded in export_config.json in the output)."""

    draft: str = setting(argument=True, help="The draft: an exported folder (ours, or another tool's in SGLang or "
                         "speculators layout), an sf-train run folder, or one of its checkpoints/step-N.")
    output: str = shared("output", resume=False)
    format: str = setting("sglang", choices=FAMILIES.layouts(), help=FAMILIES.layouts_help())
    target: str | None = shared("target", None, shown="the target the draft records it was trained for, else "
                                f"{EMBEDDED_DEFAULT}")
    verifier: str | None = setting(None, shown="the target; for smollm2 its Hugging Face id",
                                   help="speculators: the model vLLM loads as the target, a Hugging Face id or a "
                                        "path on the serving machine (speculators_config.verifier.name_or_path).")
    k: int | None = shared("draft_tokens", None, shown=FAMILIES.export_k_shown(), help=FAMILIES.draft_tokens_help())


def check_fits_target(dcfg, identity, layout: str) -> None:
    """Refuse a draft whose vocabulary, width or layers the target cannot feed."""
    width = dcfg.target_hidden_size
    if (dcfg.vocab_size, width) != (identity.vocab_size, identity.hidden_size):
        raise DraftLoadError(f"the draft reads a target of vocabulary {dcfg.vocab_size} and width {width}; target "
                             f"{identity.name} has {identity.vocab_size} and {identity.hidden_size} (pass --target)")
    layers = list(dcfg.target_layers)
    # SGLang captures a layer's output as the input of the next one: the last layer's has no next
    if layers and layout == "sglang" and max(layers) > identity.num_layers - 2:
        raise DraftLoadError(f"the draft reads the output of layer {max(layers)}, which SGLang cannot capture from a "
                             f"{identity.num_layers}-layer target (at most layer {identity.num_layers - 2})")


def run_export(cfg: ExportConfig) -> Path:
    """Read cfg.draft, write it to cfg.output in cfg.format (whole or not at all); returns the folder."""
    if cfg.k is not None and cfg.format != "speculators":  # else written nowhere, and nothing said
        raise ValueError(f"-k {cfg.k} is written only into a speculators export (--format speculators); SGLang takes "
                         "the tokens a round proposes when it serves (--speculative-num-steps)")
    source = Path(cfg.draft)
    ref = locate_draft(source)
    family = ref.provider
    if cfg.format not in family.layouts:
        raise DraftLoadError(f"{source} is a {family.name} draft, which specfoundry exports as "
                             f"{', '.join(family.layouts)} only")
    recorded = trained_for(ref)
    target = cfg.target or (recorded or {}).get("name") or EMBEDDED_DEFAULT
    target_dir = resolve_target(target)
    announce_target("sf-export", target, target_dir)
    other = check_trained_for(ref, target_dir, allow_other=True)
    if other:  # the export still records the target it was trained for, which sf-eval checks
        print(f"sf-export: warning: {other}; the export records the target it was trained for", file=sys.stderr)
    identity = target_identity(target, target_dir)
    dcfg, tensors = find_draft_files(ref.for_target(identity.num_layers))
    check_fits_target(dcfg, identity, cfg.format)
    out = Path(os.path.abspath(cfg.output))  # ('-o .' names the folder it is)
    if out.is_symlink():  # the folder the link names is written; the link stays a link
        out = out.resolve()
    dcfg = family.for_serving(dcfg, json.loads((target_dir / "config.json").read_text()))
    training = training_record(ref)  # how it was trained (token loss, step kept, modes): sf-eval's default mode

    def fill(tmp: Path) -> None:  # written whole aside, or not at all: a failure (a full disk) leaves nothing
        family.export(tensors, dcfg, tmp, recorded, layout=cfg.format,
                      verifier=serving_verifier(target, target_dir, cfg.verifier), speculative_tokens=cfg.k)
        if training is not None:
            atomic_write_json(tmp / TRAINING_FILE, training)
        atomic_write_json(tmp / "export_config.json", config_dict(cfg))

    with sibling_lock(out, "export"):  # two runs into one folder: the second is refused, none loses the export
        check_output_folder(out, "export", cfg)
        write_dir_whole(out, fill)
    return out
