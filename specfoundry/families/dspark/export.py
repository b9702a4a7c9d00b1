"""Export a DSpark draft as the directory SGLang serves with `--speculative-algorithm DSPARK` (and
vLLM with `"method": "dspark"`).

Written from the engines' public loaders:
- SGLang python/sglang/srt/models/dspark.py (DSparkDraftMixin.load_weights: the DFlash backbone's
  names as python/sglang/srt/models/dflash.py loads them, then `markov_head.*` (each must name a
  parameter of the head) and `confidence_head.*` (every parameter required while the head is
  enabled); `embed_tokens.`, `lm_head.`, `rotary_emb.` skipped: the target's embedding and lm_head
  are used; VanillaMarkov: markov_w1 = Embedding(V, R), markov_w2 = Linear(R, V, bias=False);
  DSparkConfidenceHead: proj = Linear(H + R or H, 1) with a bias; EntryClass Qwen3DSparkModel);
- SGLang python/sglang/srt/speculative/dspark_components/dspark_config.py
  (parse_dspark_draft_config: markov_rank, markov_head_type, mask_token_id read from dspark_config,
  then the top level; markov_rank > 0 and a markov_head_type required; gamma = block_size;
  speculators_model_type "dspark" refused: that convention trains slot j on x_{a+j});
- speculative/dspark_components/dspark_confidence.py (the confidence head reads
  [z_j; markov_w1(u_j)], u_0 the anchor, u_j the proposal of slot j-1);
- vLLM's hf_config_override (DSparkDraftModel normalised to Qwen3DSparkModel, mask_token_id and
  target_layer_ids copied from dflash_config to the top level), and the DeepSpec-derived loaders'
  checks (architectures ["Qwen3DSparkModel"], model_type qwen3, an explicit markov_head_type
  "vanilla", enable_confidence_head and confidence_head_with_markov written out).

config.json = DFlash's (families/dflash/export.py sglang_config) with
    architectures                ["Qwen3DSparkModel"]   (SGLang's entry class, vLLM's name; both
                                                          engines also take DSparkDraftModel)
    markov_rank                  R (> 0)
    markov_head_type             "vanilla"
    enable_confidence_head       true
    confidence_head_with_markov  true / false
    mask_token_id, target_layer_ids   at the top level too, equal to dflash_config's
    block_size                   B: the block [bonus, M, ..., M] gives B proposals (SGLang's gamma),
                                 verified as B + 1 tokens
tensors = DFlash's (fc, hidden_norm, norm, layers.N.*), plus
    markov_head.markov_w1.weight    [V, R]
    markov_head.markov_w2.weight    [V, R]
    confidence_head.proj.weight     [1, H + R]  ([1, H] without confidence_head_with_markov)
    confidence_head.proj.bias       [1]
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.families.dflash import export as dflash_export
from specfoundry.families.dspark.config import MARKOV_HEAD_TYPE, DSparkConfig
from specfoundry.families.folders import check_tensors

ARCHITECTURE = "Qwen3DSparkModel"


def expected_tensors(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name SGLang's DSpark loader fills, with its shape."""
    v, r = cfg.vocab_size, cfg.markov_rank
    return {**dflash_export.expected_tensors(cfg),
            "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
            "confidence_head.proj.weight": (1, cfg.confidence_inputs), "confidence_head.proj.bias": (1,)}


def sglang_config(cfg: DSparkConfig, num_target_layers: int | None) -> dict:
    config = dflash_export.sglang_config(cfg, num_target_layers)
    config["architectures"] = [ARCHITECTURE]
    config.update(markov_rank=cfg.markov_rank, markov_head_type=MARKOV_HEAD_TYPE, enable_confidence_head=True,
                  confidence_head_with_markov=cfg.confidence_with_markov, mask_token_id=cfg.mask_token_id,
                  target_layer_ids=list(cfg.target_layer_ids))
    return config


def validate(tensors: dict[str, torch.Tensor], cfg: DSparkConfig) -> None:
    check_tensors(tensors, {name: (shape, None) for name, shape in expected_tensors(cfg).items()}, "SGLang", "DSpark")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: DSparkConfig, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> Path:
    """Write the SGLang directory (families/dflash/export.py write_block_export, with the heads)."""
    return dflash_export.write_block_export(state_dict, cfg, out_dir, dtype, target, validate, sglang_config)


def field(config: dict, name: str, default=None):
    """A DSpark field as SGLang reads it: dspark_config first, then the top level."""
    return (config.get("dspark_config") or {}).get(name, config.get(name, default))


def config_from_sglang(config: dict) -> DSparkConfig:
    """A DSparkConfig from a DSpark config.json, read as SGLang reads it (ValueError for what SGLang
    refuses or specfoundry's draft does not have; KeyError naming a missing field)."""
    if config.get("speculators_model_type") == "dspark":
        raise ValueError("speculators_model_type 'dspark': the speculators convention trains slot j on the "
                         "token at anchor+j, which SGLang's DSpark refuses and this draft does not have")
    rank = field(config, "markov_rank")
    if rank is None:
        raise KeyError("markov_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"markov_rank is {rank!r}; SGLang's DSpark requires a positive integer")
    kind = field(config, "markov_head_type")
    if kind is None:
        raise ValueError("markov_head_type is missing; SGLang's DSpark requires it when markov_rank > 0")
    if str(kind).lower() != MARKOV_HEAD_TYPE:
        raise ValueError(f"markov_head_type is {kind!r}; specfoundry's DSpark draft has the {MARKOV_HEAD_TYPE!r} "
                         "Markov head only")
    if config.get("enable_confidence_head", True) is not True:
        raise ValueError(f"enable_confidence_head is {config.get('enable_confidence_head')!r}; specfoundry's DSpark "
                         "draft always has its confidence head (SGLang builds it and requires its weights)")
    with_markov = config.get("confidence_head_with_markov", True)
    dflash = config.get("dflash_config") or {}
    if "target_layer_ids" in config and "target_layer_ids" in dflash and config["target_layer_ids"] != dflash[
            "target_layer_ids"]:
        raise ValueError(f"target_layer_ids differs: {config['target_layer_ids']} at the top level, "
                         f"{dflash['target_layer_ids']} in dflash_config")
    mask = field(config, "mask_token_id", dflash.get("mask_token_id"))  # SGLang's DSpark reads this one
    if "mask_token_id" in dflash and mask != dflash["mask_token_id"]:
        raise ValueError(f"mask_token_id differs: {mask} for DSpark, {dflash['mask_token_id']} in dflash_config")
    if mask is not None:
        config = {**config, "dflash_config": {**dflash, "mask_token_id": mask}}
    d = dflash_export.config_from_sglang(config).to_dict()
    d.update(markov_rank=rank, confidence_with_markov=with_markov)
    return DSparkConfig.from_dict(d)


def read_config(path: str | Path) -> DSparkConfig:
    return dflash_export.read_config_with(path, config_from_sglang)


def load_export(path: str | Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    return dflash_export.load_export_with(path, "dspark", config_from_sglang)
