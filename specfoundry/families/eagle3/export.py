"""Export a trained EAGLE-3 draft in the layout a serving engine loads (families/eagle3/formats.py
names the layouts and reads them back; docs/serving.md says what each engine reads).

sglang: the directory SGLang's `LlamaForCausalLMEagle3` loads, and vLLM's `Eagle3LlamaForCausalLM`
too. Written from their public loaders (SGLang python/sglang/srt/models/llama_eagle3.py, vLLM
vllm/model_executor/models/llama_eagle3.py): both map q/k/v_proj into qkv_proj and gate/up_proj
into gate_up_proj, add the "model." prefix to every name but lm_head, read d2t as offsets and
skip t2d; SGLang SILENTLY IGNORES names it does not know, hence the exact check here. The layer
ids go in twice, once per engine's convention: nested in eagle_config for SGLang (the only place
it looks) and at the top level, one higher, for vLLM (which looks there first).

speculators: vLLM's speculators format, which `vllm serve DIR` serves alone (it swaps in the
verifier named in speculators_config as the target). Written from vLLM's
transformers_utils/configs/speculators/ (base.py validates the structure, algos.py's update_eagle3
copies the top-level options over transformer_layer_config) and vllm-project/speculators'
Eagle3SpeculatorConfig. Tensors are named layers.0.*, without a prefix.

Embeddings are not exported: both engines share the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.formats import (
    LAYOUTS,
    expected_tensors,
    layout_name,
    read_eagle3,
    to_vllm_ids,
)
from specfoundry.families.folders import (
    check_tensors,
    expect_family,
    exported_tensors,
    write_export,
)

__all__ = ["expected_tensors", "export_draft", "load_export", "sglang_config", "speculators_config", "validate"]


def layer_config(cfg: Eagle3Config) -> dict:
    """The decoder layer's Llama config: the top level of the SGLang layout, the speculators
    format's transformer_layer_config."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def draft_options(cfg: Eagle3Config) -> dict:
    """What both layouts write at the top level, where SGLang (fc_norm, norm_output), vLLM (all of
    them; its speculators path copies them from there) and SpecForge read them. norm_before_residual is
    written out because vLLM's speculators path takes an absent one as true: our draft keeps the
    incoming hidden state as the residual and normalises after (model.py, Eagle3DecoderLayer)."""
    if not cfg.aux_layer_ids:
        raise ValueError("the draft's config names no target layers: pass the target, whose default layers it reads")
    return {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        # EAGLE-3.1: a norm per captured state before fc (tensors fc_norm.{i}.weight)
        "fc_norm": cfg.fc_norm,
        # EAGLE-3.1: the post-norm state fed to the next draft step. Written only when true: the
        # key means that to SGLang, vLLM and speculators (absent: false), while SpecForge's draft
        # class reads it as "norm before lm_head" (absent: true), so `norm_output: false` would
        # make SpecForge drop the final norm; absent, all four build standard EAGLE-3.
        **({"norm_output": True} if cfg.norm_output else {}),
        # vLLM's convention (the output of layer i is id i + 1); vLLM reads this field first
        "eagle_aux_hidden_state_layer_ids": to_vllm_ids(cfg.aux_layer_ids),
    }


def sglang_config(cfg: Eagle3Config) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_config(cfg),
        **draft_options(cfg),
        # SGLang reads the ids only here, as the 0-based layers whose OUTPUT feeds the draft (it
        # adds 1 to find the layer whose input it captures): ours exactly
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
    }


SPECULATIVE_TOKENS = 3
"""A speculators EAGLE-3 export's proposals per round (a chain) unless sf-export -k gives another."""


def speculators_config(cfg: Eagle3Config, verifier: dict, speculative_tokens: int) -> dict:
    """`verifier`: {name_or_path: what vLLM loads as the target, architectures: the target's}.
    No top-level model_type: vLLM takes a config without one but with speculators_config as its
    "speculators" type; "llama" there would load it as a plain Llama and lose the draft."""
    if cfg.num_aux != 3:
        raise ValueError(f"vLLM's speculators path builds fc for 3 captured layers; this draft reads {cfg.num_aux}")
    return {
        "architectures": ["Eagle3DraftModel"],  # speculators' class; vLLM picks its own from model_type
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier["name_or_path"],
                         "architectures": list(verifier.get("architectures") or [])},
        },
        "transformer_layer_config": layer_config(cfg),
        **draft_options(cfg),
    }


def validate(tensors: dict[str, torch.Tensor], cfg: Eagle3Config) -> None:
    """Exactly SGLang's names (ours), shapes and integer dtypes."""
    check_tensors(tensors, expected_tensors(cfg), "SGLang", "EAGLE-3")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: Eagle3Config, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None, layout: str = "sglang",
                 verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
    """Write the draft in `layout` (sglang or speculators; the latter names its `verifier` and
    proposes `speculative_tokens` per round, default SPECULATIVE_TOKENS).
    `target`: the identity of the target the draft was trained for (from the feature set's
    manifest), kept beside it so a later eval can check it."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown export layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    out = Path(out_dir)
    tensors = exported_tensors(state_dict, dtype, skip=("embed_tokens.", "rotary."))  # the engines use the target's embeddings
    validate(tensors, cfg)
    if layout == "speculators":
        if verifier is None:
            raise ValueError("the speculators format names its verifier (the target vLLM loads)")
        config = speculators_config(cfg, verifier, speculative_tokens or SPECULATIVE_TOKENS)
    else:
        config = sglang_config(cfg)
    return write_export(out, {layout_name(n, layout): t for n, t in tensors.items()}, config, cfg, target)


def load_export(path: str | Path, num_target_layers: int | None = None) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """An EAGLE-3 directory in either layout, ours or another tool's (formats.read_eagle3); a draft
    of another family is refused, naming it."""
    expect_family(Path(path), "eagle3")
    return read_eagle3(path, num_target_layers)
