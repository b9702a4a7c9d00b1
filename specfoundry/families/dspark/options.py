"""sf-train settings of the DSpark family (recorded in train_config.json under `dspark`).

DSpark extends DFlash: the block, anchors, layers, mask token and slot decay (--gamma) are DFlash's
options (`dflash:` group, read through Extended.parent); these are DSpark's own. The three loss
weights are positive: each term is part of the method (SpecForge's and speculators' recipes use
0.1, 0.9 and 1)."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import Range, Settings, setting


@dataclass(frozen=True, kw_only=True)
class DSparkOptions(Settings):
    markov_rank: int = setting(256, valid=Range(1, 65536), help="DSpark: rank R of the Markov head, the previous "
                               "token's logit bias markov_w2(markov_w1(token)), [V, R] each (SGLang requires R > 0).")
    confidence_with_markov: bool = setting(True, help="DSpark: the confidence head reads the Markov head's "
                                           "embedding of the previous token beside the block state "
                                           "(confidence_head_with_markov).")
    ce_weight: float = setting(0.1, valid=Range(0, 1000, min_open=True), help="DSpark: weight of the cross "
                               "entropy against the conversation's tokens in the loss.")
    l1_weight: float = setting(0.9, valid=Range(0, 1000, min_open=True), help="DSpark: weight of the L1 distance "
                               "between the draft's and the target's distributions (the target's from the stored "
                               "final state).")
    confidence_weight: float = setting(1.0, valid=Range(0, 1000, min_open=True), help="DSpark: weight of the "
                                       "confidence head's binary cross entropy against 1 - L1/2.")


def default_layers(num_target_layers: int, options) -> list[int]:
    """DFlash's default (one target layer per draft layer), from the parent's options."""
    from specfoundry.families.dflash.options import default_layers as dflash_layers

    return dflash_layers(num_target_layers, options.parent)
