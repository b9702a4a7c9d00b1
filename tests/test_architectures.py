"""The architecture matrix: tiny random targets of Llama, Qwen3, Qwen3-MoE, Gemma-3 (text) and Mistral,
each built from its transformers config and saved as a model directory with SmolLM2's tokenizer, go
through regen, capture, train, export and sf-eval's decoding by the consistency gate, which must pass.

What each family brings (specfoundry/testing.py TINY_TARGETS): Qwen3 a head_dim apart from
hidden / heads and a reasoning chat template; Qwen3-MoE sparse MoE layers; Gemma-3 tied and
sqrt(H)-scaled embeddings, a GELU MLP, RoPE per layer type and 16-token sliding windows in 5 of 6
layers; Mistral a sliding window in every layer; Llama a --chat-template file of its own.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specfoundry.common.target import Target, resolve_target
from specfoundry.common.weights import target_embeddings, target_lm_head
from specfoundry.decoding.rounds import target_generate
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families.dflash.options import dflash_default_layers
from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
from specfoundry.families.eagle3.config import draft_config_from_target
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.eagle3.options import default_aux_layers
from specfoundry.families.eagle3.tree import tree_generate
from specfoundry.families.vocab import vocab_maps
from specfoundry.gate import GateConfig, run_gate
from specfoundry.testing import TINY_SHAPE, TINY_TARGETS, write_tiny_target

LAYERS = TINY_SHAPE["num_hidden_layers"]
# a template that is not the tokenizer's own, given to every stage as a file (the Llama row)
COLON_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}:{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_targets(tmp_path_factory):
    """Each family's tiny target, built once for the module."""
    root = tmp_path_factory.mktemp("targets")
    smol = resolve_target("smollm2")
    return {name: write_tiny_target(name, root / name, smol) for name in TINY_TARGETS}


def gate(target, tmp_path, max_steps=100, **kw):
    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(target), max_steps=max_steps, max_new_tokens=32,
                     device="cpu", **kw)
    checks, ok, message = run_gate(cfg)
    return cfg, checks, ok, message


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_eagle3_gate_passes_for_every_architecture(tiny_targets, tmp_path, name):
    target = tiny_targets[name]
    kw = {}
    if name == "llama":
        (tmp_path / "colon.jinja").write_text(COLON_TEMPLATE)
        kw["chat_template"] = str(tmp_path / "colon.jinja")
    cfg, checks, ok, message = gate(target, tmp_path, **kw)
    assert ok, message
    manifest = json.loads((tmp_path / "gate" / "features" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == default_aux_layers(LAYERS) == [1, 3, 4]
    assert manifest["chat_template_source"] == kw.get("chat_template", "target")
    # the draft's shape comes from the target's config
    text = json.loads((target / "config.json").read_text())
    draft = json.loads((tmp_path / "gate" / "train" / "export" / "config.json").read_text())
    assert draft["head_dim"] == text.get("head_dim") or TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"]
    assert draft["vocab_size"] == text["vocab_size"] == 49152
    assert draft["hidden_act"] == "silu"  # the draft's SwiGLU, also under Gemma's GELU target
    rope = text["rope_parameters"]
    assert draft["rope_theta"] == rope.get("full_attention", rope)["rope_theta"]  # Gemma-3: the full layers' 1e6


def test_dflash_gate_passes_on_gemma3(tiny_targets, tmp_path):
    """DFlash embeds the block with the target's embedding (scaled by sqrt(H) in Gemma) and scores it
    with the target's tied lm_head (unscaled)."""
    cfg, checks, ok, message = gate(tiny_targets["gemma3_text"], tmp_path, family="dflash", max_steps=60)
    assert ok, message
    manifest = json.loads((tmp_path / "gate" / "features" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == dflash_default_layers(LAYERS) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_draft_embeddings_are_what_the_target_layers_see(tiny_targets, name):
    model = AutoModelForCausalLM.from_pretrained(tiny_targets[name], dtype=torch.float32)
    ids = torch.arange(0, 49152, 97)
    torch.testing.assert_close(target_embeddings(tiny_targets[name])[ids], model.get_input_embeddings()(ids))
    torch.testing.assert_close(target_lm_head(tiny_targets[name]), model.get_output_embeddings().weight)
    if name == "gemma3_text":  # tied: the head is the embedding matrix, the layers see it times sqrt(H)
        assert model.config.tie_word_embeddings
        torch.testing.assert_close(target_embeddings(tiny_targets[name]),
                                   target_lm_head(tiny_targets[name]) * TINY_SHAPE["hidden_size"] ** 0.5)


@pytest.mark.parametrize("name", ["gemma3_text", "mistral"])
def test_decoding_past_the_sliding_window_equals_the_targets_greedy(tiny_targets, name):
    """Chains crop rejected drafts from the target's cache and trees verify under a custom mask, both
    far past the 16-token window: the output must still be the target's own greedy text."""
    path = tiny_targets[name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dcfg = draft_config_from_target(path, 64, default_aux_layers(LAYERS))
    draft = Eagle3Draft(dcfg).eval()
    d2t, t2d = vocab_maps(torch.arange(0, 49152, 768)[:64], 49152)  # an untrained draft: rejections everywhere
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    draft.embed_tokens.weight.copy_(target_embeddings(path))
    target = TargetRunner(Target.wrap(model), list(dcfg.aux_layer_ids))
    prompt = list(range(1000, 1030))  # 30 tokens: the window is passed before decoding starts
    own = target_generate(target, prompt, max_new_tokens=24, eos=set(), sampler=Sampler()).tokens
    chain = speculative_generate(target, DraftRunner(draft), prompt, k=3, max_new_tokens=24, eos=set(),
                                 sampler=Sampler()).tokens
    tree = tree_generate(target, DraftRunner(draft), prompt, branching=(3, 2), max_new_tokens=24, eos=set()).tokens
    assert chain == own and tree == own


def test_default_layers_are_distinct_for_small_targets():
    for layers in range(4, 64):
        eagle3 = default_aux_layers(layers)
        assert len(set(eagle3)) == 3 and eagle3 == sorted(eagle3) and 0 <= eagle3[0] and eagle3[-1] <= layers - 2
        if layers >= 7:
            assert eagle3 == [1, layers // 2 - 1, layers - 4]  # SGLang's default wherever it is distinct
        if layers >= 6:
            dflash = dflash_default_layers(layers)
            assert len(set(dflash)) == 5 and dflash == sorted(dflash) and dflash[-1] <= layers - 2
    assert default_aux_layers(4) == [0, 1, 2] and dflash_default_layers(36) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="tappable"):
        dflash_default_layers(4)


GEMMA_PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colours are",
                 "A haiku is a short poem that", "The largest planet in the solar system is",
                 "To make a cup of tea, first"]


@pytest.mark.slow
def test_gemma3_270m_end_to_end(tmp_path):
    """The second real target: Gemma-3-270M (base, 262,144 tokens, no chat template, so plain-text
    completion) through regen, capture, train, export, eval and the gate, on the CPU."""
    import resource

    from specfoundry.capture.stage import CaptureConfig, run_capture
    from specfoundry.eval.evaluate import EvalConfig, run_eval
    from specfoundry.families.eagle3.options import Eagle3Options
    from specfoundry.generate.backends.interface import SamplingConfig
    from specfoundry.generate.regen import RegenConfig, run_regen
    from specfoundry.train.trainer import TrainConfig, run_train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p},
                                                                        {"role": "assistant", "content": "-"}]}) + "\n"
                               for i, p in enumerate(GEMMA_PROMPTS)))
    target = "gemma3-270m"
    run_regen(RegenConfig(source=str(prompts), output=str(tmp_path / "regen"), target=target, device="cpu",
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=32)), silent=True)
    manifest = run_capture(CaptureConfig(source=str(tmp_path / "regen"), output=str(tmp_path / "features"),
                                         target=target, device="cpu"), silent=True)
    assert manifest["chat_template_source"] == "completion" and manifest["target"]["vocab_size"] == 262144
    assert manifest["aux_layer_ids"] == [1, 8, 14]  # L = 18
    run_train(TrainConfig(featureset=str(tmp_path / "features"), output=str(tmp_path / "train"), target=target,
                          eagle3=Eagle3Options(draft_vocab_size=2048, ttt_length=3), lr=3e-3, warmup_steps=5,
                          max_steps=40, eval_fraction=0.0, save_every=40, num_workers=0, loss_kernel="reference",
                          attention="sdpa", log_every=10**9), silent=True)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert history[-1]["loss_0"] < 0.8 * history[0]["loss_0"], (history[0], history[-1])
    report = run_eval(EvalConfig(draft=str(tmp_path / "train"), output=str(tmp_path / "eval"), target=target,
                                 prompt_sets=(str(prompts),), k=3, max_new_tokens=24, device="cpu",
                                 dtype="float32"), silent=True)
    cfg = GateConfig(output=str(tmp_path / "gate"), target=target, device="cpu", max_new_tokens=48)
    checks, ok, message = run_gate(cfg)
    print(f"loss_0 {history[0]['loss_0']:.3f} -> {history[-1]['loss_0']:.3f}; eval {json.dumps(report)[:400]}; "
          f"{message}; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    assert ok, message
