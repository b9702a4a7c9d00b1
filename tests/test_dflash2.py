"""The DFlash2 family: the convolution (identity at init, against the engines' reference loop, causal
within the block), DFlash's math unchanged, the selector's path against a plain-torch enumeration of
the candidates, both selector objectives and the schedule against a plain-torch reference of the
loss, the metrics, the export spec from the engines' loaders and its round trip, the rejection rule
for a proposal on K candidates, greedy equality (through sf-eval too), the gate's fast checks."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from specfoundry.decoding.accept import accept_candidates
from specfoundry.decoding.sampler import Sampler
from specfoundry.families import FAMILIES
from specfoundry.families.dflash.anchors import batch_anchors, block_inputs, valid_slots
from specfoundry.families.dflash.model import DFlashDraft
from specfoundry.families.dflash2.config import DFlash2Config
from specfoundry.families.dflash2.conv import GroupedDynamicCausalConv
from specfoundry.families.dflash2.decode import DFlash2Runner
from specfoundry.families.dflash2.export import expected_tensors, export_draft, load_export, sglang_config
from specfoundry.families.dflash2.loss import dflash2_loss, selector_targets, selector_weight_at
from specfoundry.families.dflash2.model import DFlash2Draft
from specfoundry.families.dflash2.selector import walk
from specfoundry.featureset.batch import Batch
from tests.conftest import (
    assert_export_refuses_tensors,
    chi2_critical,
    edited_export_refusal,
    holed_batch,
    sharp_tiny_target,
)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=97, target_hidden_size=32, target_layer_ids=(1, 2), block_size=5,
            mask_token_id=96, conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5)
EPS32 = torch.finfo(torch.float32).eps


def tiny_draft(seed=0, trained=True, **overrides) -> DFlash2Draft:
    """A random tiny draft; with `trained`, the convolutions and the successor codebook (identity and
    zero at init) drawn too, so that every piece acts."""
    torch.manual_seed(seed)
    draft = DFlash2Draft(DFlash2Config(**{**TINY, **overrides}))
    if trained:
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "_conv." in name:
                    p.add_(torch.randn_like(p) * 0.3)
            draft.candidate_selector.successor_codebook.normal_(0, 1.0)
            draft.candidate_selector.predecessor_codebook.normal_(0, 1.0)
            draft.candidate_selector.hidden_projection.weight.normal_(0, 0.5)  # edges as large as the unary gaps
    return draft


def tiny_batch(lengths=(14, 9), seed=1) -> Batch:
    """Two rows, right-padded, with holes in the loss mask (a prompt, a gap mid-answer)."""
    return holed_batch(lengths, seed, aux_width=2 * 32)


def forward_states(draft, batch, anchors, keep):
    ids, positions = block_inputs(batch.input_ids, anchors, draft.cfg.block_size, draft.cfg.mask_token_id)
    return draft.train_forward(draft.project_context(batch.aux_hidden), ids, positions, anchors, keep,
                               batch.lengths, "sdpa")


# ---- the convolution -------------------------------------------------------------------------------------


def reference_convolve(hidden, dynamic, base, group_size):
    """z-lab's _grouped_dynamic_convolve, verbatim (dflash/model.py at 07ebd93, the commit speculators and vLLM pin): one block's [b, L, H]."""
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        kernel = base[offset].view(1, 1, groups, group_size).to(hidden.dtype)
        output = output + kernel * values
        output = torch.addcmul(output, dynamic[:, :, offset], values)
    return output.view_as(hidden)


@pytest.mark.parametrize("taps, block", [(2, 5), (3, 4), (6, 4)])
def test_the_convolution_is_the_reference_loop_block_by_block(taps, block):
    """prepare and finish on N blocks side by side equal the reference run on each block alone (the
    engines run one block: their shift never crosses it), on random kernels; a tap past the block's
    length reads nothing (6 taps, blocks of 4)."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(16, taps, 4, block)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y = torch.randn(2, 3 * block, 16), torch.randn(2, 3 * block, 16)
    u, delta = conv.prepare(x)
    out = conv.finish(y, delta)
    dynamic = conv.kernel_projection(x).view(2, 3 * block, 2, taps, 4)
    for n in range(3):
        s = slice(n * block, (n + 1) * block)
        base = conv.base_kernel[:, :block]  # the reference's taps past the block shift everything out
        want_u = reference_convolve(x[:, s], dynamic[:, s, 0, :block].contiguous(), base[0], 4)
        want_out = reference_convolve(y[:, s], dynamic[:, s, 1, :block].contiguous(), base[1], 4)
        torch.testing.assert_close(u[:, s], want_u, rtol=0, atol=0)  # the same operations in the same order
        torch.testing.assert_close(out[:, s], want_out, rtol=0, atol=0)


def test_the_convolution_is_causal_within_the_block_and_blind_to_other_blocks():
    torch.manual_seed(1)
    conv = GroupedDynamicCausalConv(16, 2, 4, 4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 12, 16)
    before = conv.prepare(x)[0]
    x2 = x.clone()
    x2[0, 5] += 1.0  # block 1, position 1
    after = conv.prepare(x2)[0]
    changed = (after - before).abs().amax(-1)[0] > 0
    assert changed.tolist() == [False] * 5 + [True, True] + [False] * 5  # itself and the one tap after, no further


def test_a_fresh_draft_is_its_dflash_backbone_bit_for_bit():
    """Identity convolutions: DFlash2's states (training forward and cached decoding) equal DFlash's
    with the same weights, exactly; and DFlash's layer still computes its formula exactly."""
    fresh = tiny_draft(trained=False)
    backbone = DFlashDraft(fresh.cfg)
    missing, unexpected = backbone.load_state_dict(fresh.state_dict(), strict=False)
    assert not missing and all("_conv." in k or k.startswith("candidate_selector.") for k in unexpected)
    backbone.embed_tokens.weight.copy_(fresh.embed_tokens.weight)
    batch = tiny_batch()
    anchors, keep = batch_anchors(batch, 4, 5, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(forward_states(fresh, batch, anchors, keep),
                                   forward_states(backbone, batch, anchors, keep), rtol=0, atol=0)
        layer, h = backbone.layers[0], torch.randn(1, 5, 32)
        attend = lambda attn, x: x * 2.0  # noqa: E731 (any attention: the layer's own arithmetic is checked)
        a = h + attend(layer.self_attn, layer.input_layernorm(h))
        y = layer.post_attention_layernorm(a)
        want = a + layer.mlp["down_proj"](F.silu(layer.mlp["gate_proj"](y)) * layer.mlp["up_proj"](y))
        torch.testing.assert_close(layer(h, attend), want, rtol=0, atol=0)
    trained = tiny_draft()
    with torch.no_grad():
        assert (forward_states(trained, batch, anchors, keep) - forward_states(fresh, batch, anchors, keep)).abs().max() \
            > 1e-2  # the convolutions act once trained


# ---- the selector -----------------------------------------------------------------------------------------


def reference_path(draft, states, head, anchor):
    """Every slot's candidates scored one by one by the formula, in float64, and the greedy walk:
    (tokens [L], realised scores [L, K], their rounding bound [L, K])."""
    sel = draft.candidate_selector
    a, s, p = (t.double() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
    tokens, rows, bounds, prev = [], [], [], anchor
    for t in range(states.shape[0]):
        h = states[t].double()
        unary = head.double() @ h
        candidates = unary.topk(sel.top_k).indices
        g = p @ h
        scores, bound = [], []
        for c in candidates.tolist():
            edge_terms = a[prev] * g * s[c]  # r terms
            scores.append(unary[c] + edge_terms.sum())
            # fp32 sums of n terms are within n * eps of the sum of their magnitudes: the unary's H terms;
            # the edges' r terms, each through g, itself an H-term sum (so H + r + 2 per edge term)
            bound.append(EPS32 * (h.numel() * (head[c].double() * h).abs().sum()
                                  + (h.numel() + a.shape[1] + 2) * (a[prev] * (p.abs() @ h.abs()) * s[c]).abs().sum()))
        scores, bound = torch.stack(scores), torch.stack(bound)
        prev = int(candidates[int(scores.argmax())])
        tokens.append(prev)
        rows.append(scores)
        bounds.append(bound)
    return torch.tensor(tokens), torch.stack(rows), torch.stack(bounds)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_selectors_walk_is_a_plain_enumeration_of_the_candidates(seed):
    draft = tiny_draft(seed=seed)
    g = torch.Generator().manual_seed(seed)
    states, head = torch.randn(4, 32, generator=g), torch.randn(97, 32, generator=g)
    anchor = 17
    with torch.no_grad():
        lattice, candidates = draft.block_lattice(states, head, torch.tensor([anchor]))
        choices, q, rows = walk(lattice, torch.tensor(0.0), torch.zeros(4))
    tokens, want_rows, bound = reference_path(draft, states, head, anchor)
    assert candidates.gather(1, choices[:, None])[:, 0].tolist() == tokens.tolist()
    assert (rows.double() - want_rows).abs().le(bound).all(), ((rows.double() - want_rows).abs() / bound).max()
    assert torch.equal(q, F.one_hot(choices, 5).float())  # greedy: the proposal is a point mass
    # the selector matters here: a walk of the unary logits alone would choose otherwise somewhere
    assert (choices != 0).any()


def test_a_fresh_selector_ranks_by_the_unary_logits():
    draft = tiny_draft(trained=False)
    states, head = torch.randn(4, 32), torch.randn(97, 32)
    with torch.no_grad():
        lattice, _ = draft.block_lattice(states, head, torch.tensor([3]))
        choices, _, _ = walk(lattice, torch.tensor(0.0), torch.zeros(4))
    assert choices.tolist() == [0, 0, 0, 0]


def test_the_sampled_walk_draws_each_slot_by_inverse_cdf_of_its_realised_row():
    draft = tiny_draft()
    states, head = torch.randn(4, 32), torch.randn(97, 32)
    uniforms = torch.tensor([0.05, 0.5, 0.93, 0.999])
    with torch.no_grad():
        lattice, _ = draft.block_lattice(states, head, torch.tensor([3]))
        choices, q, rows = walk(lattice, torch.tensor(0.7), uniforms)
    index = 0
    for t in range(4):
        row = lattice[t, index]
        torch.testing.assert_close(rows[t], row, rtol=0, atol=0)
        want_q = torch.softmax(row / 0.7, -1)
        torch.testing.assert_close(q[t], want_q)
        index = int((torch.cumsum(want_q, 0) <= uniforms[t]).sum())
        assert int(choices[t]) == index


# ---- the loss -----------------------------------------------------------------------------------------------


def reference_loss(draft, batch, head, anchors, keep, gamma, objective, weight, stop_gradient=False):
    """loss.py's docstring by loops over rows, anchors and slots, every candidate scored alone."""
    b, k_top = draft.cfg.block_size, draft.cfg.selector_top_k
    states = forward_states(draft, batch, anchors, keep)
    valid = valid_slots(batch, anchors, keep, b)
    sel = draft.candidate_selector
    num, den = 0.0, 0.0
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[r, n])
            for k in range(1, b):
                if not valid[r, n, k - 1]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                h = states[r, n * b + k]
                y, prev = int(batch.input_ids[r, a + k]), int(batch.input_ids[r, a + k - 1])
                z = head @ h
                num = num + w * F.cross_entropy(z[None], torch.tensor([y]))
                den += w
                hs = h.detach() if stop_gradient else h
                zs = head @ hs
                ids = zs.topk(k_top).indices.tolist()
                if y not in ids:
                    if objective == "topk":
                        continue
                    ids[-1] = y
                g = sel.hidden_projection(hs) * sel.predecessor_codebook[prev]
                scores = torch.stack([zs[c] + (g * sel.successor_codebook[c]).sum() for c in ids])
                num = num + weight * w * F.cross_entropy(scores[None], torch.tensor([ids.index(y)]))
    return num / den


@pytest.mark.parametrize("objective", ["gold", "topk"])
@pytest.mark.parametrize("weight, stop_gradient", [(1.0, False), (0.5, True)])
def test_the_loss_and_its_gradients_are_a_plain_torch_reference(objective, weight, stop_gradient):
    batch, head = tiny_batch(), torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    draft = tiny_draft()
    anchors, keep = batch_anchors(batch, 6, 5, seed=0)
    loss, metrics = dflash2_loss(draft, batch, head, num_anchors=6, gamma=3.0, attention="sdpa", loss_kernel="reference",
                                 selector_loss=objective, selector_weight=weight, stop_gradient=stop_gradient)
    loss.backward()
    got = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    want = reference_loss(draft, batch, head, anchors, keep, 3.0, objective, weight, stop_gradient)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in draft.named_parameters():
        if p.grad is not None or name in got:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert got["candidate_selector.successor_codebook"].abs().sum() > 0
    assert sum(int(m["valid"]) for m in metrics) > 0


def test_gold_is_injected_only_where_the_top_k_miss_it_and_topk_skips_those_rows():
    ids = torch.tensor([[5, 3, 9], [5, 3, 9], [1, 2, 7]])
    labels = torch.tensor([3, 4, 7])
    gold, index, covered, trained = selector_targets(ids, labels, "gold")
    assert gold.tolist() == [[5, 3, 9], [5, 3, 4], [1, 2, 7]] and index.tolist() == [1, 2, 2]
    assert covered.tolist() == [True, False, True] and trained.all()
    strict, index, covered, trained = selector_targets(ids, labels, "topk")
    assert torch.equal(strict, ids) and trained.tolist() == [True, False, True] and index.tolist()[::2] == [1, 2]


def test_strict_top_k_gives_no_selector_loss_or_gradient_where_every_slot_misses():
    """With labels no top K holds (the mask token's id, never a candidate here), topk's selector term
    is zero, gold's is not."""
    batch, head = tiny_batch(), torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    head[96] = 0.0  # logit 0, below the top 5 of 96 random ones (about half of them positive)
    batch = dataclasses.replace(batch, input_ids=torch.full_like(batch.input_ids, 96))
    draft = tiny_draft()
    for objective, zero in (("topk", True), ("gold", False)):
        draft.zero_grad()
        loss, metrics = dflash2_loss(draft, batch, head, num_anchors=6, attention="sdpa", selector_loss=objective)
        loss.backward()
        grad = draft.candidate_selector.successor_codebook.grad
        assert (grad.abs().sum() == 0) == zero, objective
        assert sum(float(m["means"]["selector_loss"][0]) for m in metrics) == 0.0 if zero else True
        assert sum(float(m["rates"]["topk_recall"][0]) for m in metrics) == 0.0


def test_the_selector_weight_follows_specforges_schedule():
    """_selector_alpha: 0 during the warm-up, then (step - warmup + 1) / ramp of alpha, capped."""
    assert [selector_weight_at(s, 100, 2.0, 0.0, 0.0) for s in (0, 50)] == [2.0, 2.0]
    got = [selector_weight_at(s, 100, 2.0, 0.1, 0.05) for s in (0, 9, 10, 11, 14, 15, 99)]
    assert got == [0.0, 0.0, 2.0 * 1 / 5, 2.0 * 2 / 5, 2.0, 2.0, 2.0]
    module = FAMILIES.provider("dflash2")
    from specfoundry.families.dflash2.loss import DFlash2Module

    m = DFlash2Module(tiny_draft(), torch.randn(97, 32), selector_loss_alpha=1.0, selector_warmup_ratio=0.5,
                      selector_ramp_ratio=0.25)
    module.set_progress(m, 3, 8)
    assert m.selector_weight == 0.0
    module.set_progress(m, 4, 8)
    assert m.selector_weight == 0.5



def test_dflash_only_teachers_and_objectives_are_refused_and_alpha_0_freezes_the_selector(tiny_llama_dir):
    from specfoundry.families import Extended
    from specfoundry.families.dflash.options import DFlashOptions
    from specfoundry.families.dflash2.options import DFlash2Options

    family = FAMILIES.provider("dflash2")
    for parent, words in ((DFlashOptions(teacher="soft"), "--teacher soft"),
                          (DFlashOptions(objective="dpace"), "--objective dpace")):
        with pytest.raises(ValueError, match=words):
            family.module(tiny_draft(), "unused", torch.float32, Extended(parent, DFlash2Options()), 0)
    draft = tiny_draft(vocab_size=49152, mask_token_id=49151, hidden_size=64, target_hidden_size=64)
    family.module(draft, tiny_llama_dir, torch.float32, Extended(DFlashOptions(), DFlash2Options()), 0)
    assert all(p.requires_grad for p in draft.candidate_selector.parameters())
    family.module(draft, tiny_llama_dir, torch.float32,
                  Extended(DFlashOptions(), DFlash2Options(selector_loss_alpha=0.0)), 0)
    selector = {id(p) for p in draft.candidate_selector.parameters()}
    assert selector and not selector & {id(p) for p in draft.trainable_parameters()}  # out of the optimizer



def test_frozen_convolutions_stay_the_identity_through_a_step_the_rest_trains(tiny_llama_dir):
    """--freeze-convolutions: the convolutions leave the optimizer and keep their identity kernels
    through a step whose gradient reaches every other parameter."""
    from specfoundry.families import Extended
    from specfoundry.families.dflash.options import DFlashOptions
    from specfoundry.families.dflash2.options import DFlash2Options

    family = FAMILIES.provider("dflash2")
    draft = tiny_draft()
    convs = [c for layer in draft.layers for c in (layer.attention_conv, layer.mlp_conv)]
    before = [{k: v.clone() for k, v in c.state_dict().items()} for c in convs]
    family.module(draft, tiny_llama_dir, torch.float32,
                  Extended(DFlashOptions(), DFlash2Options(freeze_convolutions=True)), 0)
    frozen = {id(p) for c in convs for p in c.parameters()}
    trainable = list(draft.trainable_parameters())
    assert frozen and not frozen & {id(p) for p in trainable}
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    head = torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    loss, _ = dflash2_loss(draft, tiny_batch(), head, num_anchors=6, attention="sdpa")
    loss.backward()
    optimizer.step()
    for conv, kept in zip(convs, before, strict=True):
        for name, value in conv.state_dict().items():
            assert torch.equal(value, kept[name]), name
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    family.module(draft, tiny_llama_dir, torch.float32, Extended(DFlashOptions(), DFlash2Options()), 0)
    assert frozen <= {id(p) for p in draft.trainable_parameters()}  # unfrozen by default

# ---- the metrics sf-train reports ------------------------------------------------------------------------


def test_the_peers_metrics_reach_sf_trains_summary_merged_over_micro_batches():
    """unary_acc and topk_recall per slot (each chained into an acceptance length: topk_recall's is
    the top-K oracle's), the selector's teacher-forced accuracy as acc, its loss and covered accuracy
    per slot: counts summed over two micro-batches as hits and valid are."""
    from types import SimpleNamespace

    from specfoundry.train.metrics import merge_metrics, summarise

    draft, head = tiny_draft(), torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    per_micro = [dflash2_loss(draft, tiny_batch(seed=s), head, num_anchors=6, attention="sdpa")[1] for s in (1, 2)]
    out = summarise(merge_metrics(per_micro, SimpleNamespace(num_processes=1)))
    for k in range(4):
        n = sum(float(m[k]["valid"]) for m in per_micro)
        covered = sum(float(m[k]["rates"]["topk_recall"][0]) for m in per_micro)
        unary = sum(float(m[k]["rates"]["unary_acc"][0]) for m in per_micro)
        hits = sum(float(m[k]["hits"]) for m in per_micro)
        assert out[f"topk_recall_{k}"] == pytest.approx(covered / max(n, 1))
        assert out[f"unary_acc_{k}"] == pytest.approx(unary / max(n, 1))
        assert out[f"acc_{k}"] == pytest.approx(hits / max(n, 1)) and hits <= covered
        assert out[f"selector_covered_acc_{k}"] == pytest.approx(hits / max(covered, 1))
        assert f"selector_loss_{k}" in out
    oracle = sum(math.prod(out[f"topk_recall_{j}"] for j in range(k + 1)) for k in range(4))
    assert out["topk_recall_accept_len"] == pytest.approx(oracle) and oracle >= out["sim_accept_len"]
    assert "unary_acc_accept_len" in out and "selector_loss_accept_len" not in out


# ---- export --------------------------------------------------------------------------------------------------


def test_the_tensor_spec_is_the_engines_at_the_published_shape():
    """z-lab's fixture (dflash2-safetensors-header.json): H 6656, groups of 16, T 2, rank 256 give
    kernel_projection [1664, 6656], base_kernel [2, 2, 6656], hidden_projection [256, 6656] and
    full-vocabulary codebooks [V, 256] with no `.weight`."""
    cfg = DFlash2Config(hidden_size=6656, intermediate_size=17920, num_hidden_layers=5, num_attention_heads=52,
                        num_key_value_heads=4, head_dim=128, vocab_size=202048, target_hidden_size=6656,
                        target_layer_ids=(1, 13, 25, 37, 49), block_size=16, mask_token_id=201818)
    spec = expected_tensors(cfg)
    assert spec["fc.weight"] == (6656, 33280)
    for i in range(5):
        for conv in ("attention_conv", "mlp_conv"):
            assert spec[f"layers.{i}.{conv}.base_kernel"] == (2, 2, 6656)
            assert spec[f"layers.{i}.{conv}.kernel_projection.weight"] == (1664, 6656)
    assert spec["candidate_selector.hidden_projection.weight"] == (256, 6656)
    assert spec["candidate_selector.predecessor_codebook"] == spec["candidate_selector.successor_codebook"] == (
        202048, 256)
    assert not any(k.startswith(("embed_tokens", "lm_head")) or k.endswith("codebook.weight") for k in spec)
    assert len(spec) == 3 + 5 * (11 + 4) + 3


def test_the_export_holds_the_fields_the_loaders_read_and_reads_back(tmp_path):
    """config.json as SGLang's parse_dflash_draft_config and vLLM's qwen3_dflash2.py read it: the
    architecture, model_type, dflash_config's block_size, mask_token_id, target_layer_ids and the four
    DFlash2 fields (vLLM reads them with [], so they must be there); the tensors of the spec; and
    read back as built, recognised as dflash2."""
    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export", target={"num_layers": 4})
    config = json.loads((out / "config.json").read_text())
    assert config == sglang_config(draft.cfg, 4)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 96, "block_size": 5,
                                       "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6,
                                       "selector_top_k": 5}
    # SGLang: the conv pair and the selector pair set together, non-zero
    dc = config["dflash_config"]
    assert bool(dc["conv_kernel_size"]) == bool(dc["conv_group_size"]) and dc["selector_rank"] > 0
    assert FAMILIES.family_of_config(config, "c") == "dflash2"
    cfg, tensors = load_export(out)
    assert cfg == draft.cfg
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_tensors(draft.cfg)
    state = draft.state_dict()
    for name, t in tensors.items():
        torch.testing.assert_close(t, state[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c["dflash_config"].pop("selector_rank"), "lacks 'dflash_config.selector_rank'"),
    (lambda c: c["dflash_config"].pop("conv_kernel_size"), "lacks 'dflash_config.conv_kernel_size'"),
    (lambda c: c["dflash_config"].update(conv_group_size=0), "dflash_config.conv_group_size is 0"),
    (lambda c: c["dflash_config"].update(output_multiplier=0.5), "dflash_config.output_multiplier is 0.5"),
    (lambda c: c["dflash_config"].update(final_logit_softcapping=20.0), "final_logit_softcapping is 20.0"),
    (lambda c: c.update(is_causal=True), "is_causal True"),
    (lambda c: c["dflash_config"].update(conv_group_size=7), "conv_group_size 7 does not divide hidden_size 32"),
])
def test_a_config_the_draft_cannot_be_is_one_line(tmp_path, edit, words):
    draft = tiny_draft()
    message = edited_export_refusal(export_draft(draft.state_dict(), draft.cfg, tmp_path / "export"), edit)
    assert words in message, message


def test_the_identity_transforms_and_is_causal_false_are_read(tmp_path):
    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].update(output_multiplier=1.0, input_embedding_scale=1.0, final_logit_softcapping=0.0)
    config["is_causal"] = False
    (out / "config.json").write_text(json.dumps(config))
    assert load_export(out)[0] == draft.cfg


def test_a_missing_or_misshaped_selector_tensor_is_refused_on_export(tmp_path):
    assert_export_refuses_tensors(export_draft, tiny_draft(), tmp_path, "candidate_selector.successor_codebook",
                                  "layers.0.mlp_conv.base_kernel", (2, 3, 32))


# ---- decoding -----------------------------------------------------------------------------------------------


def test_the_candidate_rule_samples_as_the_target():
    """A draft d drawn from q on K = 3 of V = 8 ids (a selector's proposal: q is zero off its
    candidates, and one candidate has less mass than the target gives it, one more), verified by
    accept_candidates: the first token is distributed as p, whatever q is."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=g) * 1.5
    p = torch.softmax(logits[0], -1)
    candidates = torch.tensor([[6, 1, 3]])
    q = torch.tensor([[0.7, 0.2, 0.1]])
    sampler = Sampler(1.0, torch.Generator().manual_seed(1))
    draws, counts, rejected = 20000, torch.zeros(8), 0
    for _ in range(draws):
        d = int(candidates[0, torch.multinomial(q[0], 1, generator=g)])
        a, bonus = accept_candidates([d], candidates, q, torch.cat([logits, logits]), sampler)
        counts[d if a == 1 else bonus] += 1
        rejected += a == 0
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(7), (chi2, counts, expected)
    assert rejected > draws // 10
    q_full = torch.zeros(8).index_put_((candidates[0],), q[0])  # power: q itself is far from p
    assert float(((q_full * draws - expected) ** 2 / expected).sum()) > 100 * chi2_critical(7)


def tiny_target_and_draft(vocab=6, seed=0):
    """A random 4-layer target over a 6-token vocabulary (sharp: rejections happen) and a random
    DFlash2 draft of its shape proposing blocks of 3 from the top 3 of 6 (so q has zeros)."""
    from specfoundry.common.target import Target

    model = sharp_tiny_target(vocab, seed)
    draft = tiny_draft(seed, vocab_size=vocab, target_layer_ids=(0, 1, 2), block_size=3, mask_token_id=vocab - 1,
                       selector_top_k=3).eval()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    return model, Target.wrap(model), draft


def test_sampled_dflash2_decoding_is_distributed_as_the_target():
    """The first two tokens of DFlash2Decoder's sampled decode (the second through a round: the
    selector's sampled walk, verified against the q it drew from) against the target's exact
    two-token distribution; 600 whole decodes (the chi-square test keeps its 0.001 level at any n,
    and each decode is a few eager forwards on 2 shared cores)."""
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.families.dflash2.decode import DFlash2Decoder

    vocab, prompt, n = 6, [1, 2, 3], 600
    model, target, draft = tiny_target_and_draft(vocab)
    runner = TargetRunner(target, [0, 1, 2])
    decoder = DFlash2Decoder(DFlash2Runner(draft, target.lm_head()))
    sampler = Sampler(1.0, torch.Generator().manual_seed(0))
    counts, rejected = torch.zeros(vocab * vocab, dtype=torch.float64), 0
    for _ in range(n):
        out = decoder.generate(runner, prompt, max_new_tokens=2, eos=set(), sampler=sampler)
        counts[out.tokens[0] * vocab + out.tokens[1]] += 1
        rejected += out.accepted[0] < 2
    assert rejected > n // 10, "the draft should disagree with the target often enough to test rejection"
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        p = torch.stack([p1[t] * torch.softmax(model(torch.tensor([prompt + [t]])).logits[0, -1], -1)
                         for t in range(vocab)]).flatten().double()
    keep = p * n >= 5  # chi-square needs expected counts >= 5; pool the rest into one cell
    expected = torch.cat([p[keep] * n, (p[~keep] * n).sum()[None]])
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    stat = (((observed - expected) ** 2) / expected.clamp(min=1e-9)).sum().item()
    assert stat < chi2_critical(int(keep.sum())), stat


def test_greedy_dflash2_decoding_equals_the_targets_greedy(tiny_llama_dir):
    """A random DFlash2 draft, and the same draft nudged to put the target's own token first among
    its candidates at two of every three positions (so that proposals are accepted, partly): both
    decode to the target's greedy output, token for token."""
    from specfoundry.common.target import Target
    from specfoundry.common.weights import target_embeddings
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.dflash2.decode import DFlash2Decoder

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    base = dflash_config_from_target(tiny_llama_dir, [1, 3, 5], 2, 4, 49151).to_dict()
    torch.manual_seed(0)
    draft = DFlash2Draft(DFlash2Config.from_dict({**base, "selector_rank": 8, "selector_top_k": 4})).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
    prompt, n = list(range(100, 112)), 24
    ref = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    runner_target = TargetRunner(target, [1, 3, 5])
    decoder = DFlash2Decoder(DFlash2Runner(draft, target.lm_head()))
    assert decoder.generate(runner_target, prompt, max_new_tokens=n, eos=set(), sampler=Sampler()).tokens == ref

    full, block, logits = prompt + ref, draft.decode_block, draft.base_logits
    at = {"p": 0}

    def counted_block(ids, positions, cache):
        at["p"] = len(cache)  # the bonus's position
        return block(ids, positions, cache)

    def nudged(states, head):  # +1e4 on the target's own token at 2 of 3 positions
        out = logits(states, head).clone()
        for t in range(out.shape[0]):  # (only decoding runs here: its slots 1..B-1)
            pos = at["p"] + 1 + t
            if pos < len(full) and pos % 3:
                out[t, full[pos]] += 1e4
        return out

    draft.decode_block, draft.base_logits = counted_block, nudged
    out = decoder.generate(runner_target, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    runner_target.remove_hooks()
    assert out.tokens == ref
    assert 0 < sum(out.accepted) < 3 * len(out.accepted), out.accepted


def test_sf_eval_decodes_a_dflash2_export_as_the_target_does(tiny_llama_dir, tmp_path):
    """The public sf-eval run over an exported (untrained) DFlash2 draft of the tiny target: its
    greedy output is the target's own on every prompt, B - 1 proposals a round."""
    from specfoundry.eval.evaluate import EvalConfig, run_eval
    from tests.test_families import family_options, stub_featureset

    family, options = FAMILIES.provider("dflash2"), family_options("dflash2", tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    export = family.export(draft.state_dict(), dcfg, tmp_path / "export", None)
    report = run_eval(EvalConfig(draft=str(export), target=str(tiny_llama_dir), output=str(tmp_path / "eval"),
                                 prompt_sets=("chat",), limit=2, max_new_tokens=12, device="cpu", dtype="float32"),
                      silent=True)
    assert report["family"] == "dflash2" and report["config"]["k"] == dcfg.block_size - 1
    assert report["draft_training_steps"] is None  # an export no training wrote
    chat = report["sets"]["chat"]["trained"]
    assert chat["identical_to_target"] == "2/2" and len(chat["accept_rate_by_position"]) == dcfg.block_size - 1


# ---- the gate ---------------------------------------------------------------------------------------------------


def test_the_positions_check_names_a_selector_fed_the_wrong_predecessor_and_fit_an_untrained_draft(tiny_llama_dir):
    """Fast cases of the gate's DFlash2 checks on a random draft: positions passes for the real
    decoder and fails when decoding's lattice reads the mask token as the anchor; fit fails."""
    from types import SimpleNamespace

    from specfoundry.common.weights import target_embeddings, target_lm_head
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.dflash2.gate import check_positions_and_fit

    base = dflash_config_from_target(tiny_llama_dir, [1, 3, 5], 2, 4, 49151).to_dict()
    torch.manual_seed(0)
    draft = DFlash2Draft(DFlash2Config.from_dict({**base, "selector_rank": 8, "selector_top_k": 4})).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    with torch.no_grad():  # edges that dominate the unary gaps
        draft.candidate_selector.successor_codebook.normal_(0, 100)
    g = torch.Generator().manual_seed(2)
    sample = SimpleNamespace(input_ids=torch.randint(0, 1000, (20,), generator=g),
                             loss_mask=torch.arange(20) >= 6, aux_hidden=torch.randn(20, 3 * 64, generator=g))
    runner = DFlash2Runner(draft, target_lm_head(tiny_llama_dir).float())
    positions, fit = check_positions_and_fit(runner, sample)
    assert positions.ok and not fit.ok, (positions, fit)
    lattice = draft.candidate_selector.lattice

    def masked(unary, ids, hidden, anchor):  # decoding's first slot after the mask token, not the bonus
        return lattice(unary, ids, hidden, torch.full_like(anchor, draft.cfg.mask_token_id))

    draft.candidate_selector.lattice = masked
    positions, _ = check_positions_and_fit(runner, sample)
    assert not positions.ok and "differs" in positions.detail, positions


@pytest.mark.slow
def test_dflash2_gate_passes_on_the_tiny_target_and_names_broken_pieces(tiny_llama_dir, tmp_path):
    """The whole gate (regen, capture, train 60 steps, export, checks) on the tiny Llama target, hence
    slow; its checks' fail cases are also covered fast above (positions, fit) and by the export tests."""
    from specfoundry.gate import GateConfig, run_gate
    from tests.test_gate import assert_gate_fails_at

    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(tiny_llama_dir), max_steps=60, max_new_tokens=32,
                     device="cpu", family="dflash2")
    checks, ok, message = run_gate(cfg)
    assert ok, message
    assert [c.name for c in checks] == ["export names", "mask token", "layers", "layers", "positions", "fit", "decode"]
    export = tmp_path / "gate" / "train" / "export"

    def rename(t):  # the engines load the codebooks under their raw names, no `.weight`
        t["candidate_selector.successor_codebook.weight"] = t.pop("candidate_selector.successor_codebook")

    def other_mask(c):
        c["dflash_config"]["mask_token_id"] -= 1

    assert_gate_fails_at(cfg, export, tmp_path, "export names", tensors=rename)
    assert_gate_fails_at(cfg, export, tmp_path, "mask token", config=other_mask)
