"""EAGLE-3 directory layouts: the layer-id convention of each engine, the tensor names of each
layout, and the one reader of a draft directory in either layout, ours or another tool's.

Layer ids (docs/serving.md). Our id i is the output of target decoder layer i (0-based; HF's
hidden_states[i + 1]). SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` in that
convention (it adds 1 and captures the input of layer i + 1). vLLM reads a top-level
`eagle_aux_hidden_state_layer_ids` first (the speculators format's field too) and uses it as
given: vLLM id k is the output of layer k - 1. So a vLLM id is our id + 1.

Layouts (config.json + model.safetensors):
  sglang       an HF Llama config, architectures LlamaForCausalLMEagle3; the one decoder layer
               named midlayer.* (or layers.0.*: SGLang and vLLM map one to the other), with or
               without a "model." prefix; d2t/t2d; maybe embed_tokens.weight and fc_norm.{i}.*;
               ids nested in eagle_config (SGLang's convention) and/or at the top level (vLLM's)
  speculators  vLLM's speculators format: speculators_model_type eagle3, the layer's shape in
               transformer_layer_config, the options and vLLM-convention ids at the top level,
               layers.0.* names
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specfoundry.common.target import rope_settings
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.options import default_aux_layers
from specfoundry.families.folders import DraftLoadError, load_tensors, read_config_json, read_json

LAYOUTS = ("sglang", "speculators")
# written by other tools beside the draft's own weights, and not the draft's: the target's
# embeddings (every engine shares the target's) and speculators' training-only copies of the
# target's head
NOT_THE_DRAFTS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
LEGACY_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


# ---- layer ids ---------------------------------------------------------------------------------

def to_vllm_ids(ids) -> list[int]:
    """Our ids (output of layer i) as vLLM numbers them (the input of layer i + 1)."""
    return [int(i) + 1 for i in ids]


def from_vllm_ids(ids, source: str) -> list[int]:
    if any(int(k) < 1 for k in ids):
        raise DraftLoadError(f"{source}: vLLM layer id 0 is the token embeddings, which specfoundry's EAGLE-3 "
                             f"draft never reads (ids {list(ids)})")
    return [int(k) - 1 for k in ids]


def layout_of(config: dict) -> str:
    return "speculators" if "speculators_config" in config or "speculators_model_type" in config else "sglang"


def layer_ids(config: dict, source: str) -> tuple[int, ...]:
    """The target layers a draft's config.json names, in our convention; () where it names none
    (then both engines use their shared default, default_aux_layers of the target). A config
    whose two fields name different layers is refused: SGLang would serve one, vLLM the other."""
    top = config.get("eagle_aux_hidden_state_layer_ids") or []
    nested = [] if layout_of(config) == "speculators" else \
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    from_top = from_vllm_ids(top, source) if top else []
    if nested and from_top and [int(i) for i in nested] != from_top:
        raise DraftLoadError(f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (SGLang: the "
                             f"outputs of layers {list(nested)}) and the top-level eagle_aux_hidden_state_layer_ids "
                             f"{list(top)} (vLLM: the outputs of layers {from_top}) name different layers")
    return tuple(int(i) for i in (nested or from_top))


# ---- tensor names ------------------------------------------------------------------------------

def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of the draft as the SGLang layout names it (our module's names), with its shape
    (dtype None = the float dtype). Embeddings are not the draft's: engines share the target's."""
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


def layout_name(name: str, layout: str) -> str:
    """Our (SGLang) name of a tensor as `layout` writes it."""
    return "layers.0." + name.removeprefix("midlayer.") if layout == "speculators" and name.startswith("midlayer.") \
        else name


def our_name(name: str) -> str:
    """A tensor name of either layout, or of another trainer's SGLang directory, as ours: no
    "model." prefix, layers.0.* as midlayer.*, SGLang's legacy aux_norm_* as fc_norm.{i}.*."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    for old, new in LEGACY_NAMES.items():
        if name.startswith(old):
            name = new + name.removeprefix(old)
    return name


# ---- reading a directory -----------------------------------------------------------------------

def unsupported(config: dict, c: dict) -> list[str]:
    """The options of a config that specfoundry's draft (one decoder layer, the residual taken
    before hidden_norm, no norm over the whole fc input) does not implement."""
    spec = layout_of(config) == "speculators"
    eagle = config.get("eagle_config") or {}
    found = []
    if c.get("num_hidden_layers", 1) != 1:
        found.append(f"num_hidden_layers {c['num_hidden_layers']}")
    if eagle.get("norm_before_fc", config.get("norm_before_fc", False)):  # vLLM's order of lookup
        found.append("norm_before_fc")
    # vLLM's speculators path takes an absent norm_before_residual as true, its HF path as false
    if config.get("norm_before_residual", spec):
        found.append("norm_before_residual" + ("" if "norm_before_residual" in config else " (absent: true)"))
    if spec and c.get("model_type", "llama") != "llama":
        found.append(f"transformer_layer_config.model_type {c['model_type']!r}")
    return found


def config_from_engine(config: dict, source: str) -> Eagle3Config:
    """An Eagle3Config from a draft's config.json in either layout. Refuses a missing setting or an
    option our draft lacks, naming it."""
    c = config.get("transformer_layer_config") if layout_of(config) == "speculators" else config
    if not isinstance(c, dict):
        raise DraftLoadError(f"{source}: a speculators config.json needs a transformer_layer_config mapping")
    if config.get("speculators_model_type", "eagle3") != "eagle3":
        raise DraftLoadError(f"{source}: speculators_model_type {config['speculators_model_type']!r} is not eagle3")
    bad = unsupported(config, c)
    if bad:
        raise DraftLoadError(f"{source}: {', '.join(bad)}: specfoundry's EAGLE-3 draft is one Llama decoder layer "
                             "that takes its residual before hidden_norm, without these options")
    try:
        heads = c["num_attention_heads"]
        theta, scaling = rope_settings(c)
        return Eagle3Config(
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 8192),
            vocab_size=c["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or c["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or c["hidden_size"],
            aux_layer_ids=layer_ids(config, source), hidden_act=c.get("hidden_act", "silu"),
            fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
            norm_output=bool(config.get("norm_output", False)))
    except KeyError as e:
        raise DraftLoadError(f"{source} lacks {e.args[0]!r}") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise DraftLoadError(f"{index}: no weight_map of tensor names to files")
        return {k: v for f in sorted(set(map(str, weight_map.values()))) for k, v in load_tensors(path / f).items()}
    if not (path / "model.safetensors").is_file():
        raise DraftLoadError(f"{path} holds no model.safetensors (nor a model.safetensors.index.json)")
    return load_tensors(path / "model.safetensors")


def vocab_maps_of(tensors: dict, cfg: Eagle3Config, source: str) -> None:
    """d2t (int64 offsets: target id = i + d2t[i]) and t2d (bool) in place: t2d derived from d2t
    where a tool wrote only d2t, both the identity where the draft's vocabulary is the target's."""
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DraftLoadError(f"{source}: tensor d2t is missing, and the draft vocabulary ({cfg.draft_vocab_size}) "
                                 f"is not the target's ({cfg.vocab_size})")
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    d2t = tensors["d2t"]
    if d2t.is_floating_point() or d2t.dim() != 1:
        raise DraftLoadError(f"{source}: tensor d2t must be a vector of integer offsets, got {d2t.dtype} "
                             f"{tuple(d2t.shape)}")
    tensors["d2t"] = d2t = d2t.to(torch.int64)
    targets = d2t + torch.arange(len(d2t))
    if len(d2t) and not 0 <= int(targets.min()) <= int(targets.max()) < cfg.vocab_size:
        raise DraftLoadError(f"{source}: tensor d2t maps draft ids outside the target vocabulary ({cfg.vocab_size})")
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, targets, True)
    tensors["t2d"] = t2d = tensors["t2d"].to(torch.bool)
    if t2d.shape == (cfg.vocab_size,) and not bool(t2d[targets].all()):
        raise DraftLoadError(f"{source}: tensors t2d and d2t disagree (t2d leaves out target ids d2t maps to)")


def draft_tensors(raw: dict[str, torch.Tensor], cfg: Eagle3Config, source: str, layout: str) -> dict:
    """The tensors of a draft directory under our names, with its vocabulary maps, checked against
    the config: a missing, unexpected or misshapen tensor is refused, named as the file names it."""
    out, origin = {}, {}
    for name, t in raw.items():
        ours = our_name(name)
        if ours in NOT_THE_DRAFTS or ours.endswith("rotary_emb.inv_freq"):
            continue
        if ours in out:
            raise DraftLoadError(f"{source}: tensors {origin[ours]} and {name} are the same weight, {ours}")
        out[ours], origin[ours] = t, name
    vocab_maps_of(out, cfg, source)
    spec = expected_tensors(cfg)
    missing = [layout_name(n, layout) for n in spec if n not in out]
    unexpected = sorted(origin[n] for n in out if n not in spec)
    if missing:
        raise DraftLoadError(f"{source}: tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing "
                             f"(its config.json: fc_norm {cfg.fc_norm}, {cfg.num_aux} captured layers)")
    if unexpected:
        raise DraftLoadError(f"{source}: unexpected tensor{'s' if len(unexpected) > 1 else ''} "
                             f"{', '.join(unexpected)} (specfoundry's EAGLE-3 draft has no such weight)")
    for name, (shape, _) in spec.items():
        if tuple(out[name].shape) != shape:
            raise DraftLoadError(f"{source}: tensor {origin.get(name, name)} has shape {tuple(out[name].shape)}, "
                                 f"its config.json implies {shape}")
    return out


def read_eagle3_config(path: str | Path, num_target_layers: int | None = None) -> tuple[Eagle3Config, str]:
    """(config, layout) of an EAGLE-3 directory, from its config.json alone: what a server reads
    (a hand-edited field is honoured), so the tensors are checked against what will be served.
    Our own specfoundry_draft.json beside it is a record, never read over it. A config naming no
    layers gets the engines' shared default for a target of `num_target_layers`."""
    path = Path(path)
    config = read_config_json(path)
    try:
        cfg = config_from_engine(config, str(path))
    except (TypeError, ValueError) as e:
        if isinstance(e, DraftLoadError):
            raise
        raise DraftLoadError(f"{path / 'config.json'}: {e}") from None
    if not cfg.aux_layer_ids and num_target_layers:
        cfg = replace(cfg, aux_layer_ids=tuple(default_aux_layers(num_target_layers)))
    return cfg, layout_of(config)


def read_eagle3(path: str | Path, num_target_layers: int | None = None) -> tuple[Eagle3Config, dict]:
    """(config, tensors under our module's names, checked) of an EAGLE-3 directory in either layout."""
    cfg, layout = read_eagle3_config(path, num_target_layers)
    return cfg, draft_tensors(read_tensors(Path(path)), cfg, str(path), layout)
