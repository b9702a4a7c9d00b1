"""The fused experts kernel (kernels/fused_moe.py) against its plain torch reference, its routing
layout, and its seam into transformers' ExpertsInterface.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest), so shapes stay small; the GPU tests
(`-m gpu`) run the real kernel at real shapes.
"""

from __future__ import annotations

import pytest
import torch

from specfoundry.common.experts import FUSED_EXPERTS, unsupported_layout
from specfoundry.kernels.fused_moe import (
    MoeLaunch,
    align_slots,
    fused_experts,
    fused_experts_reference,
    register_fused_experts,
)
from tests.test_slots import GRAPH_DEVICES

U32 = 2.0 ** -24  # fp32 unit roundoff
UBF16 = 2.0 ** -8  # bf16 unit roundoff


def routing(n: int, e: int, k: int, *, seed: int = 0, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [n, k] (distinct experts per token) and top_k_weights [n, k]. skew: every
    token's first slot on expert 0 and the rest on the lowest ids (many experts left empty)."""
    g = torch.Generator().manual_seed(seed)
    if skew:
        idx = torch.arange(k).expand(n, k).clone()
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return idx, torch.rand(n, k, generator=g)


def weights(h: int, i: int, e: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(7, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / h ** 0.5,
            torch.randn(e, h, i, generator=g) / i ** 0.5)


def magnitude(x, gate_up, down, idx, w) -> torch.Tensor:
    """m [N, H] = sum_k |w_nk| * (|W_down[e]| @ |h_nk|) in fp64, h = silu(gate) * up: the sum of
    the absolute values of the terms each output adds up, which bounds its rounding error."""
    x, gate_up, down, w = (t.double() for t in (x, gate_up, down, w))
    inter = gate_up.shape[1] // 2
    m = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            if e >= gate_up.shape[0]:
                continue
            gu = gate_up[e] @ x[n]
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            m[n] += w[n, k].abs() * (down[e].abs() @ h.abs())
    return m


SHAPES = [  # (tokens, hidden, intermediate, experts, top_k)
    (1, 16, 16, 4, 1),  # one token, one slot
    (7, 48, 40, 5, 2),  # ragged against the 16-wide interpreter tiles
    (13, 32, 24, 16, 3),  # more experts than slots reach: empty experts
    (20, 16, 32, 3, 3),  # every expert in every token
]


@pytest.mark.parametrize("n,h,i,e,k", SHAPES)
@pytest.mark.parametrize("skew", [False, True])
def test_align_slots_puts_every_slot_once_in_a_block_of_its_expert(n, h, i, e, k, skew):
    idx, _ = routing(n, e, k, skew=skew)
    block_m = 16
    slot_of_row, expert_of_block = align_slots(idx, e, block_m)
    slots = n * k
    assert slot_of_row.numel() % block_m == 0 and expert_of_block.numel() == slot_of_row.numel() // block_m
    used = slot_of_row[slot_of_row < slots].long()
    assert sorted(used.tolist()) == list(range(slots))  # each slot exactly once
    expert_of_row = expert_of_block.repeat_interleave(block_m).long()
    rows = torch.nonzero(slot_of_row < slots).squeeze(1)
    assert torch.equal(expert_of_row[rows], idx.reshape(-1)[slot_of_row[rows].long()])
    # the blocks in use come first, then only -1; no block of an expert without slots
    in_use = expert_of_block >= 0
    assert not in_use[in_use.long().sum():].any()
    assert set(expert_of_block[in_use].tolist()) == set(idx.reshape(-1).tolist())


def test_align_slots_leaves_expert_parallel_sentinels_out():
    idx = torch.tensor([[0, 5], [3, 1], [9, 2]])  # 4 local experts: 5 and 9 are another rank's
    slot_of_row, expert_of_block = align_slots(idx, 4, 16)
    used = sorted(slot_of_row[slot_of_row < 6].tolist())
    assert used == [0, 2, 3, 5]  # slots 1 (expert 5) and 4 (expert 9) have no row
    assert expert_of_block[expert_of_block >= 0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("n,h,i,e,k", SHAPES)
@pytest.mark.parametrize("skew", [False, True])
def test_kernel_equals_reference_in_fp32(n, h, i, e, k, skew):
    x, gate_up, down = weights(h, i, e)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(2))
    idx, w = routing(n, e, k, skew=skew)
    got = fused_experts(x, gate_up, down, idx, w)
    want = fused_experts_reference(x.double(), gate_up.double(), down.double(), idx, w.double())
    # Both GEMMs accumulate fp32 products in another order than fp64: each is off by at most
    # (length) * u * (sum of |terms|). The gate/up error reaches the output through silu (slope
    # <= 1.1) times |up| and the down GEMM, so the bound is (H + I + K) * u * magnitude, times 4 for
    # that amplification; a wrong row, expert or weight is off by O(magnitude).
    bound = 4 * (h + i + k) * U32 * magnitude(x, gate_up, down, idx, w)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=float(bound.max()))
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("n,h,i,e,k", SHAPES[1:3])
def test_kernel_equals_reference_in_bf16(n, h, i, e, k):
    x, gate_up, down = (t.bfloat16() for t in weights(h, i, e))
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(2)).bfloat16()
    idx, w = routing(n, e, k)
    w = w.bfloat16()
    got = fused_experts(x, gate_up, down, idx, w)
    assert got.dtype == torch.bfloat16
    want = fused_experts_reference(x.double(), gate_up.double(), down.double(), idx, w.double())
    # From the same bf16 inputs, the kernel rounds three times: h to bf16 (relative u each, so at
    # most u * magnitude after the down GEMM), each slot's weighted row to bf16 (u * magnitude)
    # and the sum (u * |y| <= u * magnitude): 3 u * magnitude, plus the fp32 accumulation, far
    # below. A wrong tile or mask is off by O(magnitude).
    bound = 3.5 * UBF16 * magnitude(x, gate_up, down, idx, w)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=float(bound.max()))
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


def test_expert_parallel_sentinels_add_nothing():
    x, gate_up, down = weights(16, 16, 4)
    idx = torch.tensor([[0, 5], [3, 1], [9, 2], [4, 4]])  # ids >= 4: experts of another rank
    w = torch.rand(4, 2)
    x = x[:4]
    got = fused_experts(x, gate_up, down, idx, w, sentinels=True)
    want = fused_experts_reference(x, gate_up, down, idx, w)
    assert torch.equal(got[3], torch.zeros(16))  # both slots elsewhere
    torch.testing.assert_close(got, want, rtol=0, atol=64 * 32 * U32 * float(want.abs().max()))


def test_launch_tiles_do_not_change_the_result():
    """The block layout is a launch choice (benchmarks sweep it): two tilings agree to rounding."""
    x, gate_up, down = weights(48, 40, 5)
    idx, w = routing(7, 5, 2)
    a = fused_experts(x, gate_up, down, idx, w, launch=MoeLaunch.uniform(16, 16, 16))
    b = fused_experts(x, gate_up, down, idx, w, launch=MoeLaunch.uniform(32, 32, 32))
    bound = 4 * (48 + 40 + 2) * U32 * magnitude(x, gate_up, down, idx, w)
    torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=2 * float(bound.max()))


def test_the_output_comes_back_in_the_callers_dtype():
    """Under autocast the hidden states can be fp32 beside bf16 weights: the kernel computes in the
    weights' dtype and returns the caller's, as transformers' implementations do."""
    x, gate_up, down = weights(16, 16, 4)
    idx, w = routing(7, 4, 2)
    out = fused_experts(x, gate_up.bfloat16(), down.bfloat16(), idx, w)
    assert out.dtype == torch.float32 and out.shape == (7, 16)


def test_no_tokens_gives_an_empty_output():
    x, gate_up, down = weights(16, 16, 4)
    out = fused_experts(x[:0], gate_up, down, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 16)


# ---- the seam into transformers ---------------------------------------------------------------------

def test_registered_under_its_name_in_the_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    register_fused_experts(FUSED_EXPERTS)
    register_fused_experts(FUSED_EXPERTS)  # idempotent
    assert FUSED_EXPERTS in ALL_EXPERTS_FUNCTIONS


def test_gpt_oss_experts_are_named_as_unsupported():
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    why = unsupported_layout(GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=16, num_local_experts=4)))
    assert why is not None and "GptOssExperts" in why and "gpt-oss" in why
    qwen = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    assert unsupported_layout(Qwen3MoeExperts(qwen)) is None



def test_auto_picks_the_fused_experts_on_one_gpu_where_they_run(monkeypatch):
    """`auto` on a GPU: sf_fused for the kernel's layout in one process on one device once a command
    registered it; grouped_mm for gpt-oss's layout, unregistered, several processes or a model over
    several devices; eager on CPU. (The choice only: device_type is a name here, nothing runs.)"""
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from specfoundry.common.experts import resolve_experts

    qwen = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2))
    oss = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=16, num_local_experts=4))
    register_fused_experts(FUSED_EXPERTS)
    assert resolve_experts("auto", "cuda", qwen) == FUSED_EXPERTS
    assert resolve_experts("auto", "cuda", oss) == "grouped_mm"
    assert resolve_experts("auto", "cpu", qwen) == "eager"
    assert resolve_experts("grouped_mm", "cuda", qwen) == "grouped_mm"  # a name given is kept
    assert resolve_experts("auto", "cuda", qwen, devices=2) == "grouped_mm"  # --device-map over two GPUs
    from transformers import Qwen3MoeForCausalLM

    from specfoundry.common.experts import set_experts

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               num_experts=4, num_experts_per_tok=2))
    assert set_experts(model, "auto", "cuda") == FUSED_EXPERTS
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # as accelerate's dispatch leaves it
    assert set_experts(model, "auto", "cuda") == "grouped_mm"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    assert resolve_experts("auto", "cuda", qwen) == "grouped_mm"
    monkeypatch.undo()
    monkeypatch.delitem(ALL_EXPERTS_FUNCTIONS._global_mapping, FUSED_EXPERTS)
    assert resolve_experts("auto", "cuda", qwen) == "grouped_mm"

# ---- targets run with it ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from specfoundry.common.target import resolve_target
    from specfoundry.testing import write_tiny_target

    root = tmp_path_factory.mktemp("moe")
    smol = resolve_target("smollm2")
    return {m: write_tiny_target(m, root / m, smol) for m in ("qwen3_moe", "deepseek_v3", "glm4_moe")}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_features_with_the_fused_experts_equal_the_eager_ones(tiny_moe, model_type):
    """A Target loaded with --experts-implementation sf_fused taps the features the eager loop
    does. Not bit for bit: each expert's dots add in another order (fp32 here, IEEE). Per layer that
    is a few ulps of the layer's magnitude (about 1e-7 relative), over 8 layers; the tolerance,
    1e-5 relative plus 1e-5 of the tensor's largest value, is a hundred times that and far below a
    wrong expert, weight or token, which moves the features by O(1)."""
    from specfoundry.common.placement import Placement
    from specfoundry.common.target import Target

    register_fused_experts(FUSED_EXPERTS)
    ids = torch.randint(100, 20000, (2, 11), generator=torch.Generator().manual_seed(0))
    got = {}
    for name in ("eager", FUSED_EXPERTS):
        target = Target.load(str(tiny_moe[model_type]), device="cpu", dtype=torch.float32,
                             placement=Placement(experts_implementation=name))
        assert target.placement.experts_implementation == name
        got[name] = target.prefill(ids, target.tap([1, 3, 5]))
    for want, have in zip(got["eager"], got[FUSED_EXPERTS], strict=True):
        assert want.abs().max() > 0.1
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_experts_are_found_as_older_transformers_mark_them(tiny_moe, monkeypatch):
    """transformers 5.17 (the H100/H200 image's) marks an experts module without 5.25's
    `_is_expert_parallel`: found all the same (when it was not, a benchmark measured Qwen3-MoE as a
    dense model), and the fused forward runs on it. Sentinels are then expected only where several
    processes run (expert parallelism needs them): one process skips the zero fill, two handle them."""
    from transformers import AutoModelForCausalLM

    from specfoundry.common.experts import experts_modules
    from specfoundry.kernels.fused_moe import expert_parallel, fused_experts_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_moe["qwen3_moe"])
    found = experts_modules(model)
    assert len(found) == model.config.num_hidden_layers
    assert not expert_parallel(found[0])  # 5.25's flag, False here
    for m in found:
        del m._is_expert_parallel
    assert experts_modules(model) == found
    m, x = found[0], torch.randn(5, model.config.hidden_size)
    w = torch.full((5, 2), 0.5)
    assert not expert_parallel(m)  # one process
    idx = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]])
    want = fused_experts_reference(x, m.gate_up_proj.detach(), m.down_proj.detach(), idx, w)
    with torch.no_grad():
        torch.testing.assert_close(fused_experts_forward(m, x, idx, w), want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    assert expert_parallel(m)
    idx = torch.tensor([[0, 1]] * 4 + [[m.num_experts, 2]])  # the last token's first slot: a sentinel
    want = fused_experts_reference(x, m.gate_up_proj.detach(), m.down_proj.detach(), idx, w)
    with torch.no_grad():
        torch.testing.assert_close(fused_experts_forward(m, x, idx, w), want, rtol=1e-5, atol=1e-6)


def test_auto_is_eager_on_cpu_and_a_dense_target_ignores_the_choice(tiny_moe, capsys):
    from specfoundry.common.placement import Placement
    from specfoundry.common.target import Target

    moe = Target.load(str(tiny_moe["qwen3_moe"]), device="cpu", placement=Placement())
    assert moe.placement.experts_implementation == "eager" == moe.model.config._experts_implementation
    assert "experts run eager" in capsys.readouterr().err
    dense = Target.load("smollm2", device="cpu", placement=Placement(experts_implementation="grouped_mm"))
    assert dense.placement.experts_implementation == "grouped_mm"  # nothing to set: kept as given
    assert "experts run" not in capsys.readouterr().err


def test_the_fused_experts_refuse_what_they_cannot_run(tiny_moe, monkeypatch):
    """One line naming the fallback: off CUDA (outside the interpreter), unregistered."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from specfoundry.common.experts import set_experts
    from specfoundry.common.placement import PlacementError

    model = AutoModelForCausalLM.from_pretrained(tiny_moe["qwen3_moe"])
    register_fused_experts(FUSED_EXPERTS)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(PlacementError, match="runs on a CUDA device; on cpu use eager"):
        set_experts(model, FUSED_EXPERTS, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(ALL_EXPERTS_FUNCTIONS._global_mapping, FUSED_EXPERTS)
    with pytest.raises(PlacementError, match="this command does not offer it; use grouped_mm"):
        set_experts(model, FUSED_EXPERTS, "cpu")



@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_moe_target_decodes_through_captured_steps_with_the_fused_experts(tmp_path, device):
    """A tiny Qwen3-MoE in the decoding core with sf_fused (on a GPU: what `auto` picks) and captured
    steps (CUDA graphs; on a CPU graphs.py's stand-in, under which any read of a device value by the
    host fails, as it would fail a capture): the padded prefill and a verify of 5 give the eager
    loop's logits and taps, uncaptured (the cache's columns and crops are the dense tests' in
    test_decoding.py). In fp32 (IEEE dots, no TF32) the two differ by each expert dot's summation
    order, a few ulps a layer (test_features_with_the_fused_experts_equal_the_eager_ones), far inside
    1e-5 of the logits' largest value; a wrong expert, token or cache column moves them by O(1)."""
    from specfoundry.common.placement import Placement
    from specfoundry.common.target import Target, resolve_target
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.testing import write_tiny_target

    path = write_tiny_target("qwen3_moe", tmp_path / "moe", resolve_target("smollm2"), num_hidden_layers=2)
    register_fused_experts(FUSED_EXPERTS)  # (two layers: Triton's interpreter is slow)
    runs = {}
    for name, graphs in (("eager", False), ("auto" if device == "cuda" else FUSED_EXPERTS, True)):
        target = Target.load(str(path), device=device, dtype=torch.float32,
                             placement=Placement(experts_implementation=name))
        assert target.placement.experts_implementation == ("eager" if name == "eager" else FUSED_EXPERTS)
        runner = TargetRunner(target, [0], graphs=graphs)
        runner.reset(64)
        got = [runner.forward(list(range(100, 111)))]  # the prompt: a captured prefill (bucket 16)
        got.append(runner.forward([300, 301, 302, 303, 304]))
        runs[graphs] = [(logits.clone(), aux.clone()) for logits, aux, _ in got]
    for (want_logits, want_aux), (logits, aux) in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5 * want_logits.abs().max().item())
        torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-5 * want_aux.abs().max().item())


# ---- on the GPU, at real shapes -----------------------------------------------------------------------

def reference_and_magnitude(x, gate_up, down, idx, w):
    """The fp32 reference from the bf16 inputs and each row's magnitude sum_k |w| (|W_down| @ |h|)
    (h from the reference), expert by expert with that expert's weights alone in fp32: every
    expert's weights in fp32 at once are 28 GiB at DeepSeek-V3's shape, and a gather per token
    (W[idx]) hundreds."""
    inter = gate_up.shape[1] // 2
    want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, H]
    mag = torch.zeros_like(want)
    wmax = w.float().abs().max()
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(idx == e)  # [M], [M]
        if token.numel() == 0:
            continue
        gu = x[token].float() @ gate_up[e].float().T  # [M, 2I]
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]  # [M, I]
        want.index_add_(0, token, (h @ down[e].float().T) * w[token, slot, None].float())
        mag.index_add_(0, token, (h.abs() @ down[e].float().abs().T) * wmax)
    return want, mag


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,h,i,e,k", [(4096, 2048, 768, 128, 8),  # Qwen3-30B-A3B's layer
                                            (1024, 7168, 2048, 256, 8),  # DeepSeek-V3's
                                            (3, 2048, 768, 128, 8)])  # a decode step
def test_kernel_on_the_gpu_equals_grouped_mm_and_the_reference(tokens, h, i, e, k):
    """bf16 on the tensor cores against transformers' grouped_mm path and an fp32 reference from
    the same bf16 inputs: both bf16 paths are within 3.5 u of the terms' magnitude (see the CPU
    test; grouped_mm rounds four times, so the pair is compared at twice that)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    logits = torch.randn(tokens, e, device="cuda", generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    got = fused_experts(x, gate_up, down, idx, w, sentinels=False)
    want, mag = reference_and_magnitude(x, gate_up, down, idx, w)

    class Experts(torch.nn.Module):  # what grouped_mm_experts_forward reads from the module
        gate_up_proj, down_proj, num_experts, has_gate, has_bias = gate_up, down, e, True, False
        is_transposed, has_post_expert_norm, _is_expert_parallel = False, False, False

        def _apply_gate(self, gu):
            gate, up = gu.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    theirs = grouped_mm_experts_forward(Experts(), x, idx, w)
    bound = 3.5 * UBF16 * mag
    assert ((got.float() - want).abs() <= bound + 1e-6).all()
    assert ((got.float() - theirs.float()).abs() <= 2 * bound + 1e-6).all()


def test_capture_records_the_experts_implementation_it_ran(tiny_moe, tmp_path):
    """auto is recorded as what it resolved to (eager on CPU); the features are the same data
    whichever ran, so a rerun with another implementation resumes (placement is resume=False)."""
    import json

    from specfoundry.capture.stage import run_capture
    from specfoundry.common.placement import Placement
    from tests.conftest import CHAT, write_jsonl
    from tests.parallel_job import capture_config

    source = write_jsonl(tmp_path / "chat.jsonl", CHAT[:2])
    run_capture(capture_config(str(tiny_moe["qwen3_moe"]), str(source), tmp_path / "cap", Placement()), silent=True)
    recorded = json.loads((tmp_path / "cap" / "capture_config.json").read_text())
    assert recorded["placement"]["experts_implementation"] == "eager"
    again = capture_config(str(tiny_moe["qwen3_moe"]), str(source), tmp_path / "cap",
                           Placement(experts_implementation="grouped_mm"))
    run_capture(again, silent=True)  # resumes: nothing to redo, no refusal
    recorded = json.loads((tmp_path / "cap" / "capture_config.json").read_text())
    assert recorded["placement"]["experts_implementation"] == "grouped_mm"
