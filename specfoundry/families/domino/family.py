"""The Domino family's provider (families/interface.py's interface, registered in specfoundry/families/__init__.py
with extends="dflash"): DFlash's layers, block, anchors and mask token (options.parent), its own
head (options.own), the curriculum loss, SGLang's DFlash export with the Domino fields, block
decoding with the sequential GRU, its gate checks."""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.weights import target_lm_head
from specfoundry.families.dflash.family import DFlashFamily, build_block_draft
from specfoundry.families.domino.config import DominoConfig, domino_config_from_target
from specfoundry.families.domino.export import export_draft, load_export, read_config
from specfoundry.families.domino.loss import DominoModule
from specfoundry.families.domino.model import DominoDraft
from specfoundry.families.folders import load_tensors
from specfoundry.kernels.lk_loss import TokenLoss


class DominoFamily(DFlashFamily):
    name = "domino"
    config_class = DominoConfig

    def layer_count(self, options) -> int:
        return options.parent.num_draft_layers

    def needs_final_state(self, options) -> bool:
        return False  # hard labels only (the module refuses --teacher soft)

    def set_progress(self, module: DominoModule, step: int, total_steps: int) -> None:
        module.set_progress(step, total_steps)  # the base-anchored curriculum's weight

    def build(self, options, fs, target_dir: Path, layers: list[int], init_from: str | None):
        dflash, own = options.parent, options.own
        return build_block_draft(dflash, fs, target_dir, layers, init_from, load_export, DominoDraft,
                                 lambda mask: domino_config_from_target(target_dir, layers, dflash.num_draft_layers,
                                                                        dflash.block_size, mask, own.gru_hidden_dim, own.correction_dim))

    def module(self, draft: DominoDraft, target_dir: Path, dtype: torch.dtype, options, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        if token_loss.kind != "ce":  # the catalogue offers ce only; sf-train refuses the others first
            raise ValueError(f"--token-loss {token_loss.kind}: the domino family trains with ce only")
        dflash, own = options.parent, options.own
        if dflash.teacher != "hard":
            raise ValueError("Domino trains on the conversation's tokens: --teacher soft is DFlash's only")
        if dflash.objective != "dflash":
            raise ValueError(f"Domino trains its own curriculum loss: --objective {dflash.objective} is DFlash's only")
        return DominoModule(draft, target_lm_head(target_dir).to(dtype), num_anchors=dflash.num_anchors,
                            gamma=dflash.gamma, seed=seed, base_weight_start=own.base_weight_start,
                            base_weight_end=own.base_weight_end, base_decay_fraction=own.base_decay_fraction)

    def export(self, state, draft_config: DominoConfig, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        assert layout == "sglang", layout
        return export_draft(state, draft_config, out, target=target)

    def draft_module(self, cfg: DominoConfig) -> DominoDraft:
        return DominoDraft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> DominoConfig:
        return read_config(path)

    def read_export(self, ref):
        return ref.config, load_tensors(ref.where / "model.safetensors")

    def decoder(self, draft: DominoDraft, target, *, k, tree, compiled=False):
        from specfoundry.families.dflash.decode import BlockDecoder
        from specfoundry.families.domino.decode import DominoRunner

        return BlockDecoder(DominoRunner(draft, target.lm_head(), block_size=k + 1, compiled=compiled))

    def decode_matches_training(self, draft: DominoDraft, lm_head, ids, aux):
        from specfoundry.families.domino.decode import decode_matches_training

        return decode_matches_training(draft, lm_head, ids, aux)

    def gate_options(self, gate) -> dict:
        from specfoundry.families.domino.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.domino.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


DOMINO = DominoFamily()
