"""sf-train settings of the DFlash family (recorded in train_config.json under `dflash`). Domino,
DSpark and DFlash2 extend DFlash and read this group too, except the objective and the teacher (DFlash only):
each option's help says which families read it."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import MAX_DRAFT, MAX_TOKENS, Range, Settings, setting

TEACHERS = ("hard", "soft")
OBJECTIVES = ("dflash", "dpace")


@dataclass(frozen=True, kw_only=True)
class DFlashOptions(Settings):
    num_draft_layers: int = setting(5, valid=Range(1, 256),
                                    help="DFlash, Domino, DSpark, DFlash2: decoder layers of the draft (it reads as many target "
                                         "layers by default; --layers may give any number).")
    block_size: int = setting(16, valid=Range(2, MAX_DRAFT + 1),
                              help="DFlash, Domino, DSpark, DFlash2: positions per block, the anchor and block_size-1 proposals.")
    num_anchors: int = setting(512, valid=Range(1, MAX_TOKENS),
                               help="DFlash, Domino, DSpark, DFlash2: anchors sampled per sample and step, among supervised "
                                    "positions.")
    gamma: float = setting(7.0, valid=Range(),
                           help="DFlash, Domino, DSpark, DFlash2: a block slot's loss is weighted exp(-d/gamma), d its distance "
                                "from the block's first predicted slot (<= 0: uniform).")
    mask_token_id: int | None = setting(None, valid=Range(0, MAX_TOKENS), shown="the first embedding row past the tokenizer's vocabulary, else "
                                        "the highest id never seen in the feature set",
                                        help="DFlash, Domino, DSpark, DFlash2: the token id of the block's mask positions.")
    teacher: str = setting("hard", choices=TEACHERS, help="DFlash only: hard: the conversation's tokens; soft: the "
                           "target's distribution from the stored final state.")
    objective: str = setting("dflash", choices=OBJECTIVES, help="DFlash only: dflash (slot losses weighted by "
                             "--gamma) or dpace (D-PACE's weights from the draft's own confidence); docs/families.md, "
                             "\"DFlash\".")
    final_norm_init: float = setting(1.0, valid=Range(0, 1, min_open=True),
                                     help="DFlash, Domino, DSpark, DFlash2: a fresh draft's final RMSNorm weight (0.1: a first "
                                          "loss near uniform's; --init-from keeps its own; docs/families.md, "
                                          "\"DFlash\").")
    dpace_alpha: float = setting(0.5, valid=Range(0, 1, zero="the raw label probabilities"),
                                 help="DFlash only, objective dpace: each slot's label probability q is smoothed to "
                                 "(1-alpha) q + alpha (1: fixed linear weights).")


def dflash_default_layers(num_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash's default: num_draft_layers ids spread evenly from layer 1 to layer L-3, rounded,
        id_i = round(1 + i * (L - 4) / (n - 1)),  i = 0..n-1     (n = 1: [L // 2])
    e.g. [1, 9, 17, 25, 33] for L = 36, n = 5 (the public DFlash drafts' layers). Where that
    repeats a layer (a target of few layers: L < n + 3), spread_layers(L, n) instead."""
    if num_draft_layers == 1:
        return [num_layers // 2]
    span = num_layers - 4
    layers = [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    if layers != sorted(set(layers)):
        from specfoundry.common.taps import spread_layers  # (torch: not at import)

        return spread_layers(num_layers, num_draft_layers)
    return layers


def default_layers(num_target_layers: int, options: DFlashOptions) -> list[int]:
    """One target layer per draft layer, spread from layer 1 to L-3 (dflash_default_layers)."""
    return dflash_default_layers(num_target_layers, options.num_draft_layers)
