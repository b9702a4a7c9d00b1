"""The DFlash2 family's provider (families/interface.py's interface, registered in
specfoundry/families/__init__.py with extends="dflash"): DFlash's layers, block, anchors, mask token
and slot decay (options.parent), its own convolutions, selector and selector objective
(options.own), the native DFlash2DraftModel export SGLang and vLLM serve, block decoding through
the selector's walk, its gate checks."""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.weights import target_lm_head
from specfoundry.families.dflash.family import DFlashFamily, build_block_draft
from specfoundry.families.dflash2.config import DFlash2Config, dflash2_config_from_target
from specfoundry.families.dflash2.export import export_draft, load_export, read_config
from specfoundry.families.dflash2.loss import DFlash2Module
from specfoundry.families.dflash2.model import DFlash2Draft
from specfoundry.families.folders import load_tensors
from specfoundry.kernels.lk_loss import TokenLoss


class DFlash2Family(DFlashFamily):
    name = "dflash2"
    config_class = DFlash2Config

    def layer_count(self, options) -> int:
        return options.parent.num_draft_layers

    def needs_final_state(self, options) -> bool:
        return False  # hard labels only (the module refuses --teacher soft)

    def set_progress(self, module: DFlash2Module, step: int, total_steps: int) -> None:
        module.set_progress(step, total_steps)  # the selector's weight schedule

    def build(self, options, fs, target_dir: Path, layers: list[int], init_from: str | None):
        dflash, own = options.parent, options.own
        return build_block_draft(dflash, fs, target_dir, layers, init_from, load_export, DFlash2Draft,
                                 lambda mask: dflash2_config_from_target(target_dir, layers, dflash.num_draft_layers,
                                                                         dflash.block_size, mask, own))

    def module(self, draft: DFlash2Draft, target_dir: Path, dtype: torch.dtype, options, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        if token_loss.kind != "ce":  # the catalogue offers ce only; sf-train refuses the others first
            raise ValueError(f"--token-loss {token_loss.kind}: the dflash2 family trains with ce only")
        dflash, own = options.parent, options.own
        if dflash.teacher != "hard":
            raise ValueError("DFlash2 trains on the conversation's tokens: --teacher soft is DFlash's only")
        if dflash.objective != "dflash":
            raise ValueError(f"DFlash2 weighs its slots by --gamma: --objective {dflash.objective} is DFlash's only")
        draft.candidate_selector.requires_grad_(own.selector_loss_alpha > 0)  # alpha 0: the selector frozen
        for layer in draft.layers:  # frozen: the identity they start as (DFlash's backbone, exactly)
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.requires_grad_(not own.freeze_convolutions)
        return DFlash2Module(draft, target_lm_head(target_dir).to(dtype), num_anchors=dflash.num_anchors,
                             gamma=dflash.gamma, seed=seed, selector_loss=own.selector_loss,
                             selector_loss_alpha=own.selector_loss_alpha,
                             selector_warmup_ratio=own.selector_warmup_ratio,
                             selector_ramp_ratio=own.selector_ramp_ratio,
                             selector_stop_gradient=own.selector_stop_gradient)

    def export(self, state, draft_config: DFlash2Config, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        assert layout == "sglang", layout
        return export_draft(state, draft_config, out, target=target)

    def draft_module(self, cfg: DFlash2Config) -> DFlash2Draft:
        return DFlash2Draft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> DFlash2Config:
        return read_config(path)

    def read_export(self, ref):
        return ref.config, load_tensors(ref.where / "model.safetensors")

    def decoder(self, draft: DFlash2Draft, target, *, k, tree, compiled=False):
        from specfoundry.families.dflash2.decode import DFlash2Decoder, DFlash2Runner

        return DFlash2Decoder(DFlash2Runner(draft, target.lm_head(), block_size=k + 1, compiled=compiled))

    def decode_matches_training(self, draft: DFlash2Draft, lm_head, ids, aux):
        from specfoundry.families.dflash2.decode import decode_matches_training

        return decode_matches_training(draft, lm_head, ids, aux)

    def gate_options(self, gate) -> dict:
        from specfoundry.families.dflash2.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.dflash2.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


DFLASH2 = DFlash2Family()
