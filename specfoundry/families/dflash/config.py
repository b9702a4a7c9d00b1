"""The DFlash draft's architecture config, generated from the target's config.

The draft copies the target's width, attention shape, MLP, RoPE, norms and vocabulary (its
embeddings and lm_head are the target's); what is its own is the number of layers, the block
size, the mask token and the target layers it reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from specfoundry.common.target import draft_shape_of, text_config

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Shape of the DFlash draft (SGLang's `DFlashDraftModel`, a Qwen3-style decoder stack)."""

    family: ClassVar[str] = "dflash"
    hidden_size: int
    """The draft's width; must equal the target's (the block embeddings are the target's)."""
    intermediate_size: int
    num_hidden_layers: int
    """Draft decoder layers."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    vocab_size: int
    """The target's vocabulary (token embeddings; the target's lm_head scores it)."""
    target_hidden_size: int
    """Width of each captured target hidden state (fc takes K times this)."""
    target_layer_ids: tuple[int, ...]
    """The target layers read, 0-based outputs (HF hidden_states[k + 1]), strictly ascending:
    SGLang concatenates the captured layers in layer order, whatever the list's order."""
    block_size: int = 16
    """Block width B: the anchor token then B - 1 mask tokens, drafted in one forward."""
    mask_token_id: int
    """The id filling block slots 1..B-1 (its embedding is the target's row for it)."""
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    """Per layer "full_attention" (non-causal over context and block) or "sliding_attention"
    (causal inside the block, context and block within `sliding_window`); empty = all full."""
    sliding_window: int | None = None
    """Keys seen by a sliding layer's query: the W positions ending at its own (SGLang: W - 1 left)."""
    hidden_act: str = "silu"
    """SwiGLU whatever the target's activation (SGLang's DFlash layers take SiLU only)."""

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"DFlash drafts use SiLU (SGLang refuses others), got hidden_act={self.hidden_act!r}")
        ids = list(self.target_layer_ids)
        if not ids or ids != sorted(set(ids)):
            raise ValueError(f"target_layer_ids must be non-empty and strictly ascending (SGLang concatenates "
                             f"the layers in layer order), got {ids}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the draft has {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer types {unknown}: choose from {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not below vocab_size {self.vocab_size} (the target's "
                             "vocabulary, which the draft's tokens index): one of the two is wrong")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (slot 0 holds the anchor), got {self.block_size}")

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers the draft reads (every family's config has this property)."""
        return tuple(self.target_layer_ids)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def to_dict(self) -> dict:
        d = {"family": self.family, **asdict(self)}
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        d = dict(d)
        d.pop("family", None)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        d["layer_types"] = tuple(d.get("layer_types") or ())
        return cls(**d)


def dflash_config_from_target(target_config: dict | Path, target_layer_ids, num_hidden_layers: int,
                              block_size: int, mask_token_id: int, overrides: dict | None = None) -> DFlashConfig:
    """The draft mirrors the target's shape (draft_shape_of); its layers are full attention and
    SwiGLU whatever the target's (a recipe may override any field). target_config: the config
    dict, or a model directory holding config.json."""
    if isinstance(target_config, Path | str):
        target_config = json.loads((Path(target_config) / "config.json").read_text())
    ids = tuple(int(i) for i in target_layer_ids)
    layers = text_config(target_config).get("num_hidden_layers")
    if layers is not None and not all(0 <= i < layers - 1 for i in ids):
        # the last layer's output is post-norm in HF and cannot be captured by SGLang
        raise ValueError(f"target_layer_ids {list(ids)} must lie in 0..{layers - 2} for a {layers}-layer target")
    d = dict(draft_shape_of(target_config), num_hidden_layers=num_hidden_layers, target_layer_ids=ids,
             block_size=block_size, mask_token_id=mask_token_id)
    d.update(overrides or {})
    return DFlashConfig.from_dict(d)  # tuples even where an override gives lists
