"""The DSpark family's provider (families/interface.py's interface, registered in specfoundry/families/__init__.py
with extends="dflash"): DFlash's layers, block, anchors, mask token and slot decay
(options.parent), its own heads and loss weights (options.own), the target's final state as the
L1 teacher, SGLang's DSpark export, block decoding with the sequential Markov bias, its gate checks."""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.weights import target_lm_head
from specfoundry.families.dflash.family import DFlashFamily, build_block_draft
from specfoundry.families.dspark.config import DSparkConfig, dspark_config_from_target
from specfoundry.families.dspark.export import export_draft, load_export, read_config
from specfoundry.families.dspark.loss import DSparkModule
from specfoundry.families.dspark.model import DSparkDraft
from specfoundry.families.folders import load_tensors
from specfoundry.kernels.lk_loss import TokenLoss


class DSparkFamily(DFlashFamily):
    name = "dspark"
    config_class = DSparkConfig

    def layer_count(self, options) -> int:
        return options.parent.num_draft_layers

    def needs_final_state(self, options) -> bool:
        return True  # the L1 term's teacher and the confidence head's target

    def trains_from_topk_teacher(self, options) -> bool:
        return False  # its L1 term and confidence head read the states themselves

    def final_state_use(self, options) -> str:
        return "its L1 term and confidence head compare its states with the target's"

    def build(self, options, fs, target_dir: Path, layers: list[int], init_from: str | None):
        dflash, own = options.parent, options.own
        return build_block_draft(dflash, fs, target_dir, layers, init_from, load_export, DSparkDraft,
                                 lambda mask: dspark_config_from_target(target_dir, layers, dflash.num_draft_layers,
                                                                        dflash.block_size, mask, own.markov_rank, own.confidence_with_markov))

    def module(self, draft: DSparkDraft, target_dir: Path, dtype: torch.dtype, options, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        if token_loss.kind != "ce":  # the catalogue offers ce only; sf-train refuses the others first
            raise ValueError(f"--token-loss {token_loss.kind}: the dspark family trains with ce only")
        dflash, own = options.parent, options.own
        if dflash.teacher != "hard":
            raise ValueError("DSpark's teacher is its own (cross entropy on the tokens, L1 to the target's final-state "
                             "distribution): --teacher soft is DFlash's only")
        if dflash.objective != "dflash":
            raise ValueError(f"DSpark trains its own three-term loss: --objective {dflash.objective} is DFlash's only")
        return DSparkModule(draft, target_lm_head(target_dir).to(dtype), num_anchors=dflash.num_anchors,
                            gamma=dflash.gamma, seed=seed, ce_weight=own.ce_weight, l1_weight=own.l1_weight,
                            confidence_weight=own.confidence_weight)

    def export(self, state, draft_config: DSparkConfig, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        assert layout == "sglang", layout
        return export_draft(state, draft_config, out, target=target)

    def draft_module(self, cfg: DSparkConfig) -> DSparkDraft:
        return DSparkDraft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> DSparkConfig:
        return read_config(path)

    def read_export(self, ref):
        return ref.config, load_tensors(ref.where / "model.safetensors")

    def decode_settings(self, cfg: DSparkConfig, *, k, tree, temperature, k_given, source):
        from specfoundry.families.dspark.decode import decode_settings

        return decode_settings(cfg, k=k, tree=tree, k_given=k_given, source=source)

    def decoder(self, draft: DSparkDraft, target, *, k, tree, compiled=False):
        from specfoundry.families.dflash.decode import BlockDecoder
        from specfoundry.families.dspark.decode import DSparkRunner

        return BlockDecoder(DSparkRunner(draft, target.lm_head(), block_size=k, compiled=compiled))

    def decode_matches_training(self, draft: DSparkDraft, lm_head, ids, aux):
        from specfoundry.families.dspark.decode import decode_matches_training

        return decode_matches_training(draft, lm_head, ids, aux)

    def gate_options(self, gate) -> dict:
        from specfoundry.families.dspark.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.dspark.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


DSPARK = DSparkFamily()
