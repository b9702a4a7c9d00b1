"""The Domino draft's config: DFlash's (families/dflash/config.py) plus the head's two widths.

SGLang reads the head from dflash_config (python/sglang/srt/speculative/dflash_utils.py
parse_dflash_draft_config, as its test test_dflash_domino exercises): projector_type "domino",
shift_label true, pure_draft_prefix_len 1 (the only values it serves), gru_hidden_dim and emb_dim.
Those three fixed values are the model's math here, not settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specfoundry.families.dflash.config import DFlashConfig, dflash_config_from_target

PROJECTOR_TYPE = "domino"
PURE_DRAFT_PREFIX_LEN = 1
"""Block slots 0..PURE_DRAFT_PREFIX_LEN-1 keep the base logits (no correction)."""


@dataclass(frozen=True, kw_only=True)
class DominoConfig(DFlashConfig):
    family: ClassVar[str] = "domino"
    gru_hidden_dim: int
    """G: the prefix GRU's width (input: the target's embedding width H)."""
    emb_dim: int
    """E: embed_proj = Linear(H + G -> E), SiLU, Linear(E -> V)."""

    def __post_init__(self):
        super().__post_init__()
        if self.gru_hidden_dim < 1 or self.emb_dim < 1:
            raise ValueError(f"gru_hidden_dim and emb_dim must be positive, got {self.gru_hidden_dim}, {self.emb_dim}")


def domino_config_from_target(target_dir, layers, num_hidden_layers: int, block_size: int, mask_token_id: int,
                              gru_hidden_dim: int, emb_dim: int) -> DominoConfig:
    base = dflash_config_from_target(target_dir, layers, num_hidden_layers, block_size, mask_token_id)
    d = base.to_dict()
    d.update(gru_hidden_dim=gru_hidden_dim, emb_dim=emb_dim)
    return DominoConfig.from_dict(d)
