"""sf-train settings of the EAGLE-3 family (recorded in train_config.json under `eagle3`) and its
default layers: what the catalogue (specfoundry/families/__init__.py) reads without loading the family."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import MAX_DRAFT, MAX_TOKENS, Range, Settings, setting


@dataclass(frozen=True, kw_only=True)
class Eagle3Options(Settings):
    """sf-train settings of the EAGLE-3 family (recorded in train_config.json under `eagle3`)."""

    draft_vocab_size: int = setting(32000, valid=Range(1, MAX_TOKENS), help="EAGLE-3: draft vocabulary, this many most frequent loss-masked "
                                    "tokens.")
    ttt_length: int = setting(7, valid=Range(1, MAX_DRAFT), help="EAGLE-3: Training-Time Test steps unrolled per forward (the draft length "
                              "trained).")
    loss_decay: float = setting(0.8, valid=Range(0, 1, min_open=True), help="EAGLE-3: the loss of TTT step s is weighted decay^s.")
    fc_norm: bool = setting(False, help="EAGLE-3.1: an RMSNorm on each captured state before fc.")
    norm_output: bool = setting(False, help="EAGLE-3.1: the next draft step receives the post-norm state instead "
                                "of the pre-norm one.")


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle, high: the outputs of layers [1, L//2-1, L-4] (SGLang's EAGLE-3 default), which
    are three distinct layers from L = 7 up; a smaller target gets spread_layers(L, 3), e.g.
    [0, 1, 2] for L = 4, [0, 2, 4] for L = 6."""
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    if layers != sorted(set(layers)) or layers[0] < 0:
        from specfoundry.common.taps import spread_layers  # (torch: not at import)

        return spread_layers(num_layers, 3)
    return layers


def default_layers(num_target_layers: int, options: Eagle3Options) -> list[int]:
    """SGLang's default, [1, L//2-1, L-4] (default_aux_layers)."""
    return default_aux_layers(num_target_layers)
