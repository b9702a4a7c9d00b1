"""sf-train settings of the P-EAGLE family (recorded in train_config.json under `peagle`) and its
default layers: what the catalogue (specfoundry/families/__init__.py) reads without loading the family.

Option names are P-EAGLE's own (EAGLE-3's --draft-vocab-size and DFlash's --mask-token-id are
other groups' settings, so this group names its own: duplicate names fail at import)."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import MAX_DRAFT, MAX_TOKENS, Range, Settings, setting

LOSS_WEIGHTS = ("element", "depth")


@dataclass(frozen=True, kw_only=True)
class PEagleOptions(Settings):
    peagle_vocab_size: int = setting(32000, valid=Range(1, MAX_TOKENS), help="P-EAGLE: draft vocabulary, this many "
                                     "most frequent loss-masked tokens.")
    peagle_layers: int = setting(4, valid=Range(1, 64), help="P-EAGLE: decoder layers of the draft (the first reads "
                                 "[norm(embed), norm(hidden)] as EAGLE-3's, the others are plain Llama layers).")
    num_depths: int = setting(7, valid=Range(1, MAX_DRAFT), help="P-EAGLE: depths K drafted in one forward and "
                              "trained (the proposals per round; the export's speculative_tokens).")
    down_sample_ratio: float = setting(0.7, valid=Range(0, 1, min_open=True), help="P-EAGLE: COD sampling, depth d "
                                       "trains on about max(r^d, r_min) of the supervised positions.")
    down_sample_ratio_min: float = setting(0.2, valid=Range(0, 1, zero="no floor"), help="P-EAGLE: COD sampling's "
                                           "floor r_min of the fraction a depth keeps.")
    peagle_loss_weights: str = setting("element", choices=LOSS_WEIGHTS, help="P-EAGLE: element: every "
                                       "counted element of every depth weighs the same (SpecForge's); depth: each "
                                       "depth's mean weighs 1/K (speculators').")
    pard_token_id: int | None = setting(None, valid=Range(0, MAX_TOKENS), shown="the first embedding row past the "
                                        "tokenizer's vocabulary, else the highest id never seen in the feature set",
                                        help="P-EAGLE: the token id of the mask (pard) slots, depths 1..K-1.")


def default_layers(num_target_layers: int, options: PEagleOptions) -> list[int]:
    """EAGLE-3's (SGLang's) default, [1, L//2-1, L-4]: the same three layers, so one capture serves both."""
    from specfoundry.families.eagle3.options import default_aux_layers

    return default_aux_layers(num_target_layers)
