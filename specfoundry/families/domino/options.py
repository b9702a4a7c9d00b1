"""sf-train settings of the Domino family (recorded in train_config.json under `domino`).

Domino extends DFlash: the block, anchors, layers, mask token and slot decay are DFlash's options
(`dflash:` group, read through Extended.parent); these are Domino's own."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import Range, Settings, setting


@dataclass(frozen=True, kw_only=True)
class DominoOptions(Settings):
    gru_hidden_dim: int = setting(1024, valid=Range(1, 65536), help="Domino: width of the prefix GRU over the "
                                  "block's previous tokens (SGLang's dflash_config.gru_hidden_dim).")
    correction_dim: int = setting(256, valid=Range(1, 65536), help="Domino: bottleneck of the logit correction "
                                  "[state; GRU] -> correction_dim -> V (SGLang's dflash_config.emb_dim).")
    base_weight_start: float = setting(1.0, valid=Range(0, 1), help="Domino: lambda at step 0 in the loss "
                                       "(1 - lambda) CE(final) + lambda CE(base).")
    base_weight_end: float = setting(0.0, valid=Range(0, 1), help="Domino: lambda once the decay is over.")
    base_decay_fraction: float = setting(1.0, valid=Range(0, 1, min_open=True), help="Domino: lambda decays "
                                         "linearly from start to end over this fraction of the run's steps.")


def default_layers(num_target_layers: int, options) -> list[int]:
    """DFlash's default (one target layer per draft layer), from the parent's options."""
    from specfoundry.families.dflash.options import default_layers as dflash_layers

    return dflash_layers(num_target_layers, options.parent)
