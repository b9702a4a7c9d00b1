"""The EAGLE-3 family's provider (families/interface.py's interface, registered in specfoundry/families/__init__.py):
three captured layers and the final state (the teacher's input), one decoder layer, Training-Time
Test, exports for SGLang and vLLM, chain and tree decoding, its gate checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specfoundry.common.target import text_config
from specfoundry.common.weights import target_embeddings, target_lm_head
from specfoundry.families.eagle3.config import Eagle3Config, draft_config_from_target
from specfoundry.families.eagle3.export import export_draft, load_export
from specfoundry.families.eagle3.formats import read_eagle3, read_eagle3_config
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.eagle3.options import Eagle3Options
from specfoundry.families.eagle3.ttt import TTTModule
from specfoundry.families.interface import DraftFamily
from specfoundry.families.vocab import choose_draft_vocab, vocab_coverage, vocab_maps
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.lk_loss import TokenLoss


class Eagle3Family(DraftFamily):
    name = "eagle3"
    compiles_draft = True
    serves_engine_tree = True
    config_class = Eagle3Config

    def layer_count(self, options: Eagle3Options) -> int:
        return 3

    def needs_final_state(self, options: Eagle3Options) -> bool:
        return True

    def trains_from_topk_teacher(self, options: Eagle3Options) -> bool:
        return True  # teacher_targets' distribution only (families/teacher.py batch_teacher)

    def build(self, options: Eagle3Options, fs, target_dir: Path, layers: list[int], init_from: str | None):
        if init_from:  # an EAGLE-3 directory in either layout, ours or another tool's
            dcfg, tensors = load_export(init_from, fs.manifest.get("target", {}).get("num_layers"))
            if (dcfg.vocab_size, dcfg.target_hidden_size) != (fs.manifest["target"]["vocab_size"],
                                                               fs.manifest["target"]["hidden_size"]):
                raise FeatureSetError(f"--init-from {init_from} is a draft for a target of vocabulary {dcfg.vocab_size} "
                                      f"and width {dcfg.target_hidden_size}; feature set {fs.root}'s target has "
                                      f"{fs.manifest['target']['vocab_size']} and {fs.manifest['target']['hidden_size']}")
            if list(dcfg.aux_layer_ids) != list(layers):
                raise FeatureSetError(f"--init-from {init_from} reads layers {list(dcfg.aux_layer_ids)}, but the run "
                                      f"reads layers {layers} of feature set {fs.root}")
            model = Eagle3Draft(dcfg)
            model.load_state_dict(tensors, strict=False)
        else:
            counts = fs.token_counts()
            if options.draft_vocab_size > counts.numel():  # before, it was cut to the vocabulary unsaid
                raise FeatureSetError(f"--draft-vocab-size {options.draft_vocab_size} is larger than the target's "
                                      f"vocabulary ({counts.numel()} tokens), of which the draft's is a part")
            draft_ids = choose_draft_vocab(counts, options.draft_vocab_size)
            dcfg = draft_config_from_target(target_dir, len(draft_ids), layers,
                                            {"fc_norm": options.fc_norm, "norm_output": options.norm_output})
            model = Eagle3Draft(dcfg)
            d2t, t2d = vocab_maps(draft_ids, dcfg.vocab_size)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
        model.embed_tokens.weight.data.copy_(target_embeddings(target_dir).float())
        return model, dcfg

    def vocab_coverage(self, draft, counts: torch.Tensor) -> float:
        return vocab_coverage(draft.t2d, counts)

    def module(self, draft: Eagle3Draft, target_dir: Path, dtype: torch.dtype, options: Eagle3Options, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        return TTTModule(draft, target_lm_head(target_dir).to(dtype), ttt_length=options.ttt_length,
                         decay=options.loss_decay, token_loss=token_loss)


    def export(self, state, draft_config: Eagle3Config, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        return export_draft(state, draft_config, out, target=target, layout=layout, verifier=verifier,
                            speculative_tokens=speculative_tokens)

    def draft_module(self, cfg: Eagle3Config) -> Eagle3Draft:
        return Eagle3Draft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> Eagle3Config:
        return read_eagle3_config(path, num_target_layers)[0]

    def read_export(self, ref):
        return read_eagle3(ref.where, ref.num_target_layers)  # the layout's names and maps, checked

    def for_serving(self, cfg: Eagle3Config, target_config: dict) -> Eagle3Config:
        # vLLM refuses a draft shorter than its target
        max_positions = text_config(target_config).get("max_position_embeddings", 0)
        return replace(cfg, max_position_embeddings=max_positions) if cfg.max_position_embeddings < max_positions else cfg

    def decode_settings(self, cfg: Eagle3Config, *, k, tree, temperature, k_given, source):
        from specfoundry.families.eagle3.decode import decode_settings

        return decode_settings(k, tree)

    def decoder(self, draft: Eagle3Draft, target, *, k, tree, compiled=False):
        from specfoundry.families.eagle3.chain import DraftRunner
        from specfoundry.families.eagle3.decode import Eagle3Decoder

        return Eagle3Decoder(DraftRunner(draft, compiled=compiled), k, tree)

    def decode_matches_training(self, draft: Eagle3Draft, lm_head, ids, aux):
        from specfoundry.families.eagle3.decode import decode_matches_training

        return decode_matches_training(draft, ids, aux)  # the draft's own lm_head: the target's is not read

    def gate_options(self, gate) -> dict:
        from specfoundry.families.eagle3.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.eagle3.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


EAGLE3 = Eagle3Family()
