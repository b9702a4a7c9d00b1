"""The EAGLE-3 family on the family interface (train/family.py): three captured layers and the
final state (the teacher's input), one decoder layer, Training-Time Test, exports for SGLang and vLLM."""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.taps import default_aux_layers
from specfoundry.common.weights import target_embeddings, target_lm_head
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.train.eagle3.config import Eagle3Config, Eagle3Options, draft_config_from_target
from specfoundry.train.eagle3.export import export_draft, load_export
from specfoundry.train.eagle3.model import Eagle3Draft
from specfoundry.train.eagle3.ttt import TTTModule
from specfoundry.train.family import DraftFamily
from specfoundry.train.vocab import choose_draft_vocab, vocab_maps


class Eagle3Family(DraftFamily):
    name = "eagle3"
    options_field = "eagle3"

    def default_layers(self, num_target_layers: int, options: Eagle3Options) -> list[int]:
        return default_aux_layers(num_target_layers)

    def layer_count(self, options: Eagle3Options) -> int:
        return 3

    def needs_final_state(self, options: Eagle3Options) -> bool:
        return True

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

    def module(self, draft: Eagle3Draft, target_dir: Path, dtype: torch.dtype, options: Eagle3Options, seed: int):
        return TTTModule(draft, target_lm_head(target_dir).to(dtype), ttt_length=options.ttt_length,
                         decay=options.loss_decay)

    layouts = ("sglang", "speculators")

    def export(self, state, draft_config: Eagle3Config, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int = 3) -> Path:
        return export_draft(state, draft_config, out, target=target, layout=layout, verifier=verifier,
                            speculative_tokens=speculative_tokens)

    def config_from_dict(self, d: dict) -> Eagle3Config:
        return Eagle3Config.from_dict(d)


EAGLE3 = Eagle3Family()
