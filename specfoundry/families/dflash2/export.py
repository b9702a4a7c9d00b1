"""Export a DFlash2 draft as the directory SGLang and vLLM serve (`DFlash2DraftModel`, the native
layout z-lab's checkpoints, SpecForge's and ModelOpt's exports share).

Written from the engines' public loaders: SGLang's dflash_utils.py parse_dflash_draft_config (dflash_config's block_size, conv_kernel_size,
conv_group_size, selector_rank, selector_top_k, target_layer_ids, mask_token_id; the conv pair and
the selector pair set together; DFlash2DraftModel requires selector_rank; the serving algorithm
stays DFLASH, the architecture picks the path), vLLM's qwen3_dflash2.py (dflash_config's
conv_kernel_size, conv_group_size, selector_rank, selector_top_k read with [] and so required;
input_embedding_scale, output_multiplier, final_logit_softcapping optional) and z-lab's fixtures
(tests/fixtures/dflash2-config.json, dflash2-safetensors-header.json).

config.json = DFlash's (families/dflash/export.py sglang_config) with
    architectures   ["DFlash2DraftModel"]
    dflash_config   {block_size, mask_token_id, target_layer_ids, conv_kernel_size, conv_group_size,
                     selector_rank, selector_top_k}
tensors = DFlash's (fc, hidden_norm, norm, layers.N.*; no embedding, no lm_head), plus per layer
    layers.N.attention_conv.base_kernel, layers.N.mlp_conv.base_kernel       [2, T, H]
    layers.N.attention_conv.kernel_projection.weight, .mlp_conv.same        [2 T (H / group), H]
and the selector's, the codebooks raw parameters (no `.weight`, as every engine names them)
    candidate_selector.hidden_projection.weight                             [r, H]
    candidate_selector.predecessor_codebook, candidate_selector.successor_codebook   [V, r]
Refused on reading, one line each: a dflash_config without one of the four fields (vLLM's
KeyError), a zero one (SGLang's DFlash without convolutions or selector, another draft), an
output_multiplier, final_logit_softcapping or input_embedding_scale other than the identity
(transforms this draft does not have), an is_causal that contradicts the layers' attention.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.families.dflash import export as dflash_export
from specfoundry.families.dflash2.config import DFLASH2_FIELDS, DFlash2Config
from specfoundry.families.folders import check_tensors

ARCHITECTURE = "DFlash2DraftModel"
IDENTITY_FIELDS = {"output_multiplier": 1.0, "input_embedding_scale": 1.0, "final_logit_softcapping": 0.0}
"""Optional dflash_config transforms the engines apply (vLLM, z-lab) and their no-op values
(SGLang reads a softcap of 0 as none)."""


def expected_tensors(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name the engines' DFlash2 loaders fill, with its shape."""
    h, t, v, r = cfg.hidden_size, cfg.conv_kernel_size, cfg.vocab_size, cfg.selector_rank
    spec = dict(dflash_export.expected_tensors(cfg))
    for n in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            spec[f"layers.{n}.{conv}.base_kernel"] = (2, t, h)
            spec[f"layers.{n}.{conv}.kernel_projection.weight"] = (2 * t * cfg.conv_groups, h)
    spec.update({"candidate_selector.hidden_projection.weight": (r, h),
                 "candidate_selector.predecessor_codebook": (v, r), "candidate_selector.successor_codebook": (v, r)})
    return spec


def sglang_config(cfg: DFlash2Config, num_target_layers: int | None) -> dict:
    config = dflash_export.sglang_config(cfg, num_target_layers)
    config["architectures"] = [ARCHITECTURE]
    config["dflash_config"].update(block_size=cfg.block_size, **{name: getattr(cfg, name) for name in DFLASH2_FIELDS})
    return config


def validate(tensors: dict[str, torch.Tensor], cfg: DFlash2Config) -> None:
    check_tensors(tensors, {name: (shape, None) for name, shape in expected_tensors(cfg).items()}, "SGLang and vLLM",
                  "DFlash2")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: DFlash2Config, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> Path:
    """Write the directory (families/dflash/export.py write_block_export, with the convolutions and
    the selector)."""
    return dflash_export.write_block_export(state_dict, cfg, out_dir, dtype, target, validate, sglang_config)


def check_causality(config: dict) -> None:
    """An explicit is_causal (vLLM lets it override the layer types) must say what this draft's layers
    do: full-attention layers non-causal within the block, sliding ones causal."""
    if "is_causal" not in config:
        return
    types = set(config.get("layer_types") or ["full_attention"])
    if config["is_causal"] is not False or "sliding_attention" in types:
        raise ValueError(f"is_causal {config['is_causal']!r} with layer types {sorted(types)}: this draft's "
                         "full-attention layers are non-causal within the block and its sliding ones causal")


def config_from_sglang(config: dict) -> DFlash2Config:
    """A DFlash2Config from a DFlash2 config.json, read as the engines read it (KeyError naming a
    missing field, ValueError for what this draft does not have)."""
    dflash = config.get("dflash_config") or {}
    for name in DFLASH2_FIELDS:
        if name not in dflash:
            raise KeyError(f"dflash_config.{name}")
        if dflash[name] == 0:
            raise ValueError(f"dflash_config.{name} is 0: a DFlash draft without DFlash2's convolutions or "
                             "selector, which this family does not read")
    for name, identity in IDENTITY_FIELDS.items():
        if dflash.get(name) not in (None, identity):
            raise ValueError(f"dflash_config.{name} is {dflash[name]!r}; specfoundry's DFlash2 draft has no such "
                             "transform (only the engines' default, none)")
    check_causality(config)
    d = dflash_export.config_from_sglang(config).to_dict()
    d.update({name: dflash[name] for name in DFLASH2_FIELDS})
    return DFlash2Config.from_dict(d)


def read_config(path: str | Path) -> DFlash2Config:
    return dflash_export.read_config_with(path, config_from_sglang)


def load_export(path: str | Path) -> tuple[DFlash2Config, dict[str, torch.Tensor]]:
    return dflash_export.load_export_with(path, "dflash2", config_from_sglang)
