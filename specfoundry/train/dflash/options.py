"""sf-train settings of the DFlash family (recorded in train_config.json under `dflash`)."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.cli import setting

TEACHERS = ("hard", "soft")


@dataclass(frozen=True, kw_only=True)
class DFlashOptions:
    num_draft_layers: int = setting(5, help="DFlash: decoder layers of the draft (it reads as many target layers by "
                                    "default; --layers may give any number).")
    block_size: int = setting(16, help="DFlash: positions per block, the anchor and block_size-1 proposals.")
    num_anchors: int = setting(512, help="DFlash: anchors sampled per sample and step, among supervised positions.")
    gamma: float = setting(7.0, help="DFlash: block position k's loss is weighted exp(-(k-1)/gamma) (<= 0: "
                           "uniform).")
    mask_token_id: int | None = setting(None, shown="the first embedding row past the tokenizer's vocabulary, else "
                                        "the highest id never seen in the feature set",
                                        help="DFlash: the token id of the block's mask positions.")
    teacher: str = setting("hard", choices=TEACHERS, help="DFlash: hard: the conversation's tokens; soft: the "
                           "target's distribution from the stored final state.")

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"--block-size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"--num-anchors must be >= 1, got {self.num_anchors}")
        if self.num_draft_layers < 1:
            raise ValueError(f"--num-draft-layers must be >= 1, got {self.num_draft_layers}")
