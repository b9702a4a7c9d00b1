"""Export a P-EAGLE draft in vLLM's speculators format (`speculators_model_type: peagle`), the one
layout any engine serves P-EAGLE from: `vllm serve DIR` (or --speculative-config with this folder)
maps it to EAGLE-3 with parallel drafting.

Written from the public loaders:
- vLLM transformers_utils/configs/speculators/base.py: speculators_config.proposal_methods[0]
  .speculative_tokens (required) and .verifier.name_or_path (required), speculators_model_type,
  transformer_layer_config (a mapping, required); build_vllm_speculative_config turns "peagle" into
  {"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": k};
- vLLM configs/speculators/algos.py update_peagle: architectures PeagleLlamaForCausalLM (or
  PeagleQwen3ForCausalLM for a qwen3 transformer_layer_config.model_type), draft_vocab_size,
  target_hidden_size, norm_before_residual (default false), norm_before_fc (default false),
  pard_token = mask_token_id (REQUIRED: a KeyError without it), eagle_aux_hidden_state_layer_ids
  (vLLM's numbering: our id + 1);
- vLLM model_executor/models/llama_eagle3.py (the registry maps PEagleDraftModel and
  PeagleLlamaForCausalLM to Eagle3LlamaForCausalLM): num_hidden_layers layers, layer 0's q/k/v
  2H wide with hidden_norm, the later ones H wide (a hidden_norm there would be unused); fc
  [H, 3 Ht]; q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj, "model." prefixed to
  every name but lm_head; d2t read as offsets, t2d skipped; mask_hidden copied (view(1, -1)) into
  a [1, 3 H] buffer and REQUIRED under parallel drafting ("mask_hidden not found in weights");
  embed_tokens optional (the target's otherwise: ours is the target's, so not written). Its
  loader ignores a name it does not know, hence the exact check here;
- speculators src/speculators/models/peagle/config.py (PEagleSpeculatorConfig: Eagle3's fields plus
  mask_token_id; speculators_model_type "peagle").

config.json
    architectures                      ["PEagleDraftModel"] (speculators' class; vLLM sets its own)
    speculators_model_type             "peagle"
    speculators_config                 {algorithm: peagle, default_proposal_method: greedy,
                                        proposal_methods: [{proposal_type: greedy, speculative_tokens: k,
                                        verifier_accept_k: 1, accept_tolerance: 0.0}],
                                        verifier: {name_or_path, architectures}}
    transformer_layer_config           a Llama config, num_hidden_layers = N, vocab_size = V
    draft_vocab_size, target_hidden_size, norm_before_residual: false, norm_before_fc: false
    mask_token_id                      the mask (pard) token
    eagle_aux_hidden_state_layer_ids   vLLM's numbering (ours + 1)
    num_depths                         K trained (ours; speculators' configs carry it for training)
tensors (no prefix)
    fc.weight [H, 3 Ht]   mask_hidden [1, 3 Ht]   norm.weight [H]   lm_head.weight [Vd, H]
    d2t [Vd] int64        t2d [V] bool
    layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [H]
    layers.0.self_attn.{q,k,v}_proj.weight [nh hd | nkv hd, 2H], layers.i>0 the same [., H]
    layers.i.self_attn.o_proj.weight [H, nh hd]; layers.i.mlp.{gate,up}_proj [I, H], down_proj [H, I]
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.target import rope_settings
from specfoundry.families.eagle3.export import layer_config
from specfoundry.families.eagle3.formats import (
    NOT_THE_DRAFTS,
    from_vllm_ids,
    read_tensors,
    to_vllm_ids,
    vocab_maps_of,
)
from specfoundry.families.eagle3.options import default_aux_layers
from specfoundry.families.folders import (
    DraftLoadError,
    check_tensors,
    expect_family,
    exported_tensors,
    read_config_json,
    write_export,
)
from specfoundry.families.peagle.config import PEagleConfig

ARCHITECTURE = "PEagleDraftModel"
def expected_tensors(cfg: PEagleConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor vLLM's loader reads for a P-EAGLE draft, with its shape (dtype None: the float dtype)."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    aux = cfg.num_aux * cfg.target_hidden_size
    spec = {"fc.weight": ((h, aux), None), "mask_hidden": ((1, aux), None), "norm.weight": ((h,), None),
            "lm_head.weight": ((cfg.draft_vocab_size, h), None), "d2t": ((cfg.draft_vocab_size,), torch.int64),
            "t2d": ((cfg.vocab_size,), torch.bool)}
    for n in range(cfg.num_hidden_layers):
        width = 2 * h if n == 0 else h
        p = f"layers.{n}."
        spec.update({
            p + "input_layernorm.weight": ((h,), None),
            p + "post_attention_layernorm.weight": ((h,), None),
            p + "self_attn.q_proj.weight": ((cfg.num_attention_heads * hd, width), None),
            p + "self_attn.k_proj.weight": ((cfg.num_key_value_heads * hd, width), None),
            p + "self_attn.v_proj.weight": ((cfg.num_key_value_heads * hd, width), None),
            p + "self_attn.o_proj.weight": ((h, cfg.num_attention_heads * hd), None),
            p + "mlp.gate_proj.weight": ((i, h), None),
            p + "mlp.up_proj.weight": ((i, h), None),
            p + "mlp.down_proj.weight": ((h, i), None),
        })
        if n == 0:
            spec[p + "hidden_norm.weight"] = ((h,), None)
    return spec


def validate(tensors: dict[str, torch.Tensor], cfg: PEagleConfig) -> None:
    check_tensors(tensors, expected_tensors(cfg), "vLLM", "P-EAGLE")


def speculators_config(cfg: PEagleConfig, verifier: dict, speculative_tokens: int) -> dict:
    if not cfg.aux_layer_ids:
        raise ValueError("the draft's config names no target layers: pass the target, whose default layers it reads")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError(f"vLLM holds mask_hidden in a [1, 3 x hidden_size] buffer: a draft {cfg.hidden_size} wide "
                         f"over a target {cfg.target_hidden_size} wide cannot be loaded")
    if not 1 <= speculative_tokens <= cfg.num_depths:
        raise ValueError(f"speculative tokens {speculative_tokens}: the draft was trained for {cfg.num_depths} depths")
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "peagle",
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.get("name_or_path"),
                         "architectures": list(verifier.get("architectures") or [])},
        },
        "transformer_layer_config": {**layer_config(cfg), "num_hidden_layers": cfg.num_hidden_layers},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,  # layer 0 keeps the incoming hidden as its residual
        "norm_before_fc": False,
        "mask_token_id": cfg.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": to_vllm_ids(cfg.aux_layer_ids),
        "num_depths": cfg.num_depths,
    }


def export_draft(state_dict: dict[str, torch.Tensor], cfg: PEagleConfig, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None, verifier: dict | None = None,
                 speculative_tokens: int | None = None) -> Path:
    """Write the speculators directory. verifier: {name_or_path, architectures} (default: the
    target's recorded path); speculative_tokens: the proposals per round (default: the trained K)."""
    out = Path(out_dir)
    tensors = exported_tensors(state_dict, dtype, skip=("embed_tokens.", "rope."))  # the engines use the target's embeddings
    validate(tensors, cfg)
    if verifier is None:
        verifier = {"name_or_path": (target or {}).get("path") or (target or {}).get("name"), "architectures": []}
    config = speculators_config(cfg, verifier, speculative_tokens or cfg.num_depths)
    return write_export(out, tensors, config, cfg, target)


def config_from_speculators(config: dict, num_target_layers: int | None) -> PEagleConfig:
    """A PEagleConfig from a P-EAGLE config.json, read as vLLM reads it (ValueError for what vLLM
    refuses or this draft does not have; KeyError naming a missing field)."""
    if config.get("speculators_model_type") != "peagle":
        raise ValueError(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'peagle'")
    c = config["transformer_layer_config"]
    if not isinstance(c, dict):
        raise ValueError("transformer_layer_config is not a mapping")
    if c.get("model_type", "llama") != "llama":
        raise ValueError(f"transformer_layer_config.model_type {c['model_type']!r}: specfoundry's P-EAGLE layers are "
                         "Llama's")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if config.get(flag):
            raise ValueError(f"{flag} is true: specfoundry's P-EAGLE draft does not have it")
    if "mask_token_id" not in config:
        raise KeyError("mask_token_id")  # vLLM's update_peagle reads it unconditionally
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if ids:
        layers = from_vllm_ids(ids, "config.json")
    else:  # vLLM's default then: the target's, as EAGLE-3's
        layers = default_aux_layers(num_target_layers) if num_target_layers else []
    method = config["speculators_config"]["proposal_methods"][0]
    heads = c["num_attention_heads"]
    theta, scaling = rope_settings(c)
    return PEagleConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 8192), vocab_size=c["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or c["vocab_size"],
        target_hidden_size=config.get("target_hidden_size") or c["hidden_size"], aux_layer_ids=tuple(layers),
        hidden_act=c.get("hidden_act", "silu"), num_hidden_layers=c.get("num_hidden_layers", 1),
        num_depths=config.get("num_depths") or method["speculative_tokens"], mask_token_id=config["mask_token_id"])


def read_config(path: str | Path, num_target_layers: int | None = None) -> PEagleConfig:
    path = Path(path)
    try:
        return config_from_speculators(read_config_json(path), num_target_layers)
    except KeyError as e:
        raise DraftLoadError(f"draft {path / 'config.json'} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, IndexError) as e:
        if isinstance(e, DraftLoadError):
            raise
        raise DraftLoadError(f"draft {path / 'config.json'}: {e}") from None


def read_export(path: str | Path, num_target_layers: int | None = None) -> tuple[PEagleConfig, dict]:
    """(config, tensors under the module's names, checked against vLLM's names) of a P-EAGLE folder."""
    path = Path(path)
    cfg = read_config(path, num_target_layers)
    # the target's embedding and speculators' training-only copies of the target's head are not the draft's
    tensors = {k.removeprefix("model."): v for k, v in read_tensors(path).items()
               if k.removeprefix("model.") not in NOT_THE_DRAFTS}
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, -1)  # speculators' [1, 1, 3 Ht] too
    vocab_maps_of(tensors, cfg, str(path))
    try:
        validate(tensors, cfg)
    except ValueError as e:
        raise DraftLoadError(f"{path}: {e}") from None
    return cfg, tensors


def load_export(path: str | Path, num_target_layers: int | None = None) -> tuple[PEagleConfig, dict]:
    expect_family(Path(path), "peagle")
    return read_export(path, num_target_layers)
