"""Export a DFlash draft as the directory SGLang serves with `--speculative-algorithm DFLASH`.

The spec below was written from SGLang's public DFlash code (python/sglang/srt/models/dflash.py,
speculative/dflash_utils.py and dflash_worker.py):
- config.json is read through transformers' AutoConfig, so `model_type` is a registered type
  ("qwen3", as every public DFlash draft) and `architectures` is ["DFlashDraftModel"];
  `block_size` and `num_target_layers` sit at the top level, `dflash_config` holds
  `target_layer_ids` (id i: the output of target layer i; SGLang taps "before layer i+1" and
  concatenates in layer order, so the ids are ascending) and `mask_token_id`;
  `layer_types` "full_attention" is non-causal (the block is bidirectional), "sliding_attention"
  causal and windowed.
- tensors: fc.weight [H, K*H], hidden_norm.weight, norm.weight and per layer the Qwen3 names
  (q/k/v/o_proj, q_norm/k_norm, gate/up/down_proj, input/post_attention_layernorm). The draft has
  no embedding and no lm_head: the target's are used. The loader SILENTLY IGNORES unknown names
  and never reports a missing one (the parameter keeps its initial value), hence the exact check.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.target import rope_settings
from specfoundry.families.dflash.config import DFlashConfig
from specfoundry.families.folders import (
    DraftLoadError,
    check_tensors,
    expect_family,
    exported_tensors,
    load_tensors,
    read_config_json,
    write_export,
)

ARCHITECTURE = "DFlashDraftModel"


def expected_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name SGLang's DFlash loader fills, with its shape."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    spec = {"fc.weight": (h, len(cfg.target_layer_ids) * cfg.target_hidden_size), "hidden_norm.weight": (h,),
            "norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        spec.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return spec


def layer_types(cfg: DFlashConfig) -> list[str]:
    return list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers


def sglang_config(cfg: DFlashConfig, num_target_layers: int | None) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        # written out: left to transformers, Qwen3Config would derive them from use_sliding_window
        "layer_types": layer_types(cfg),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": "bfloat16",
        "block_size": cfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
    }


def validate(tensors: dict[str, torch.Tensor], cfg: DFlashConfig) -> None:
    """Exactly the names and shapes SGLang's DFlash loader fills (the config itself already holds
    ascending, distinct layer ids)."""
    check_tensors(tensors, {name: (shape, None) for name, shape in expected_tensors(cfg).items()}, "SGLang", "DFlash")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: DFlashConfig, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> Path:
    """Write the SGLang directory; `target`: the identity of the target the draft was trained for,
    kept beside it (its num_layers is also SGLang's num_target_layers)."""
    return write_block_export(state_dict, cfg, out_dir, dtype, target, validate, sglang_config)


def write_block_export(state_dict: dict[str, torch.Tensor], cfg, out_dir: str | Path, dtype: torch.dtype,
                       target: dict | None, validate, sglang_config) -> Path:
    """The SGLang directory of a draft on DFlash's backbone (DFlash, Domino, DSpark, DFlash2): its tensors but
    the target's embedding, checked by the family's `validate`, the family's `sglang_config`
    (cfg, num_target_layers) as config.json, our config, and the target's identity when given."""
    tensors = exported_tensors(state_dict, dtype, skip=("embed_tokens.", "rotary."))  # the target's embedding; RoPE has no weights
    validate(tensors, cfg)
    return write_export(Path(out_dir), tensors, sglang_config(cfg, (target or {}).get("num_layers")), cfg, target)


def config_from_sglang(config: dict) -> DFlashConfig:
    """A DFlashConfig from a DFlash config.json (ours, or another tool's), read as SGLang reads it:
    dflash_config's fields first, then the top level. KeyError names a missing field; ValueError
    an impossible one."""
    dflash = config.get("dflash_config") or {}
    heads = config["num_attention_heads"]
    types = tuple(config.get("layer_types") or ())
    rope_theta, rope_scaling = rope_settings(config)
    if "target_layer_ids" not in dflash and "target_layer_ids" not in config:
        raise KeyError("dflash_config.target_layer_ids")
    if "mask_token_id" not in dflash:
        raise KeyError("dflash_config.mask_token_id")
    return DFlashConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 32768),
        vocab_size=config["vocab_size"], target_hidden_size=config["hidden_size"],
        target_layer_ids=tuple(dflash.get("target_layer_ids", config.get("target_layer_ids", ()))),
        block_size=dflash.get("block_size", config.get("block_size", 16)),
        mask_token_id=dflash["mask_token_id"], layer_types=types if set(types) != {"full_attention"} else (),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window") else None,
    )


def read_config_with(path: str | Path, parse):
    """A block draft's config from its config.json alone, through `parse` (the family's reader of
    SGLang's fields): a missing field or a bad value is one DraftLoadError naming the file."""
    path = Path(path)
    try:
        return parse(read_config_json(path))
    except KeyError as e:
        raise DraftLoadError(f"draft {path / 'config.json'} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, DraftLoadError):
            raise
        raise DraftLoadError(f"draft {path / 'config.json'}: {e}") from None


def load_export_with(path: str | Path, family: str, parse):
    """(config, tensors) of an export of `family` (a draft of another family is refused, naming it)."""
    path = Path(path)
    expect_family(path, family)
    return read_config_with(path, parse), load_tensors(path / "model.safetensors")


def read_config(path: str | Path) -> DFlashConfig:
    """A DFlash export's config, read from its config.json alone, as SGLang reads it (a hand-edited
    field must be honoured, and every field our export records is there)."""
    return read_config_with(path, config_from_sglang)


def load_export(path: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """A DFlash export (ours, or another tool's), read from its config.json as SGLang reads it; a
    draft of another family is refused, naming it."""
    return load_export_with(path, "dflash", config_from_sglang)
