"""Export a trained draft as the directory SGLang's `LlamaForCausalLMEagle3` loads.

The spec below was written from SGLang's public model code (python/sglang/srt/models/
llama_eagle3.py): its loader maps q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj,
prefixes every name but lm_head with "model.", reads d2t as hot-token offsets, skips t2d, and
SILENTLY IGNORES names it does not know; hence the exact check here. Embeddings are not
exported: SGLang shares the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specfoundry.train.eagle3.config import Eagle3Config
from specfoundry.train.family import DRAFT_FILE, TARGET_FILE


def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor name SGLang's loader expects, with its shape (dtype None = the float dtype)."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    fc_norms = {f"fc_norm.{j}.weight": ((cfg.target_hidden_size,), None) for j in range(cfg.num_aux)} if cfg.fc_norm else {}
    return {
        "fc.weight": ((h, cfg.num_aux * cfg.target_hidden_size), None),
        **fc_norms,
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "midlayer.self_attn.q_proj.weight": ((cfg.num_attention_heads * hd, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((cfg.num_key_value_heads * hd, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((cfg.num_key_value_heads * hd, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, cfg.num_attention_heads * hd), None),
        "midlayer.mlp.gate_proj.weight": ((i, h), None),
        "midlayer.mlp.up_proj.weight": ((i, h), None),
        "midlayer.mlp.down_proj.weight": ((h, i), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, h), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }


def sglang_config(cfg: Eagle3Config) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
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
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # SGLang reads these as the 0-based layers whose OUTPUT feeds the draft (it adds 1 to
        # find the layer whose input it captures); ours are exactly that.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        # EAGLE-3.1, read from the top level by SGLang and vLLM alike: a norm per captured state
        # before fc (tensors fc_norm.{i}.weight), and the post-norm state fed to the next step
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }


def validate(tensors: dict[str, torch.Tensor], cfg: Eagle3Config) -> None:
    spec = expected_tensors(cfg)
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if missing or extra:
        raise ValueError(f"export tensors do not match SGLang's EAGLE-3 names: missing {missing}, unexpected {extra}")
    for name, (shape, dtype) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"export tensor {name} has shape {tuple(t.shape)}, SGLang expects {shape}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"export tensor {name} has dtype {t.dtype}, expected {dtype}")


def export_draft(state_dict: dict[str, torch.Tensor], cfg: Eagle3Config, out_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> Path:
    """Write the SGLang directory; `target`: the identity of the target the draft was trained
    for (from the feature set's manifest), kept beside it so a later eval can check it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state_dict.items():
        if name.startswith(("embed_tokens.", "rotary.")):
            continue  # SGLang uses the target's embeddings; RoPE has no weights
        t = t.detach().cpu()
        tensors[name] = t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
    validate(tensors, cfg)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(sglang_config(cfg), indent=2) + "\n")
    (out / DRAFT_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if target is not None:
        (out / TARGET_FILE).write_text(json.dumps(target, indent=2) + "\n")
    return out


def config_from_sglang(config: dict) -> Eagle3Config:
    """An Eagle3Config from an SGLang EAGLE-3 config.json (ours, or another tool's). KeyError names a
    missing field."""
    eagle = config.get("eagle_config") or {}
    return Eagle3Config(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        aux_layer_ids=tuple(eagle.get("eagle_aux_hidden_state_layer_ids", ())),
        fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
    )


def load_export(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = Eagle3Config.from_dict(json.loads((path / DRAFT_FILE).read_text()))
    return cfg, load_file(str(path / "model.safetensors"))
