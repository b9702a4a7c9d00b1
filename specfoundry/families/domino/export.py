"""Export a Domino draft as the directory SGLang serves with `--speculative-algorithm DFLASH`.

Written from SGLang's public Domino code: python/sglang/srt/speculative/domino_utils.py
(validate_domino_runtime: a bias-free GRU of input size H, embed_proj.0 of H + G inputs,
embed_proj.2 of V outputs; domino_greedy_rollout: the decoding), its loader test
test_dflash_domino.py (TestDFlashDominoConfig / TestDFlashDominoWeights: the dflash_config fields,
each of the four head tensors required, shapes checked) and python/sglang/srt/models/dflash.py
(the backbone's names, as families/dflash/export.py). Upstream's configs (SpecForge
configs/qwen3-8b-domino.json, as the speculators converter's test reproduces it) name the
architecture DominoDraftModel; SGLang serves the DFlash architecture with projector_type "domino",
which is what this export writes (and the catalogue reads either as Domino).

config.json = DFlash's (families/dflash/export.py sglang_config), plus
    dflash_config.projector_type        "domino"
    dflash_config.shift_label           true   (slot j predicts the token at p+j+1)
    dflash_config.pure_draft_prefix_len 1      (slot 0 keeps the base logits)
    dflash_config.gru_hidden_dim        G
    dflash_config.emb_dim               E      (and emb_dim at the top level, as upstream writes it;
                                                SGLang refuses the two when they differ)
tensors = DFlash's (fc, hidden_norm, norm, layers.N.*), plus
    prefix_gru.weight_ih_l0   [3G, H]
    prefix_gru.weight_hh_l0   [3G, G]
    embed_proj.0.weight       [E, H + G]
    embed_proj.2.weight       [V, E]
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.families.dflash import export as dflash_export
from specfoundry.families.domino.config import PROJECTOR_TYPE, PURE_DRAFT_PREFIX_LEN, DominoConfig
from specfoundry.families.folders import check_tensors


def expected_tensors(cfg: DominoConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name SGLang's Domino loader fills, with its shape."""
    h, g, e = cfg.hidden_size, cfg.gru_hidden_dim, cfg.emb_dim
    return {**dflash_export.expected_tensors(cfg),
            "prefix_gru.weight_ih_l0": (3 * g, h), "prefix_gru.weight_hh_l0": (3 * g, g),
            "embed_proj.0.weight": (e, h + g), "embed_proj.2.weight": (cfg.vocab_size, e)}


def sglang_config(cfg: DominoConfig, num_target_layers: int | None) -> dict:
    config = dflash_export.sglang_config(cfg, num_target_layers)
    config["emb_dim"] = cfg.emb_dim
    config["dflash_config"].update(projector_type=PROJECTOR_TYPE, shift_label=True,
                                   pure_draft_prefix_len=PURE_DRAFT_PREFIX_LEN, gru_hidden_dim=cfg.gru_hidden_dim,
                                   emb_dim=cfg.emb_dim)
    return config


def validate(tensors: dict[str, torch.Tensor], cfg: DominoConfig) -> None:
    check_tensors(tensors, {name: (shape, None) for name, shape in expected_tensors(cfg).items()}, "SGLang", "Domino")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: DominoConfig, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> Path:
    """Write the SGLang directory (families/dflash/export.py write_block_export, with the head)."""
    return dflash_export.write_block_export(state_dict, cfg, out_dir, dtype, target, validate, sglang_config)


def config_from_sglang(config: dict) -> DominoConfig:
    """A DominoConfig from a Domino config.json, read as SGLang reads it (ValueError for the
    head settings SGLang refuses; KeyError naming a missing field)."""
    dflash = config.get("dflash_config") or {}
    if dflash.get("projector_type") != PROJECTOR_TYPE:
        raise ValueError(f"dflash_config.projector_type is {dflash.get('projector_type')!r}, not {PROJECTOR_TYPE!r}")
    if dflash.get("shift_label") is not True:
        raise ValueError(f"dflash_config.shift_label is {dflash.get('shift_label')!r}; Domino is served with true only")
    if dflash.get("pure_draft_prefix_len") != PURE_DRAFT_PREFIX_LEN:
        raise ValueError(f"dflash_config.pure_draft_prefix_len is {dflash.get('pure_draft_prefix_len')!r}; Domino is "
                         f"served with {PURE_DRAFT_PREFIX_LEN} only")
    emb = dflash.get("emb_dim", config.get("emb_dim"))
    if "emb_dim" in dflash and config.get("emb_dim") not in (None, dflash["emb_dim"]):
        raise ValueError(f"emb_dim differs: {config['emb_dim']} at the top level, {dflash['emb_dim']} in dflash_config")
    if emb is None:
        raise KeyError("dflash_config.emb_dim")
    d = dflash_export.config_from_sglang(config).to_dict()
    d.update(gru_hidden_dim=dflash["gru_hidden_dim"], emb_dim=emb)
    return DominoConfig.from_dict(d)


def read_config(path: str | Path) -> DominoConfig:
    return dflash_export.read_config_with(path, config_from_sglang)


def load_export(path: str | Path) -> tuple[DominoConfig, dict[str, torch.Tensor]]:
    return dflash_export.load_export_with(path, "domino", config_from_sglang)
