"""The DSpark draft's config: DFlash's (families/dflash/config.py) plus the heads' settings.

SGLang (python/sglang/srt/models/dspark.py, speculative/dspark_components/dspark_config.py) reads
markov_rank (> 0), markov_head_type (vanilla, gated or rnn), enable_confidence_head and
confidence_head_with_markov. specfoundry's draft has the vanilla Markov head and always a
confidence head: those two are the model's math here, not settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specfoundry.families.dflash.config import DFlashConfig, dflash_config_from_target

MARKOV_HEAD_TYPE = "vanilla"


@dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    family: ClassVar[str] = "dspark"
    markov_rank: int
    """R: markov_w1 embeds the previous token [V, R], markov_w2 projects it to a logit bias [V, R]."""
    confidence_with_markov: bool = True
    """The confidence head reads [z; markov_w1(previous token)] (H + R inputs), else z alone (H)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            raise ValueError(f"markov_rank must be a positive integer (SGLang requires > 0), got {self.markov_rank!r}")
        if not isinstance(self.confidence_with_markov, bool):
            raise ValueError(f"confidence_head_with_markov must be true or false, got {self.confidence_with_markov!r}")

    @property
    def confidence_inputs(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_with_markov else 0)


def dspark_config_from_target(target_dir, layers, num_hidden_layers: int, block_size: int, mask_token_id: int,
                              markov_rank: int, confidence_with_markov: bool = True) -> DSparkConfig:
    base = dflash_config_from_target(target_dir, layers, num_hidden_layers, block_size, mask_token_id)
    d = base.to_dict()
    d.update(markov_rank=markov_rank, confidence_with_markov=confidence_with_markov)
    return DSparkConfig.from_dict(d)
