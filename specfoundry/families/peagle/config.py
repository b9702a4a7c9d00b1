"""The P-EAGLE draft's architecture config: EAGLE-3's (families/eagle3/config.py) plus the layer count,
the depths drafted per forward and the mask (pard) token. Its training options: options.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from specfoundry.common.target import draft_shape_of
from specfoundry.families.eagle3.config import Eagle3Config


@dataclass(frozen=True, kw_only=True)
class PEagleConfig(Eagle3Config):
    family: ClassVar[str] = "peagle"
    num_hidden_layers: int = 1
    """Decoder layers: layer 0 reads [norm(embed), norm(hidden)] (2H wide), the others H."""
    num_depths: int = 7
    """K: one forward drafts depth 0 (the real token and target features) and depths 1..K-1 (mask slots)."""
    mask_token_id: int
    """The token of the mask slots (vLLM's pard_token); its embedding is the target's row."""

    def __post_init__(self):
        for name in ("num_hidden_layers", "num_depths", "mask_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "mask_token_id" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'mask_token_id' else 'positive'} "
                                 f"integer, got {value!r}")
        if not self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.fc_norm or self.norm_output:
            raise ValueError("fc_norm and norm_output are EAGLE-3.1 options that vLLM's P-EAGLE path does not read")
        if self.aux_layer_ids and len(self.aux_layer_ids) != 3:
            raise ValueError(f"P-EAGLE's fc reads 3 target layers (vLLM builds it 3 x target_hidden_size wide); "
                             f"got {list(self.aux_layer_ids)}")

    @classmethod
    def from_dict(cls, d: dict) -> PEagleConfig:
        d = dict(d)
        d.pop("family", None)
        d["aux_layer_ids"] = tuple(d.get("aux_layer_ids", ()))
        return cls(**d)


def peagle_config_from_target(target_config: dict | Path, draft_vocab_size: int, aux_layer_ids, *,
                              num_hidden_layers: int, num_depths: int, mask_token_id: int) -> PEagleConfig:
    """The draft mirrors the target's width, attention, RoPE and norm eps (as EAGLE-3's); SwiGLU MLP."""
    return PEagleConfig(**draft_shape_of(target_config), draft_vocab_size=draft_vocab_size,
                        aux_layer_ids=tuple(aux_layer_ids), num_hidden_layers=num_hidden_layers,
                        num_depths=num_depths, mask_token_id=mask_token_id)
