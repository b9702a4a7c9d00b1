"""The DFlash2 draft's config: DFlash's (families/dflash/config.py) plus the shapes of its
convolutions and selector, the four fields SGLang's and vLLM's loaders read from dflash_config
(conv_kernel_size, conv_group_size, selector_rank, selector_top_k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specfoundry.families.dflash.config import DFlashConfig, dflash_config_from_target

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The config's own fields, as the engines name them in dflash_config."""


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DFlash2Config(DFlashConfig):
    family: ClassVar[str] = "dflash2"
    conv_kernel_size: int = 2
    """T: taps of each dynamic causal convolution (base_kernel [2, T, H])."""
    conv_group_size: int = 16
    """Channels sharing one dynamic coefficient per tap: kernel_projection gives 2 T (H / group) of them."""
    selector_rank: int = 256
    """r: the selector's codebooks are [V, r], its hidden projection [r, H]."""
    selector_top_k: int = 16
    """K: the candidates each slot's selector rescores, the top K of the target's lm_head."""

    def __post_init__(self):
        super().__post_init__()
        for name in DFLASH2_FIELDS:
            positive_int(name, getattr(self, name))
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


def dflash2_config_from_target(target_dir, layers, num_hidden_layers: int, block_size: int, mask_token_id: int,
                               own) -> DFlash2Config:
    """DFlash's config for the target plus `own`'s (DFlash2Options) four shape fields."""
    base = dflash_config_from_target(target_dir, layers, num_hidden_layers, block_size, mask_token_id)
    return DFlash2Config.from_dict({**base.to_dict(), **{name: getattr(own, name) for name in DFLASH2_FIELDS}})
