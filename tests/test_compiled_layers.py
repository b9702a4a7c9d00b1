"""sf-capture --compile-layers (common/compiled_layers.py): decoder layers, or their attention
blocks and norms, through torch.compile tap the features the eager layers do; the tap's hooks
still fire; `off` undoes it; an unknown choice is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

import specfoundry.common.compiled_layers as compiled_layers
from specfoundry.common.compiled_layers import compile_layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specfoundry.common.target import resolve_target
    from specfoundry.testing import write_tiny_target

    root = tmp_path_factory.mktemp("compiled")
    smol = resolve_target("smollm2")
    return {m: write_tiny_target(m, root / m, smol) for m in ("llama", "qwen3_moe")}


@pytest.mark.parametrize("how", ["attention", "layer"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_compiled_layers_tap_the_eager_features(tiny, model_type, how, monkeypatch):
    """aot_eager on a CPU (the module's BACKEND note): dynamo's trace and AOT autograd's graph of
    the same ATen ops, with dynamic shapes, over two batch shapes (a recompile or a shape guard bug
    would show on the second). fp32: the decompositions (RMSNorm into pow, mean, rsqrt) may
    reorder a sum of at most H = 64 terms, ~64 * 2^-24 relative a layer over 8 layers, far under
    1e-5; a skipped norm or a layer run twice moves the features by O(1)."""
    from specfoundry.common.experts import experts_modules
    from specfoundry.common.target import Target

    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    target = Target.load(str(tiny[model_type]), device="cpu", dtype=torch.float32)
    batches = [torch.randint(100, 20000, shape, generator=torch.Generator().manual_seed(0)) for shape in
               ((2, 11), (3, 17))]
    tap = target.tap([1, 3, 5])
    want = [target.prefill(ids, tap) for ids in batches]
    compile_layers(target.model, how)
    experts = experts_modules(target.model)
    assert bool(experts) == (model_type == "qwen3_moe")
    # `layer` leaves the routed experts to their implementation (a graph break on each side)
    assert all(("forward" in m.__dict__) == (how == "layer") for m in experts)
    torch._dynamo.utils.counters.clear()
    got = [target.prefill(ids, tap) for ids in batches]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled code ran
    compile_layers(target.model, "off")
    again = target.prefill(batches[0], tap)
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.abs().max() > 0.1
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    for a, b in zip(want[0], again, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # off: the eager modules again
    layer = target.model.model.layers[0]
    assert "forward" not in layer.__dict__ and layer._compiled_call_impl is None
    assert not any("forward" in m.__dict__ for m in experts)
    assert hasattr(layer, "_sf_compiled_forward") == (how == "layer")
    assert hasattr(layer.self_attn, "_sf_compiled_call") == (how == "attention")


def test_an_unknown_choice_or_a_layer_without_the_parts_is_refused_changing_nothing(tiny):
    """One line naming the choice; `attention` on a model one of whose layers lacks a norm is
    refused before any layer is compiled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    with pytest.raises(ValueError, match="--compile-layers 'mlp': choose one of off, attention, layer"):
        compile_layers(model, "mlp")
    del model.model.layers[2].post_attention_layernorm
    with pytest.raises(ValueError, match="has no post_attention_layernorm; use --compile-layers layer or off"):
        compile_layers(model, "attention")
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules())


def test_a_capture_with_compiled_layers_stores_the_eager_features(tiny, chat_file, tmp_path, monkeypatch):
    """sf-capture --compile-layers layer (aot_eager, as above) writes the feature set an eager capture
    writes, up to one bf16 rounding step of the stored values (2^-8 relative, here the fp32
    features differ by ~1e-7 relative, so a stored value moves by at most one step where it lay
    on a rounding boundary), records the choice, and hands a target it was given back eager."""
    from specfoundry.capture.stage import CaptureConfig, run_capture
    from specfoundry.common.target import Target
    from specfoundry.featureset.store import FeatureSet

    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    target = Target.load(str(tiny["llama"]), device="cpu", dtype=torch.float32)
    sets = {}
    for how in ("off", "layer"):
        cfg = CaptureConfig(source=str(chat_file), output=str(tmp_path / how), target=str(tiny["llama"]),
                            shard_size=4, compile_layers=how)
        assert run_capture(cfg, silent=True, target=target)["complete"]
        sets[how] = FeatureSet(tmp_path / how)
    recorded = json.loads((tmp_path / "layer" / "capture_config.json").read_text())
    assert recorded["compile_layers"] == "layer"
    assert "forward" not in target.model.model.layers[0].__dict__
    assert len(sets["off"]) == len(sets["layer"]) > 0
    for i in range(len(sets["off"])):
        a, b = sets["off"][i], sets["layer"][i]
        assert torch.equal(a.input_ids, b.input_ids)
        torch.testing.assert_close(b.aux_hidden.float(), a.aux_hidden.float(), rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(b.final_hidden.float(), a.final_hidden.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["attention", "layer"])
@pytest.mark.parametrize("experts", ["grouped_mm", "sf_fused"])
def test_inductor_compiled_layers_tap_the_eager_features_on_a_gpu(tiny, how, experts):
    """The same through inductor on CUDA (fp32, TF32 off), Qwen3-MoE with each GPU experts
    implementation. Inductor fuses the norms' and the rotary's chains, reordering their fp32 sums:
    at most ~n * 2^-24 relative each (n <= 64 here), over 8 layers well under 1e-5."""
    from specfoundry.common.experts import FUSED_EXPERTS
    from specfoundry.common.placement import Placement
    from specfoundry.common.target import Target
    from specfoundry.kernels.fused_moe import register_fused_experts

    register_fused_experts(FUSED_EXPERTS)
    torch._dynamo.reset()
    target = Target.load(str(tiny["qwen3_moe"]), device="cuda", dtype=torch.float32,
                         placement=Placement(experts_implementation=experts))
    tap = target.tap([1, 3, 5])
    ids = torch.randint(100, 20000, (3, 17), generator=torch.Generator().manual_seed(0))
    want = target.prefill(ids, tap)
    compile_layers(target.model, how)
    got = target.prefill(ids, tap)
    compile_layers(target.model, "off")
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
