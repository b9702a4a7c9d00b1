"""The DFlash family's provider (families/interface.py's interface, registered in specfoundry/families/__init__.py):
K captured layers (one per draft layer by default), no final state unless the soft teacher reads
it, a stack of decoder layers on the target's frozen embedding and lm_head, trained on sampled
anchors, SGLang's DFlash export, block decoding, its gate checks."""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.target import load_tokenizer
from specfoundry.common.weights import target_embeddings, target_lm_head
from specfoundry.families.dflash.config import DFlashConfig, dflash_config_from_target
from specfoundry.families.dflash.export import export_draft, load_export, read_config
from specfoundry.families.dflash.loss import DFlashModule, lk_refusal
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.folders import load_tensors
from specfoundry.families.interface import DraftFamily
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.kernels.lk_loss import TokenLoss


def choose_mask_token(vocab_size: int, tokenizer_size: int, counts: torch.Tensor) -> int:
    """The block's mask token: an embedding row no text uses. The first row past the tokenizer's
    vocabulary where the embedding has spare rows (Qwen3: 151669 of 151936, as public DFlash
    drafts use); else the highest id never seen in the feature set's loss-masked tokens."""
    if vocab_size > tokenizer_size:
        return tokenizer_size
    unseen = (counts[:vocab_size] == 0).nonzero().flatten()
    if not len(unseen):
        raise FeatureSetError("every token id occurs in the feature set: pass --mask-token-id")
    return int(unseen[-1])


def build_block_draft(dflash: DFlashOptions, fs, target_dir: Path, layers: list[int], init_from: str | None,
                      load_export, draft_class, make_config):
    """(draft, config) of a family on DFlash's backbone (DFlash, Domino, DSpark, DFlash2): read back with
    the family's `load_export` from --init-from, whose layers must be the run's, or a fresh
    `make_config(mask token)`, the mask token chosen for the target unless given (and then checked),
    its final norm at --final-norm-init; the target's embeddings copied in either way."""
    if init_from:
        dcfg, tensors = load_export(init_from)
        if list(dcfg.target_layer_ids) != list(layers):
            raise FeatureSetError(f"--init-from {init_from} reads layers {list(dcfg.target_layer_ids)}, but the "
                                  f"run reads layers {layers} of feature set {fs.root}")
    else:
        vocab = fs.manifest["target"]["vocab_size"]
        mask = dflash.mask_token_id
        if mask is None:
            mask = choose_mask_token(vocab, len(load_tokenizer(target_dir)), fs.token_counts())
        elif not 0 <= mask < vocab:
            raise ValueError(f"--mask-token-id {mask} is outside the target's vocabulary (0..{vocab - 1})")
        dcfg, tensors = make_config(mask), None
    model = draft_class(dcfg)
    if tensors is not None:
        model.load_state_dict(tensors, strict=False)
    else:
        model.norm.weight.data.fill_(dflash.final_norm_init)
    model.embed_tokens.weight.data.copy_(target_embeddings(target_dir).float())
    return model, dcfg


class DFlashFamily(DraftFamily):
    name = "dflash"
    compiles_draft = True
    config_class = DFlashConfig
    any_layer_count = True

    def layer_count(self, options: DFlashOptions) -> int:
        return options.num_draft_layers

    def needs_final_state(self, options: DFlashOptions) -> bool:
        return options.teacher == "soft"

    def trains_from_topk_teacher(self, options: DFlashOptions) -> bool:
        return options.teacher == "soft"  # the teacher's distribution is all the soft loss reads of it

    def final_state_use(self, options: DFlashOptions) -> str:
        return "--teacher soft's chunked loss takes the target's logits from it; --teacher hard reads no final state"

    def build(self, options: DFlashOptions, fs, target_dir: Path, layers: list[int], init_from: str | None):
        return build_block_draft(options, fs, target_dir, layers, init_from, load_export, DFlashDraft,
                                 lambda mask: dflash_config_from_target(target_dir, layers, options.num_draft_layers,
                                                                        options.block_size, mask))

    def module(self, draft: DFlashDraft, target_dir: Path, dtype: torch.dtype, options: DFlashOptions, seed: int,
               token_loss: TokenLoss = TokenLoss()):
        why = lk_refusal(token_loss.kind, options.teacher, draft.plain_head) if token_loss.kind != "ce" else None
        if why:  # before any training
            raise ValueError(why)
        return DFlashModule(draft, target_lm_head(target_dir).to(dtype), num_anchors=options.num_anchors,
                            gamma=options.gamma, teacher=options.teacher, seed=seed, objective=options.objective,
                            dpace_alpha=options.dpace_alpha, token_loss=token_loss)

    def export(self, state, draft_config: DFlashConfig, out: Path, target: dict | None, layout: str = "sglang",
               verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        assert layout == "sglang", layout  # sf-export offers only the family's layouts
        return export_draft(state, draft_config, out, target=target)

    def draft_module(self, cfg: DFlashConfig) -> DFlashDraft:
        return DFlashDraft(cfg)

    def read_config(self, path: Path, num_target_layers: int | None = None) -> DFlashConfig:
        return read_config(path)  # the layers are always named (dflash_config.target_layer_ids)

    def read_export(self, ref):
        return ref.config, load_tensors(ref.where / "model.safetensors")

    def decode_settings(self, cfg: DFlashConfig, *, k, tree, temperature, k_given, source):
        from specfoundry.families.dflash.decode import decode_settings

        return decode_settings(cfg, k=k, tree=tree, k_given=k_given, source=source)

    def decoder(self, draft: DFlashDraft, target, *, k, tree, compiled=False):
        from specfoundry.families.dflash.block import BlockDraftRunner
        from specfoundry.families.dflash.decode import DFlashDecoder

        # the logits read the target's lm_head
        return DFlashDecoder(BlockDraftRunner(draft, target.lm_head(), block_size=k + 1, compiled=compiled))

    def decode_matches_training(self, draft: DFlashDraft, lm_head, ids, aux):
        from specfoundry.families.dflash.decode import decode_matches_training

        return decode_matches_training(draft, lm_head, ids, aux)

    def gate_options(self, gate) -> dict:
        from specfoundry.families.dflash.gate import gate_options

        return gate_options(gate)

    def gate_checks(self, gate, export, fs, sample, target) -> list:
        from specfoundry.families.dflash.gate import gate_checks

        return gate_checks(gate, export, fs, sample, target)


DFLASH = DFlashFamily()
