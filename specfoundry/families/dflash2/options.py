"""sf-train settings of the DFlash2 family (recorded in train_config.json under `dflash2`).

DFlash2 extends DFlash: the block, anchors, layers, mask token and slot decay (--gamma) are
DFlash's options (`dflash:` group, read through Extended.parent); these are DFlash2's own: the
shape of its convolutions and selector (what SGLang's and vLLM's loaders read from
dflash_config), the selector's objective and its weight's schedule over the run."""

from __future__ import annotations

from dataclasses import dataclass

from specfoundry.common.settings import Range, Settings, setting

SELECTOR_LOSSES = ("gold", "topk")


@dataclass(frozen=True, kw_only=True)
class DFlash2Options(Settings):
    conv_kernel_size: int = setting(2, valid=Range(1, 64), help="DFlash2: taps T of the dynamic causal convolution "
                                    "around each sublayer, reaching T - 1 block positions back.")
    conv_group_size: int = setting(16, valid=Range(1, 65536), help="DFlash2: channels that share one dynamic "
                                   "kernel coefficient per tap (the draft's width must be a multiple of it).")
    freeze_convolutions: bool = setting(False, before=False, help="DFlash2: the convolutions stay the identity they start "
                                        "as, so the draft is its DFlash backbone with the selector (what the "
                                        "selector alone adds); it exports as DFlash2, which the engines serve.")
    selector_rank: int = setting(256, valid=Range(1, 65536), help="DFlash2: rank r of the candidate selector's "
                                 "codebooks [V, r] and its hidden projection [r, H].")
    selector_top_k: int = setting(16, valid=Range(1, 1024), help="DFlash2: candidates K each slot's selector "
                                  "rescores, the top K of the target's lm_head over the slot's state.")
    selector_loss: str = setting("topk", choices=SELECTOR_LOSSES, help="DFlash2: the selector's K-way cross entropy; topk: "
                                 "none where the top K miss the gold token (measured the better); gold: the gold "
                                 "token put at rank K there (docs/families.md).")
    selector_loss_alpha: float = setting(1.0, valid=Range(0, 1000, zero="the selector is frozen"),
                                         help="DFlash2: weight of the selector's cross entropy beside the slots' "
                                              "own.")
    selector_warmup_ratio: float = setting(0.0, valid=Range(0, 1, zero="no warm-up"), help="DFlash2: the selector's weight is 0 for "
                                           "this fraction of the run's optimizer steps.")
    selector_ramp_ratio: float = setting(0.0, valid=Range(0, 1, zero="no ramp"), help="DFlash2: after the "
                                         "warm-up, the selector's weight rises linearly to its full value over this "
                                         "fraction of the run's optimizer steps.")
    selector_stop_gradient: bool = setting(False, help="DFlash2: the selector's loss trains the selector only, not "
                                           "the slot logits and states it reads.")


def default_layers(num_target_layers: int, options) -> list[int]:
    """DFlash's default (one target layer per draft layer), from the parent's options."""
    from specfoundry.families.dflash.options import default_layers as dflash_layers

    return dflash_layers(num_target_layers, options.parent)
