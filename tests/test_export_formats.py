"""Exports that SGLang and vLLM read as trained, and drafts of other tools read back.

Neither engine can be installed here (both need CUDA builds), so each engine's loader is written
down below as a spec from its public code (docs/serving.md names the files): the config fields it
reads and their defaults, how it renames and stacks tensors, and which target layers it captures.
Our exports are checked against those specs; reading an export back must give the same logits.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.capture.runner import HFCaptureRunner
from specfoundry.common.target import Target
from specfoundry.decoding.cache import StaticKVCache
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.export import export_draft
from specfoundry.families.eagle3.family import EAGLE3
from specfoundry.families.eagle3.formats import read_eagle3
from specfoundry.families.eagle3.model import Eagle3Draft, TTTCache
from specfoundry.families.eagle3.options import Eagle3Options, default_aux_layers
from specfoundry.families.eagle3.shapes import random_eagle3_draft
from specfoundry.families.folders import DRAFT_FILE, DraftLoadError, load_draft, locate_draft
from specfoundry.train.cli import export_main
from tests.conftest import torch_threads
from tests.test_families import TINY, random_draft

OPTIONS = [{}, {"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}]
LAYOUTS = ("sglang", "speculators")
VERIFIER = {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
TARGET_LAYERS = 8
# a draft as wide as its target, so that the target's embeddings fit it (sf-eval, --init-from)
SMALL = {**TINY, "target_hidden_size": 32}


def export(tmp_path, draft, layout, name="export", **kw):
    return export_draft(draft.state_dict(), draft.cfg, tmp_path / name, dtype=torch.float32, layout=layout,
                        verifier=VERIFIER, **kw)


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: one thread runs them many times faster than a pool of them."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama target of 8 layers, saved as a model directory."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=97, max_position_embeddings=16384,
                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("target")
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def target_dir(target):
    return target[0]


# ---- the engines' layer rules, from their code ----------------------------------------------------

def sglang_captured(config: dict, num_layers: int) -> list[int]:
    """The decoder layers whose INPUT SGLang hands the draft. model_runner.py reads
    hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"] (None on any failure); the target's
    set_eagle3_layers_to_capture takes None as [2, L//2, L-3] and adds 1 to given ids; its forward
    appends hidden_states + residual before running layer i, for i in layers_to_capture."""
    try:
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    to_capture = [2, num_layers // 2, num_layers - 3] if ids is None else [v + 1 for v in ids]
    return [i for i in range(num_layers) if i in to_capture]


def vllm_ids(hf_config: dict, num_layers: int, nested_too: bool) -> list[int]:
    """vLLM's ids. gpu_model_runner._get_eagle3_aux_layers_from_config takes the top-level
    eagle_aux_hidden_state_layer_ids if it is a non-empty list, then (some versions; model runner
    v2's eagle3_utils never) eagle_config's; else the target's default (2, L//2, L-3). Used as given."""
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids")
    if not (ids and isinstance(ids, list)) and nested_too:
        ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, num_layers // 2, num_layers - 3]


def vllm_captured(hf_config: dict, num_layers: int, nested_too: bool) -> list[int]:
    """The layers whose INPUT vLLM hands the draft: EagleModelMixin._maybe_add_hidden_state adds
    id 0 before the first layer and id idx + 1 after layer idx (older llama.py: id idx before
    layer idx), so id k is the input of layer k."""
    ids = vllm_ids(hf_config, num_layers, nested_too)
    return [k for k in range(num_layers + 1) if k in ids]


def vllm_speculators_hf_config(config: dict) -> dict:
    """The draft config vLLM builds from a speculators config.json: HFConfigParser takes a config
    without model_type but with speculators_config as type "speculators"; SpeculatorsConfig
    validates it (base.py) and starts from transformer_layer_config, then algos.update_eagle3."""
    assert config.get("model_type") is None, "a model_type would send it to AutoConfig as a plain model"
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] > 0 and spec["proposal_methods"][0]["proposal_type"]
    assert spec["verifier"]["name_or_path"] and config["speculators_model_type"] == "eagle3"
    assert isinstance(config["transformer_layer_config"], dict)
    c = dict(config["transformer_layer_config"])
    c["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        c["target_hidden_size"] = config["target_hidden_size"]
    c["norm_before_residual"] = config.get("norm_before_residual", True)
    c["norm_before_fc"] = config.get("norm_before_fc", False)
    c["fc_norm"] = config.get("fc_norm", False)
    c["norm_output"] = config.get("norm_output", False)
    c["architectures"] = [{"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}[
        c.get("model_type", "llama")]]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        c["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return c


def engine_inputs(config: dict, engine: str) -> list[int]:
    """The target layers whose INPUT the engine hands the draft, in the order it concatenates them."""
    if engine == "sglang":
        return sglang_captured(config, TARGET_LAYERS)
    hf = vllm_speculators_hf_config(config) if "speculators_config" in config else config
    return vllm_captured(hf, TARGET_LAYERS, nested_too=engine == "vllm")


ENGINES = {"sglang": ("sglang", "vllm", "vllm-top-level-only"), "speculators": ("vllm", "vllm-top-level-only")}


@pytest.mark.parametrize("layout, engine", [(lay, e) for lay, engines in ENGINES.items() for e in engines])
@pytest.mark.parametrize("layers", [(1, 3, 4), (0, 2, 6)])  # the default for 8 layers, and others
def test_each_engine_feeds_the_draft_exactly_the_layers_sf_capture_stored(tmp_path, target, layout, engine, layers):
    draft = random_draft()
    draft.cfg = replace(draft.cfg, aux_layer_ids=layers)
    config = config_of(export(tmp_path, draft, layout))
    model = target[1]
    ids = torch.randint(0, 97, (11,)).tolist()
    stored = HFCaptureRunner(Target.wrap(model), list(layers))([ids])[0]["aux_hidden"]  # sf-capture's features [T, 3H]
    with torch.no_grad():
        inputs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: the input of layer i
    served = engine_inputs(config, engine)
    assert [i - 1 for i in served] == list(layers)  # the input of layer i is the output of layer i - 1
    torch.testing.assert_close(torch.cat([inputs[i][0] for i in served], dim=-1), stored, rtol=0, atol=0)


@pytest.mark.parametrize("num_layers", [8, 28, 32, 36, 48, 94])
def test_both_engines_defaults_are_our_default_layers(num_layers):
    """A config naming no layers: SGLang's raw [2, L//2, L-3] captured before those layers and
    vLLM's (2, L//2, L-3) ids are the same layers, ours [1, L//2-1, L-4]."""
    assert [i - 1 for i in sglang_captured({}, num_layers)] == default_aux_layers(num_layers)
    assert [k - 1 for k in vllm_captured({}, num_layers, nested_too=True)] == default_aux_layers(num_layers)


def test_ids_nested_alone_would_feed_vllm_the_layers_before():
    """Why the top-level field is written: vLLM reads eagle_config's ids as its own numbers."""
    nested_only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}}
    assert [i - 1 for i in sglang_captured(nested_only, TARGET_LAYERS)] == [0, 2, 6]
    assert [k - 1 for k in vllm_captured(nested_only, TARGET_LAYERS, nested_too=True)] == [-1, 1, 5]


# ---- the loaders' tensor rules, from their code --------------------------------------------------

def layer_params(c: dict, prefix: str, inputs: int, qkv_bias: bool) -> dict:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd, i = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads, c["intermediate_size"]
    p = {f"{prefix}input_layernorm.weight": (h,), f"{prefix}hidden_norm.weight": (h,),
         f"{prefix}post_attention_layernorm.weight": (h,), f"{prefix}self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, inputs),
         f"{prefix}self_attn.o_proj.weight": (h, heads * hd), f"{prefix}mlp.gate_up_proj.weight": (2 * i, h),
         f"{prefix}mlp.down_proj.weight": (h, i)}
    if qkv_bias:
        p[f"{prefix}self_attn.qkv_proj.bias"] = ((heads + 2 * kv) * hd,)
    return p


def eagle3_params(c: dict, engine: str) -> dict:
    """Parameter -> shape of SGLang's LlamaForCausalLMEagle3 / vLLM's Eagle3LlamaForCausalLM built
    from config `c`, with each engine's defaults (SGLang: fc_norm or use_aux_norm, bias; vLLM:
    draft_vocab_size defaults to vocab_size, norm_before_fc from eagle_config first)."""
    h, eagle = c["hidden_size"], c.get("eagle_config") or {}
    th = c.get("target_hidden_size") or h
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    n_aux = c.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    vocab = c["draft_vocab_size"] if engine == "sglang" else c.get("draft_vocab_size") or c["vocab_size"]
    p = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.fc.weight": (h, n_aux * th),
         "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    if c.get("fc_norm") or (engine == "sglang" and c.get("use_aux_norm")):
        p.update({f"model.fc_norm.{j}.weight": (th,) for j in range(n_aux)})
    if engine == "vllm":
        p["draft_id_to_target_id"] = (vocab,)
        if eagle.get("norm_before_fc", c.get("norm_before_fc", False)):
            p["model.input_norm.weight"] = (n_aux * th,)
    bias = c.get("attention_bias", False) or (engine == "sglang" and c.get("bias", False))
    for n in range(c["num_hidden_layers"]):
        p.update(layer_params(c, f"model.layers.{n}.", 2 * h if n == 0 else h, bias))
    assert not (engine == "sglang" and c["tie_word_embeddings"]), "SGLang would use embed_tokens as its lm_head"
    return p


STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def sglang_load(tensors: dict, params: dict) -> tuple[dict, list]:
    """LlamaForCausalLMEagle3.load_weights: legacy renames, d2t -> hot tokens, t2d skipped, shards
    into stacked parameters, a name tried as given and then with "model."; names matching no
    parameter are SILENTLY dropped (returned here as the second value)."""
    filled, dropped = defaultdict(list), []
    for name, t in tensors.items():
        for legacy, new in {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                            "aux_norm_high": "fc_norm.2"}.items():
            name = name.replace(legacy, new)
        if "d2t" in name or "t2d" in name:
            continue
        shard = next(((new, sid) for old, (new, sid) in STACKED.items() if old in name), None)
        if shard:
            name = name.replace(next(old for old in STACKED if old in name), shard[0])
        param = name if name in params else f"model.{name}"
        if param in params:
            filled[param].append((shard and shard[1], tuple(t.shape)))
        else:
            dropped.append(name)
    return filled, dropped


def vllm_load(tensors: dict, params: dict, c: dict) -> dict:
    """Eagle3LlamaForCausalLM.load_weights (t2d dropped, d2t -> draft_id_to_target_id, "model."
    before all but lm_head, embed_tokens and input_norm skipped where absent or unused), then
    LlamaModel's WeightsMapper (midlayer. -> layers.0., q/k/v and gate/up stacked); vLLM's
    AutoWeightsLoader raises on a name that matches no parameter."""
    eagle = c.get("eagle_config") or {}
    skip = ["mask_hidden"] + ([] if any("embed_tokens" in n for n in tensors) else ["embed_tokens"])
    skip += [] if eagle.get("norm_before_fc", c.get("norm_before_fc", False)) else ["input_norm."]
    filled = defaultdict(list)
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else \
            name if "lm_head" in name else "model." + name
        if any(s in name for s in skip):
            continue
        name = name.replace("midlayer.", "layers.0.")
        shard = next(((old, new, sid) for old, (new, sid) in STACKED.items() if old in name), None)
        if shard:
            name = name.replace(shard[0], shard[1])
        assert name in params, f"vLLM's AutoWeightsLoader raises: no parameter {name}"
        filled[name].append((shard and shard[2], tuple(t.shape)))
    return filled


def assert_fills_exactly(filled: dict, params: dict, shared: set, c: dict, engine: str) -> None:
    """Every parameter but the shared ones filled once (a stacked one once per shard, with the
    shard's shape), and nothing else."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd, i = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads, c["intermediate_size"]
    rows = {"q": heads * hd, "k": kv * hd, "v": kv * hd, 0: i, 1: i}
    assert set(filled) == set(params) - shared, (engine, sorted(set(params) - shared - set(filled)),
                                                 sorted(set(filled) - set(params)))
    for name, loads in filled.items():
        shape = params[name]
        if loads[0][0] is None:
            assert loads == [(None, shape)], (engine, name, loads, shape)
        else:
            assert sorted(str(s) for s, _ in loads) == sorted(str(s) for s in (("q", "k", "v") if "qkv" in name
                                                                                else (0, 1))), (engine, name)
            assert all(got == (rows[s], shape[1]) for s, got in loads), (engine, name, loads, shape)


@pytest.mark.parametrize("options", OPTIONS)
def test_sglang_layout_fills_every_parameter_of_both_engines(tmp_path, options):
    draft = random_draft(**options)
    out = export(tmp_path, draft, "sglang")
    config, tensors = config_of(out), load_file(str(out / "model.safetensors"))
    params = eagle3_params(config, "sglang")
    filled, dropped = sglang_load(tensors, params)
    assert not dropped, f"SGLang would silently drop {dropped}"
    assert_fills_exactly(filled, params, {"model.embed_tokens.weight"}, config, "sglang")  # the target's
    params = eagle3_params(config, "vllm")
    assert_fills_exactly(vllm_load(tensors, params, config), params, {"model.embed_tokens.weight"}, config, "vllm")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


@pytest.mark.parametrize("options", OPTIONS)
def test_speculators_layout_fills_every_parameter_of_vllm(tmp_path, options):
    draft = random_draft(**options)
    out = export(tmp_path, draft, "speculators")
    hf = vllm_speculators_hf_config(config_of(out))
    tensors = load_file(str(out / "model.safetensors"))
    assert all(n.startswith(("layers.0.", "fc.", "fc_norm.", "norm.", "lm_head.", "d2t", "t2d")) for n in tensors)
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"]
    params = eagle3_params(hf, "vllm")
    assert_fills_exactly(vllm_load(tensors, params, hf), params, {"model.embed_tokens.weight"}, hf, "vllm")


def engine_view(c: dict, engine: str) -> dict:
    """What the engine's draft model takes from its config `c`, each with that engine's default."""
    heads = c["num_attention_heads"]
    view = {"hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"], "num_attention_heads": heads,
            "num_key_value_heads": c["num_key_value_heads"], "head_dim": c.get("head_dim", c["hidden_size"] // heads),
            "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c.get("rope_theta", 10000),
            "rope_scaling": c.get("rope_scaling"), "max_position_embeddings": c.get("max_position_embeddings", 8192),
            "vocab_size": c["vocab_size"], "hidden_act": c["hidden_act"], "num_hidden_layers": c["num_hidden_layers"],
            "target_hidden_size": c.get("target_hidden_size", c["hidden_size"]),
            "fc_norm": bool(c.get("fc_norm") or (engine == "sglang" and c.get("use_aux_norm"))),
            "draft_vocab_size": c["draft_vocab_size"] if engine == "sglang" else c.get("draft_vocab_size") or c["vocab_size"],
            # SGLang and SpecForge have no such option: their layer 0 always takes the residual
            # before hidden_norm
            "norm_before_residual": False if engine in ("sglang", "specforge")
            else c.get("norm_before_residual", False)}
    if engine == "specforge":
        # SpecForge's LlamaForCausalLMEagle3 (specforge/modeling/draft/llama3_eagle.py at a6b6b023):
        # `self.norm_output = getattr(config, "norm_output", True)`, and compute_logits takes
        # lm_head(norm(h)) when it is true, lm_head(h) when false; the next TTT step always reads the
        # backbone's pre-norm output (specforge/algorithms/eagle3/model.py: hidden_states = backbone(...))
        view["logits_from"] = "norm(h)" if c.get("norm_output", True) else "h"
        view["next_step_reads"] = "h"
    else:
        # SGLang's LlamaModel.forward, vLLM's Eagle3 LlamaModel and speculators' Eagle3 core: the
        # logits always come from norm(h); norm_output (absent: false) hands norm(h) to the next step
        view["logits_from"] = "norm(h)"
        view["next_step_reads"] = "norm(h)" if c.get("norm_output", False) else "h"
    return view


@pytest.mark.parametrize("options", OPTIONS)
def test_every_field_the_loaders_read_says_what_the_draft_was_trained_as(tmp_path, options):
    """Our draft keeps the incoming hidden state as the residual and normalises after
    (norm_before_residual false), which vLLM's speculators path assumes the opposite of when the
    field is absent: so each field is written out, and each engine's view equals the draft's.
    norm_output is the opposite case (issue 37 item 6b): SpecForge reads `norm_output: false` as
    "no norm before lm_head", so it is written only when true, and a standard draft builds the same
    in SGLang, vLLM and SpecForge."""
    draft = random_draft(**options)
    cfg = draft.cfg
    want = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "hidden_act": cfg.hidden_act, "num_hidden_layers": 1,
            "target_hidden_size": cfg.target_hidden_size, "fc_norm": cfg.fc_norm,
            "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False,
            # Eagle3Draft.forward: logits from the final norm; the next step reads norm(h) under
            # norm_output (EAGLE-3.1), else the pre-norm h
            "logits_from": "norm(h)", "next_step_reads": "norm(h)" if cfg.norm_output else "h"}
    sglang = config_of(export(tmp_path, draft, "sglang", "a"))
    speculators = config_of(export(tmp_path, draft, "speculators", "b"))
    hf = vllm_speculators_hf_config(speculators)
    for engine, c in (("sglang", sglang), ("vllm", sglang), ("vllm", hf)):
        assert engine_view(c, engine) == want, engine
    specforge = engine_view(sglang, "specforge")
    if cfg.norm_output:
        # SpecForge has no post-norm recurrence at all: no config makes it build this draft
        # (docs/serving.md says so); everything else it reads as trained
        assert specforge == {**want, "next_step_reads": "h"}
    else:
        assert specforge == want
    assert ("norm_output" in sglang) == ("norm_output" in speculators) == cfg.norm_output
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["tie_word_embeddings"] is False
    assert sglang["eagle_config"]["use_aux_hidden_state"] is True
    written = set(speculators) | set(speculators["transformer_layer_config"])
    assert {"norm_before_residual", "norm_before_fc", "fc_norm", "draft_vocab_size",
            "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "max_position_embeddings"} <= written
    assert speculators["speculators_config"]["verifier"] == VERIFIER
    assert speculators["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert speculators["transformer_layer_config"]["model_type"] == "llama"


# ---- reading back ---------------------------------------------------------------------------------

def logits(draft, seed=1):
    """decode_forward's and TTT step 0 and 1's logits on fixed inputs."""
    g = torch.Generator().manual_seed(seed)
    n = 9
    ids = torch.randint(0, draft.cfg.vocab_size, (1, n), generator=g)
    aux = torch.randn(1, n, draft.cfg.num_aux * draft.cfg.target_hidden_size, generator=g)
    with torch.no_grad():
        hidden = draft.project(aux)
        cache = StaticKVCache(n)
        cache.columns = torch.arange(n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # [1, 1, n, n]
        state, normed = draft.decode_forward(ids, hidden, torch.arange(n)[None], cache, causal)
        out = [draft.lm_head(normed)]
        cache = TTTCache()
        for s in range(2):
            hidden, normed = draft.ttt_forward(ids, hidden if s else draft.project(aux), torch.arange(n)[None] + s,
                                               cache, [n], s, "sdpa")
            out.append(draft.lm_head(normed))
    return torch.stack(out)


def reloaded(cfg: Eagle3Config, tensors: dict, embeddings: torch.Tensor) -> Eagle3Draft:
    draft = Eagle3Draft(cfg)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"embed_tokens.weight"} and not unexpected, (missing, unexpected)
    draft.embed_tokens.weight.copy_(embeddings)
    return draft.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("ours", [True, False], ids=["with-our-config", "engine-config-only"])
def test_an_export_read_back_gives_the_same_logits(tmp_path, layout, options, ours):
    draft = random_draft(**options)
    out = export(tmp_path, draft, layout)
    if not ours:
        (out / DRAFT_FILE).unlink()  # as another tool would read it: from config.json alone
    cfg, tensors = read_eagle3(out)
    assert cfg == draft.cfg
    for name in ("d2t", "t2d"):
        assert torch.equal(tensors[name], getattr(draft, name)), name
    # the same fp32 weights through the same ops: bit for bit
    torch.testing.assert_close(logits(reloaded(cfg, tensors, draft.embed_tokens.weight)), logits(draft), rtol=0, atol=0)


def small_draft(**options) -> Eagle3Draft:
    """random_draft's kind of draft (norms away from 1, a vocabulary map), as wide as the target."""
    return random_eagle3_draft(Eagle3Config(**SMALL, **options), vocab_stride=2, first_id=1, norms_off_one=True).eval()


def other_tools_sglang_dir(tmp_path, draft, prefix: str, layer: str, ids_nested: bool):
    """A draft as SpecForge (midlayer.*, no prefix) or a trainer with "model." names and layers.0.*
    writes it: bf16, embed_tokens.weight in it, d2t/t2d, and no specfoundry_draft.json."""
    cfg = draft.cfg
    names = {k: prefix + k.replace("midlayer.", layer) for k in draft.state_dict() if not k.startswith("rotary.")}
    tensors = {names[k]: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in draft.state_dict().items() if k in names}
    out = tmp_path / "theirs"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": 2048,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "tie_word_embeddings": False,
              "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "hidden_act": "silu"}
    if ids_nested:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("prefix, layer", [("", "midlayer."), ("model.", "layers.0.")])
@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}])
def test_sf_eval_reads_other_tools_sglang_dirs_keeping_maps_and_layers(tmp_path, target_dir, prefix, layer, options):
    draft = small_draft(**options)
    for p in draft.parameters():  # as bf16 files hold them (RoPE's inv_freq is not in the files)
        p.data = p.data.to(torch.bfloat16).float()
    draft.embed_tokens.weight.copy_(load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
    theirs = other_tools_sglang_dir(tmp_path, draft, prefix, layer, ids_nested=True)
    loaded = load_draft(locate_draft(theirs), target_dir, torch.device("cpu"), torch.float32)
    assert loaded.cfg.aux_layer_ids == draft.cfg.aux_layer_ids and loaded.cfg.fc_norm == draft.cfg.fc_norm
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    torch.testing.assert_close(logits(loaded), logits(draft), rtol=0, atol=0)


def test_a_dir_naming_no_layers_reads_the_engines_default_for_the_target(tmp_path, target_dir):
    draft = small_draft()
    theirs = other_tools_sglang_dir(tmp_path, draft, "", "midlayer.", ids_nested=False)
    loaded = load_draft(locate_draft(theirs), target_dir, torch.device("cpu"), torch.float32)
    assert list(loaded.cfg.aux_layer_ids) == default_aux_layers(TARGET_LAYERS) == [1, 3, 4]


def test_a_speculators_dir_of_another_tool_is_read_in_our_layer_convention(tmp_path, target_dir):
    draft = small_draft(fc_norm=True)
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "spec", dtype=torch.float32, layout="speculators",
                       verifier=VERIFIER)
    (out / DRAFT_FILE).unlink()
    config = config_of(out)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM's numbers for our (1, 2, 3)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = draft.embed_tokens.weight.clone()  # speculators writes it
    save_file(tensors, str(out / "model.safetensors"))
    loaded = load_draft(locate_draft(out), target_dir, torch.device("cpu"), torch.float32)
    assert loaded.cfg.aux_layer_ids == (1, 2, 3)
    draft.embed_tokens.weight.copy_(loaded.embed_tokens.weight)
    torch.testing.assert_close(logits(loaded), logits(draft), rtol=0, atol=0)


def test_init_from_starts_from_another_tools_draft(tmp_path, target_dir):
    draft = small_draft(norm_output=True)
    theirs = other_tools_sglang_dir(tmp_path, draft, "model.", "layers.0.", ids_nested=True)
    fs = SimpleNamespace(root=tmp_path / "fs", manifest={"target": {"num_layers": TARGET_LAYERS, "vocab_size": 97,
                                                                     "hidden_size": 32}})
    model, dcfg = EAGLE3.build(Eagle3Options(), fs, target_dir, [1, 2, 3], str(theirs))
    assert dcfg.norm_output and torch.equal(model.d2t, draft.d2t)
    ref = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    for name, t in model.state_dict().items():
        if not name.startswith(("embed_tokens.", "rotary.")):
            torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"reads layers \[1, 2, 3\], but the run reads layers \[1, 3, 4\]"):
        EAGLE3.build(Eagle3Options(), fs, target_dir, [1, 3, 4], str(theirs))


# ---- refusals -------------------------------------------------------------------------------------

def one_line_error(path, **kw) -> str:
    with pytest.raises(DraftLoadError) as e:
        read_eagle3(path, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("layout, name", [("sglang", "midlayer.mlp.up_proj.weight"),
                                          ("speculators", "layers.0.mlp.up_proj.weight")])
def test_a_missing_or_misshapen_tensor_is_refused_naming_it(tmp_path, layout, name):
    out = export(tmp_path, random_draft(fc_norm=True), layout)
    tensors = load_file(str(out / "model.safetensors"))
    good = dict(tensors)
    del tensors[name]
    save_file(tensors, str(out / "model.safetensors"))
    assert f"tensor {name} missing" in one_line_error(out)
    tensors = dict(good, **{"fc.weight": good["fc.weight"].T.contiguous()})
    save_file(tensors, str(out / "model.safetensors"))
    assert "tensor fc.weight has shape (72, 32), its config.json implies (32, 72)" in one_line_error(out)
    tensors = dict(good, **{"fc_norm.1.weight": torch.ones(5)})
    save_file(tensors, str(out / "model.safetensors"))
    assert "tensor fc_norm.1.weight has shape (5,)" in one_line_error(out)
    tensors = dict(good, **{name.replace("mlp.up_proj.weight", "self_attn.q_proj.bias"): torch.ones(32)})
    save_file(tensors, str(out / "model.safetensors"))
    assert "unexpected tensor" in one_line_error(out) and "q_proj.bias" in one_line_error(out)


def test_options_our_draft_lacks_and_layers_the_engines_disagree_on_are_refused(tmp_path):
    out = export(tmp_path, random_draft(), "speculators")
    (out / DRAFT_FILE).unlink()
    config = config_of(out)
    for change, words in [({"norm_before_residual": None}, "norm_before_residual (absent: true)"),
                          ({"norm_before_fc": True}, "norm_before_fc"),
                          ({"transformer_layer_config": {**config["transformer_layer_config"], "num_hidden_layers": 2}},
                           "num_hidden_layers 2")]:
        changed = {k: v for k, v in {**config, **change}.items() if v is not None}
        (out / "config.json").write_text(json.dumps(changed))
        assert words in one_line_error(out)
    sglang = export(tmp_path, random_draft(), "sglang", "sg")
    config = config_of(sglang)
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # vLLM would read layers 0, 1, 2
    (sglang / "config.json").write_text(json.dumps(config))
    assert "name different layers" in one_line_error(sglang)


# ---- sf-export --------------------------------------------------------------------------------------

def test_sf_export_writes_what_vllm_serves_alone(tmp_path, target_dir):
    draft = small_draft(fc_norm=True)
    draft.cfg = replace(draft.cfg, max_position_embeddings=4096)
    src = export_draft(draft.state_dict(), draft.cfg, tmp_path / "trained")  # sf-train's (bf16) export
    out = tmp_path / "vllm"
    args = ["run", str(src), "-o", str(out), "--format", "speculators", "--target", str(target_dir), "-k", "5"]
    result = CliRunner().invoke(export_main, args)
    assert result.exit_code == 0, result.output
    config = config_of(out)
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(target_dir.resolve()),
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    # vLLM refuses a draft shorter than its target: raised to the target's
    assert config["transformer_layer_config"]["max_position_embeddings"] == 16384
    a, b = read_eagle3(src), read_eagle3(out)
    assert replace(b[0], max_position_embeddings=4096) == a[0]
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert CliRunner().invoke(export_main, args).exit_code == 0  # the same command again
    result = CliRunner().invoke(export_main, [*args[:-2], "-k", "4"])
    assert result.exit_code == 2 and "other settings" in result.output


def test_sf_export_takes_a_training_checkpoint(tmp_path, target_dir):
    draft = small_draft(norm_output=True)
    step = tmp_path / "run" / "checkpoints" / "step-0000002"
    step.mkdir(parents=True)
    save_file({f"draft.{k}": v.contiguous() for k, v in draft.state_dict().items()}, str(step / "model.safetensors"))
    (tmp_path / "run" / "draft_config.json").write_text(json.dumps(draft.cfg.to_dict()))
    out = tmp_path / "sglang"
    result = CliRunner().invoke(export_main, ["run", str(step), "-o", str(out), "--target", str(target_dir)])
    assert result.exit_code == 0, result.output
    cfg, tensors = read_eagle3(out)
    assert replace(cfg, max_position_embeddings=draft.cfg.max_position_embeddings) == draft.cfg
    state = draft.state_dict()
    assert all(torch.equal(t, state[k].to(t.dtype)) for k, t in tensors.items())


# ---- damaged draft folders: one line naming the file and the field, in sf-export and sf-eval ----------

def export_error(src, out, target_dir) -> str:
    result = CliRunner().invoke(export_main, ["run", str(src), "-o", str(out), "--target", str(target_dir)])
    assert result.exit_code == 2 and "Traceback" not in result.output, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and not out.exists(), result.output
    return errors[0].removeprefix("Error: ")


@pytest.mark.parametrize("change, words", [
    ({"intermediate_size": "sixty-four"}, "config.json: intermediate_size is 'sixty-four', not an integer"),
    ({"rms_norm_eps": "small"}, "config.json: rms_norm_eps is 'small', not a positive finite number"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2,3"}},
     "config.json: eagle_config.eagle_aux_hidden_state_layer_ids is '1,2,3', not a list of layer ids"),
])
def test_a_config_json_field_that_is_no_number_is_named(tmp_path, target_dir, change, words):
    out = export(tmp_path, small_draft(), "sglang")
    (out / "config.json").write_text(json.dumps({**config_of(out), **change}))
    assert export_error(out, tmp_path / "out", target_dir) == f"{out}/{words}"  # before: a traceback or no name
    with pytest.raises(DraftLoadError, match=f"^{out}/{words}"):
        load_draft(locate_draft(out), target_dir, torch.device("cpu"), torch.float32)  # what sf-eval reads it with


def test_a_config_json_that_is_not_an_object_or_a_truncated_tensor_file_is_named(tmp_path, target_dir):
    out = export(tmp_path, small_draft(), "sglang")
    (out / "config.json").write_text("[1, 2]")
    assert export_error(out, tmp_path / "o1", target_dir) == f"{out}/config.json: not a JSON object of settings, but a list"
    out = export(tmp_path, small_draft(), "sglang", "second")
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    words = f"{out}/model.safetensors: not a readable safetensors file"
    assert export_error(out, tmp_path / "o2", target_dir).startswith(words)  # before: a SafetensorError traceback
    with pytest.raises(DraftLoadError, match=f"^{words}.*damaged or truncated"):
        load_draft(locate_draft(out), target_dir, torch.device("cpu"), torch.float32)


def test_the_config_json_the_engines_read_is_checked_against_the_weights_not_our_record(tmp_path, target_dir):
    out = export(tmp_path, small_draft(), "sglang")
    (out / "config.json").write_text(json.dumps({**config_of(out), "intermediate_size": 48}))
    assert (out / DRAFT_FILE).is_file()  # our record still says 64, as the weights do
    # before: sf-export and sf-eval read specfoundry_draft.json over it and passed a folder SGLang cannot load
    assert export_error(out, tmp_path / "out", target_dir) == (
        f"{out}: tensor midlayer.mlp.gate_proj.weight has shape (64, 32), its config.json implies (48, 32)")
    with pytest.raises(DraftLoadError, match="its config.json implies"):
        load_draft(locate_draft(out), target_dir, torch.device("cpu"), torch.float32)
