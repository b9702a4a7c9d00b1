"""The EAGLE-3 draft's architecture config, generated from the target's (its training options:
families/eagle3/options.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from specfoundry.common.target import draft_shape_of


@dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """Shape of the EAGLE-3 draft (one decoder layer); fields follow the target's config."""

    family: ClassVar[str] = "eagle3"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    vocab_size: int
    """The target's vocabulary (token embeddings, t2d)."""
    draft_vocab_size: int
    """The draft's lm_head width (d2t)."""
    target_hidden_size: int
    """Width of each captured target hidden state (fc takes 3x this)."""
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    """The draft's MLP is SwiGLU whatever the target's activation (Gemma's GELU is the target's own;
    SGLang's Llama-style draft layer takes SiLU only)."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm on each captured state before fc."""
    norm_output: bool = False
    """EAGLE-3.1: the next draft step receives the post-norm state (else the pre-norm one)."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers the draft reads (every family's config has this property)."""
        return tuple(self.aux_layer_ids)

    @property
    def num_aux(self) -> int:
        """Captured layers fc reads (three unless the layer list says otherwise)."""
        return len(self.aux_layer_ids) or 3

    def to_dict(self) -> dict:
        d = {"family": self.family, **asdict(self)}
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        d = dict(d)
        d.pop("family", None)
        d["aux_layer_ids"] = tuple(d.get("aux_layer_ids", ()))
        return cls(**d)


def draft_config_from_target(target_config: dict | Path, draft_vocab_size: int, aux_layer_ids,
                             overrides: dict | None = None) -> Eagle3Config:
    """The draft mirrors the target's width, attention shape (head_dim as the target states it), RoPE
    (the full-attention layers' where they differ per layer type) and norm eps; its MLP is SwiGLU
    (a recipe may override any field)."""
    d = dict(draft_shape_of(target_config), draft_vocab_size=draft_vocab_size, aux_layer_ids=tuple(aux_layer_ids))
    d.update(overrides or {})
    return Eagle3Config(**d)
