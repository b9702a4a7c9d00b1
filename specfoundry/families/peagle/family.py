"""The P-EAGLE family's provider (families/interface.py's interface, registered in specfoundry/families/__init__.py):
EAGLE-3's three captured layers and the final state (the teacher's input), N decoder layers that draft
K depths in one forward, COD-sampled training, vLLM's speculators export (`peagle`), one-forward chain
decoding, its gate checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specfoundry.common.target import load_tokenizer, text_config
from specfoundry.common.weights import target_embeddings, target_lm_head
from specfoundry.families.dflash.family import choose_mask_token
from specfoundry.families.interface import DraftFamily
from specfoundry.families.peagle.config import PEagleConfig, peagle_config_from_target
from specfoundry.families.peagle.export import export_draft, load_export, read_config, read_export
from specfoundry.families.peagle.loss import PEagleModule
from specfoundry.families.peagle.model import PEagleDraft
from specfoundry.families.peagle.options import PEagleOptions
from specfoundry.families.vocab import choose_draft_vocab, vocab_coverage, vocab_maps
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.lk_loss import TokenLoss


class PEagleFamily(DraftFamily):
    name = "peagle"
    config_class = PEagleConfig

    def layer_count(self, options: PEagleOptions) -> int:
        return 3

    def needs_final_state(self, options: PEagleOptions) -> bool:
        return True

    def trains_from_topk_teacher(self, options: PEagleOptions) -> bool:
        return True  # teacher_targets' distribution only (families/teacher.py batch_teacher)

    def build(self, options: PEagleOptions, fs, target_dir: Path, layers: list[int], init_from: str | None):
        vocab = fs.manifest["target"]["vocab_size"]
        if init_from:  # a P-EAGLE speculators folder, ours or another tool's
            dcfg, tensors = load_export(init_from, fs.manifest["target"].get("num_layers"))
            if (dcfg.vocab_size, dcfg.target_hidden_size) != (vocab, fs.manifest["target"]["hidden_size"]):
                raise FeatureSetError(f"--init-from {init_from} is a draft for a target of vocabulary {dcfg.vocab_size} "
                                      f"and width {dcfg.target_hidden_size}; feature set {fs.root}'s target has "
                                      f"{vocab} and {fs.manifest['target']['hidden_size']}")
            if list(dcfg.aux_layer_ids) != list(layers):
                raise FeatureSetError(f"--init-from {init_from} reads layers {list(dcfg.aux_layer_ids)}, but the run "
                                      f"reads layers {layers} of feature set {fs.root}")
            model = PEagleDraft(dcfg)
            model.load_state_dict(tensors, strict=False)
        else:
            counts = fs.token_counts()
            if options.peagle_vocab_size > counts.numel():
                raise FeatureSetError(f"--peagle-vocab-size {options.peagle_vocab_size} is larger than the target's "
                                      f"vocabulary ({counts.numel()} tokens), of which the draft's is a part")
            mask = options.pard_token_id
            if mask is None:
                mask = choose_mask_token(vocab, len(load_tokenizer(target_dir)), counts)
            elif not 0 <= mask < vocab:
                raise ValueError(f"--pard-token-id {mask} is outside the target's vocabulary (0..{vocab - 1})")
            draft_ids = choose_draft_vocab(counts, options.peagle_vocab_size)
            dcfg = peagle_config_from_target(target_dir, len(draft_ids), layers, num_hidden_layers=options.peagle_layers,
                                             num_depths=options.num_depths, mask_token_id=mask)
            model = PEagleDraft(dcfg)
            d2t, t2d = vocab_maps(draft_ids, dcfg.vocab_size)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
        model.embed_tokens.weight.data.copy_(target_embeddings(target_dir).float())
        return model, dcfg

    def vocab_coverage(self, draft, counts: torch.Tensor) -> float:
        return vocab_coverage(draft.t2d, counts)

    def module(self, draft: PEagleDraft, target_dir: Path, dtype: torch.dtype, options: PEagleOptions, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        if options.num_depths != draft.cfg.num_depths:
            raise ValueError(f"--num-depths {options.num_depths}: the draft (--init-from) was built for "
                             f"{draft.cfg.num_depths} depths")
        return PEagleModule(draft, target_lm_head(target_dir).to(dtype), num_depths=options.num_depths,
                            ratio=options.down_sample_ratio, ratio_min=options.down_sample_ratio_min, seed=seed,
                            weights=options.peagle_loss_weights, token_loss=token_loss)

    def export(self, state, draft_config: PEagleConfig, out: Path, target: dict | None, layout: str = "speculators",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        if layout not in self.layouts:  # no engine serves another layout of P-EAGLE (SGLang has no loader)
            raise ValueError(f"P-EAGLE exports the {', '.join(self.layouts)} layout only, not {layout!r}")
        return export_draft(state, draft_config, out, target=target, verifier=verifier,
                            speculative_tokens=speculative_tokens)

    def draft_module(self, cfg: PEagleConfig) -> PEagleDraft:
        return PEagleDraft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> PEagleConfig:
        return read_config(path, num_target_layers)

    def read_export(self, ref):
        return read_export(ref.where, ref.num_target_layers)

    def for_serving(self, cfg: PEagleConfig, target_config: dict) -> PEagleConfig:
        # vLLM refuses a draft shorter than its target
        max_positions = text_config(target_config).get("max_position_embeddings", 0)
        return replace(cfg, max_position_embeddings=max_positions) if cfg.max_position_embeddings < max_positions else cfg

    def decode_settings(self, cfg: PEagleConfig, *, k, tree, temperature, k_given, source):
        from specfoundry.families.peagle.decode import decode_settings

        return decode_settings(cfg, k=k, tree=tree, k_given=k_given, source=source)

    def decoder(self, draft: PEagleDraft, target, *, k, tree, compiled=False):
        if compiled:
            raise ValueError(f"--compile-draft: {self.name} drafts decode uncompiled (its round is not "
                             "compiled; EAGLE-3 and the DFlash family offer it)")
        from specfoundry.families.peagle.decode import PEagleDecoder, PEagleRunner

        return PEagleDecoder(PEagleRunner(draft), k)

    def decode_matches_training(self, draft: PEagleDraft, lm_head, ids, aux):
        from specfoundry.families.peagle.decode import decode_matches_training

        return decode_matches_training(draft, ids, aux)  # the draft's own lm_head: the target's is not read

    def gate_options(self, gate) -> dict:
        from specfoundry.families.peagle.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.peagle.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


PEAGLE = PEagleFamily()
