"""The DSpark family: labels from the anchor and the Markov bias against plain loops, the
three-term loss and its gradients against a plain-torch reference, sequential decoding against the
teacher-forced training forward, greedy speculative decoding equal to the target's own, the SGLang
export spec, the configs the engine refuses, the gate's fast checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families import FAMILIES, Extended
from specfoundry.families.dflash.anchors import batch_anchors, block_inputs
from specfoundry.families.dflash.options import DFlashOptions
from specfoundry.families.dspark.config import DSparkConfig
from specfoundry.families.dspark.decode import DSparkRunner, decode_matches_training, decode_settings
from specfoundry.families.dspark.export import expected_tensors, export_draft, load_export
from specfoundry.families.dspark.loss import anchor_targets, dspark_loss
from specfoundry.families.dspark.model import DSparkDraft
from specfoundry.families.dspark.options import DSparkOptions
from specfoundry.featureset.batch import Batch
from specfoundry.testing import assert_close_scaled
from tests.conftest import assert_export_refuses_tensors, edited_export_refusal, holed_batch

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=97, target_hidden_size=32, target_layer_ids=(1, 2), block_size=5,
            mask_token_id=96, markov_rank=6)


def tiny_draft(seed=0, markov_scale=1.0, **overrides) -> DSparkDraft:
    """A random tiny draft; markov_w2 (zero at init) drawn too unless markov_scale is 0."""
    torch.manual_seed(seed)
    draft = DSparkDraft(DSparkConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_(0, markov_scale)
    return draft


def tiny_batch(lengths=(14, 9), seed=1) -> Batch:
    """Two rows, right-padded, with holes in the loss mask (a prompt, a gap mid-answer), and the
    target's final states."""
    return holed_batch(lengths, seed, aux_width=2 * 32, final_width=32)


# ---- labels and the Markov bias --------------------------------------------------------------------


def test_labels_from_the_anchor_and_the_supervised_prefix_match_a_plain_loop():
    """Slot j of anchor a predicts x_{a+j+1} with previous token x_{a+j}; it counts iff every slot
    up to j is inside the row and supervised (a hole ends the block)."""
    batch, b = tiny_batch(), 5
    anchors, keep = batch_anchors(batch, 6, b, seed=3)
    keep[1, -1] = False  # a dropped anchor counts nowhere
    labels, counted, prev = anchor_targets(batch, anchors, keep, b)
    width = batch.input_ids.shape[1]
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a, alive = int(anchors[r, n]), bool(keep[r, n])
            for j in range(b):
                t = a + j + 1
                alive = alive and t < batch.lengths[r] and bool(batch.loss_mask[r, t])
                assert bool(counted[r, n, j]) == alive, (r, n, j)
                if alive:
                    assert int(labels[r, n, j]) == int(batch.input_ids[r, t])
                assert int(prev[r, n, j]) == int(batch.input_ids[r, min(a + j, width - 1)])
    assert counted[:, :, 0].any() and not counted.all()
    # a hole ends the block: slot j after the gap at 7 never counts for an anchor before it
    row0 = [(int(anchors[0, n]), counted[0, n]) for n in range(anchors.shape[1]) if keep[0, n]]
    assert any(a + 1 < 7 <= a + 5 and not c[7 - a - 1:].any() for a, c in row0), row0


def test_block_logits_add_the_previous_tokens_bias_as_a_plain_loop():
    draft = tiny_draft()
    g = torch.Generator().manual_seed(4)
    states, head = torch.randn(7, 32, generator=g), torch.randn(97, 32, generator=g)
    tokens = torch.randint(0, 97, (7, 5), generator=g)
    slots = torch.tensor([0, 1, 4, 2, 3, 0, 4])
    got = draft.block_logits(states, head, slots, tokens)
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    for r in range(7):
        want = head @ states[r] + w2 @ w1[int(tokens[r, int(slots[r])])]
        assert_close_scaled(got[r], want, 1e-5)  # a matrix-vector product against a matmul: another order
    assert (got - states @ head.T).abs().max() > 0.1  # the bias is there
    fresh = tiny_draft(markov_scale=0.0)
    torch.testing.assert_close(fresh.block_logits(states, head, slots, tokens), states @ head.T, rtol=0, atol=0)


# ---- the loss against a plain-torch reference ------------------------------------------------------


def reference_loss(draft, batch, lm_head, anchors, keep, gamma, weights):
    """The module docstring of loss.py, by loops over rows, anchors and slots."""
    b = draft.cfg.block_size
    ids, positions = block_inputs(batch.input_ids, anchors, b, draft.cfg.mask_token_id)
    states = draft.train_forward(draft.project_context(batch.aux_hidden), ids, positions, anchors, keep,
                                 batch.lengths, "sdpa")
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    cw, cb = draft.confidence_head.proj.weight[0], draft.confidence_head.proj.bias[0]
    ce_w, l1_w, conf_w = weights
    num = den = 0.0
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[r, n]:
                continue
            a = int(anchors[r, n])
            for j in range(b):
                t = a + j + 1
                if t >= batch.lengths[r] or not batch.loss_mask[r, t]:
                    break  # the block's supervised prefix ends here
                z, u, y = states[r, n * b + j], int(batch.input_ids[r, a + j]), int(batch.input_ids[r, t])
                logits = lm_head @ z + w2 @ w1[u]
                ce = torch.logsumexp(logits, 0) - logits[y]
                q = torch.softmax(lm_head @ batch.final_hidden[r, a + j], 0)
                l1 = (torch.softmax(logits, 0) - q).abs().sum()
                accept = (1 - l1.detach() / 2).clamp(0, 1)
                c = cw @ torch.cat([z, w1[u]]) + cb
                bce = F.softplus(c) - accept * c  # -(t log sigmoid(c) + (1 - t) log(1 - sigmoid(c)))
                w = math.exp(-j / gamma)
                num = num + w * (ce_w * ce + l1_w * l1 + conf_w * bce)
                den += w
    return num / den


@pytest.mark.parametrize("gradient, upstream", [("manual", 1.0), ("manual", 0.25), ("autograd", 1.0)])
@pytest.mark.parametrize("weights", [(0.1, 0.9, 1.0), (1.0, 0.3, 2.0)])
def test_loss_and_gradients_match_a_plain_torch_reference(weights, gradient, upstream):
    """Both gradient paths (the hand-written one, told the upstream gradient the backward then
    sends, and autograd's) against plain torch over the whole [rows, V] logits."""
    batch, gamma = tiny_batch(), 4.0
    draft = tiny_draft()
    lm_head = torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    anchors, keep = batch_anchors(batch, 6, 5, 0)
    # label_chunk 7: the rows go through several chunks, across slot boundaries
    loss, metrics = dspark_loss(draft, batch, lm_head, num_anchors=6, gamma=gamma, seed=0, ce_weight=weights[0],
                                l1_weight=weights[1], confidence_weight=weights[2], attention="sdpa", label_chunk=7,
                                gradient=gradient, loss_scale=upstream)
    loss.backward(torch.tensor(upstream))
    got = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ref = reference_loss(draft, batch, lm_head, anchors, keep, gamma, weights)
    (ref * upstream).backward()
    torch.testing.assert_close(loss, ref.float(), rtol=1e-5, atol=1e-6)
    for name, p in draft.named_parameters():
        if p.requires_grad:
            # the hand-written gradient against autograd over the full logits: other sums, relative to
            # the largest entry. The sums are poorly conditioned here: against a float64 run the
            # manual path is 2.0e-6 off and autograd 1.3e-6 (markov_w2), their gap 3.3e-6 of the
            # largest gradient, and another BLAS's blocking can move each by as much again. 5e-5 of
            # it (test_dpace's bound for the same comparison) is ~15x the measured gap, while a
            # wrong gradient term is off by O(1e-3) or more of it.
            assert_close_scaled(got[name], p.grad, 5e-5, msg=name)
    heads = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             "confidence_head.proj.bias"]
    assert all(got[n].abs().sum() > 0 for n in heads)  # the Markov and the confidence heads train
    _, counted, _ = anchor_targets(batch, anchors, keep, 5)
    assert len(metrics) == 5 and [int(m["valid"]) for m in metrics] == counted.sum((0, 1)).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_chunk_pieces_equal_autograd_in_float64(device, dtype, compiled):
    """dspark_rows and dspark_grad (eager, and compiled as a GPU step runs them: inductor on the
    GPU, aot_eager on a CPU) against ce, l1 = sum |softmax(z) - softmax(t)| and autograd's gradient
    of sum coef (ce_weight ce + l1_weight l1) in float64; two row counts in one process."""
    from specfoundry.families.dspark.loss import dspark_grad, dspark_rows

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rows_fn, grad_fn = dspark_rows, dspark_grad
    if compiled:
        backend = "inductor" if device == "cuda" else "aot_eager"
        rows_fn = torch.compile(dspark_rows, backend=backend, fullgraph=True, dynamic=True)
        grad_fn = torch.compile(dspark_grad, backend=backend, fullgraph=True, dynamic=True)
    for rows, vocab in ((9, 97), (40, 1031)):
        g = torch.Generator().manual_seed(rows)
        z, t = ((torch.randn(rows, vocab, generator=g) * 3).to(dtype) for _ in range(2))
        labels = torch.randint(0, vocab, (rows,), generator=g)
        coef = torch.rand(rows, generator=g)
        z64 = z.double().requires_grad_()
        ce = F.cross_entropy(z64, labels, reduction="none")
        l1 = (torch.softmax(z64, -1) - torch.softmax(t.double(), -1)).abs().sum(-1)
        (coef.double() * (0.7 * ce + 0.4 * l1)).sum().backward()
        zd, td, ld = z.to(device), t.to(device), labels.to(device)
        got_ce, hits, lse, got_l1, sp = rows_fn(zd, td, ld)
        dz = grad_fn(zd, td, ld, lse, sp, coef.to(device), 0.7, 0.4, dtype)
        # ce and l1: fp32 sums over V terms (unit roundoff 6e-8, values up to ~e^12 before the
        # logsumexp); the gradient is rounded once to `dtype` (bf16: 2^-8 of values at most ~2)
        torch.testing.assert_close(got_ce.double().cpu(), ce.detach(), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got_l1.double().cpu(), l1.detach(), atol=1e-5, rtol=1e-5)
        assert torch.equal(hits.cpu(), z.double().argmax(-1) == labels)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
        torch.testing.assert_close(dz.double().cpu(), z64.grad, **tol)


def test_a_fresh_draft_trains_its_markov_head_and_the_acceptance_target_is_held():
    """markov_w2 starts at zero (the draft is its DFlash backbone), and still gets a gradient. With
    the confidence term alone, the logits get none: 1 - L1/2 is the BCE's target, held without
    gradient, so the BCE trains the confidence head (and what it reads), never the Markov bias."""
    batch, lm_head = tiny_batch(), torch.randn(97, 32)
    draft = tiny_draft(markov_scale=0.0)
    dspark_loss(draft, batch, lm_head, num_anchors=6, attention="sdpa")[0].backward()
    assert draft.markov_head.markov_w2.weight.grad.abs().sum() > 0
    draft = tiny_draft()
    dspark_loss(draft, batch, lm_head, num_anchors=6, attention="sdpa", ce_weight=0.0, l1_weight=0.0,
                confidence_weight=1.0)[0].backward()
    assert draft.markov_head.markov_w2.weight.grad.abs().max() == 0
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0 and draft.fc.weight.grad.abs().sum() > 0


def test_nothing_to_learn_gives_zero_loss_and_zero_gradients_and_no_final_state_is_one_line():
    batch = tiny_batch()
    batch.loss_mask[:] = False
    draft = tiny_draft()
    loss, metrics = dspark_loss(draft, batch, torch.randn(97, 32), attention="sdpa")
    loss.backward()
    assert loss.item() == 0 and all(int(m["valid"]) == 0 for m in metrics)
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in draft.parameters() if p.requires_grad)
    batch = tiny_batch()
    batch.final_hidden = None
    with pytest.raises(ValueError, match="final hidden states") as e:
        dspark_loss(draft, batch, torch.randn(97, 32), attention="sdpa")
    assert "\n" not in str(e.value)


def test_dflash_only_teachers_and_objectives_are_refused():
    family = FAMILIES.provider("dspark")
    for parent, words in ((DFlashOptions(teacher="soft"), "--teacher soft"),
                          (DFlashOptions(objective="dpace"), "--objective dpace")):
        with pytest.raises(ValueError, match=words):
            family.module(tiny_draft(), "unused", torch.float32, Extended(parent, DSparkOptions()), 0)


# ---- decoding ----------------------------------------------------------------------------------------


def test_sequential_decoding_equals_the_teacher_forced_forward_and_the_bias_matters():
    """The first round's Markov bias over its own proposals gives the training forward's logits
    teacher-forced on them (all B slots); teacher-forced on other tokens, slots after 0 differ."""
    draft = tiny_draft(seed=2, markov_scale=3.0).eval()
    lm_head = torch.randn(97, 32, generator=torch.Generator().manual_seed(6))
    batch = tiny_batch(lengths=(11,))
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    decoded, trained = decode_matches_training(draft, lm_head, ids, aux)
    assert decoded.shape == (5, 97)
    # a cached decode against the block-masked training forward: sums over H = 32 in another order,
    # ~sqrt(32) * 1.2e-7 of each row's largest logit (up to 28); 1e-5 of it, 35x under the 1e-2 below
    assert_close_scaled(decoded, trained, 1e-5, rows=True)
    from specfoundry.families.dspark.decode import training_block_logits

    other = torch.cat([ids, (decoded.argmax(-1) + 1) % 96])  # a continuation other than the proposals
    forced = training_block_logits(draft, lm_head, other, torch.cat([aux, aux[:5]]), len(ids) - 1)
    assert_close_scaled(forced[0], decoded[0], 1e-5)  # (as above)
    assert (forced[1:] - decoded[1:]).abs().amax(-1).min() > 1e-2


def test_decode_settings_serve_the_trained_block_or_a_smaller_one():
    cfg = tiny_draft().cfg  # blocks of 5
    assert decode_settings(cfg, k=4, tree=None, k_given=False, source="d") == (5, None, None)
    assert decode_settings(cfg, k=3, tree=None, k_given=True, source="d") == (3, None, None)
    with pytest.raises(ValueError, match="-k 6: DSpark draft d proposes a block of 1 to its trained 5"):
        decode_settings(cfg, k=6, tree=None, k_given=True, source="d")
    with pytest.raises(ValueError, match="trees"):
        decode_settings(cfg, k=5, tree=(2, 2), k_given=False, source="d")


def test_greedy_dspark_decoding_equals_the_targets_greedy(tiny_llama_dir):
    """A random tiny DSpark draft, and the same draft nudged to propose the target's own tokens at
    two of every three positions (so that proposals are accepted, partly): both decode to the
    target's greedy output, token for token; each round reports B confidences in [0, 1]."""
    from specfoundry.common.target import Target
    from specfoundry.common.weights import target_embeddings
    from specfoundry.families.dflash.block import block_generate
    from specfoundry.families.dflash.config import dflash_config_from_target

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    layers = [1, 3, 5]
    base = dflash_config_from_target(tiny_llama_dir, layers, 2, 4, 49151).to_dict()
    torch.manual_seed(0)
    draft = DSparkDraft(DSparkConfig.from_dict({**base, "markov_rank": 8})).eval()
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    prompt = list(range(100, 112))
    n = 24
    ref = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    runner_target = TargetRunner(target, layers)
    runner = DSparkRunner(draft, target.lm_head())
    out = block_generate(runner_target, runner, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    assert out.tokens == ref
    assert len(runner.confidences) == len(out.accepted)
    assert all(len(c) == 4 and all(0 <= x <= 1 for x in c) for c in runner.confidences)

    full = prompt + ref
    bias, block = draft.with_markov_bias, draft.decode_block
    slot = {"p": 0, "j": 0}

    def counted_block(ids, positions, cache):
        slot.update(p=len(cache), j=0)
        return block(ids, positions, cache)

    def nudged(base, prev):  # +1e4 on the target's own next token, at 2 of 3 positions
        logits = bias(base, prev)
        pos = slot["p"] + slot["j"] + 1
        slot["j"] += 1
        if pos < len(full) and pos % 3:
            logits = logits.clone()
            logits[:, full[pos]] += 1e4
        return logits

    draft.decode_block, draft.with_markov_bias = counted_block, nudged
    out = block_generate(runner_target, runner, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    runner_target.remove_hooks()
    assert out.tokens == ref
    assert 0 < sum(out.accepted) < 4 * len(out.accepted), out.accepted


# ---- export ------------------------------------------------------------------------------------------


def test_export_holds_sglangs_dspark_names_shapes_and_fields_and_reads_back(tmp_path):
    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export", target={"num_layers": 4})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 5 and config["num_target_layers"] == 4
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov", "mask_token_id", "target_layer_ids")} == {
        "markov_rank": 6, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "mask_token_id": 96, "target_layer_ids": [1, 2]}
    assert config["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 96}
    spec = expected_tensors(draft.cfg)
    assert {k: spec[k] for k in spec if not k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))} == {
        "markov_head.markov_w1.weight": (97, 6), "markov_head.markov_w2.weight": (97, 6),
        "confidence_head.proj.weight": (1, 38), "confidence_head.proj.bias": (1,)}
    cfg, tensors = load_export(out)
    assert cfg == draft.cfg and FAMILIES.family_of_config(config, "c") == "dspark"
    assert FAMILIES.family_of_config({**config, "architectures": ["DSparkDraftModel"]}, "c") == "dspark"
    assert {k: tuple(v.shape) for k, v in tensors.items()} == spec
    state = draft.state_dict()
    for name, t in tensors.items():
        torch.testing.assert_close(t, state[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    alone = tiny_draft(confidence_with_markov=False)
    assert expected_tensors(alone.cfg)["confidence_head.proj.weight"] == (1, 32)
    out = export_draft(alone.state_dict(), alone.cfg, tmp_path / "alone")
    assert json.loads((out / "config.json").read_text())["confidence_head_with_markov"] is False
    assert load_export(out)[0] == alone.cfg


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.update(markov_rank=0), "markov_rank is 0"),
    (lambda c: c.pop("markov_rank"), "lacks 'markov_rank'"),
    (lambda c: c.pop("markov_head_type"), "markov_head_type is missing"),
    (lambda c: c.update(markov_head_type="rnn"), "markov_head_type is 'rnn'"),
    (lambda c: c.update(enable_confidence_head=False), "enable_confidence_head is False"),
    (lambda c: c.update(speculators_model_type="dspark"), "speculators_model_type 'dspark'"),
    (lambda c: c.update(mask_token_id=95), "mask_token_id differs"),
    (lambda c: c.update(target_layer_ids=[0, 2]), "target_layer_ids differs"),
])
def test_a_config_sglang_would_refuse_is_one_line(tmp_path, edit, words):
    draft = tiny_draft()
    message = edited_export_refusal(export_draft(draft.state_dict(), draft.cfg, tmp_path / "export"), edit)
    assert words in message, message


def test_a_missing_or_misshaped_head_tensor_is_refused_on_export(tmp_path):
    assert_export_refuses_tensors(export_draft, tiny_draft(), tmp_path, "confidence_head.proj.bias",
                                  "markov_head.markov_w1.weight", (97, 5))


# ---- the gate ----------------------------------------------------------------------------------------


def test_the_positions_check_names_a_bias_fed_the_wrong_tokens_and_fit_an_untrained_draft(tiny_llama_dir):
    """Fast cases of the gate's DSpark checks on a random draft: positions passes for the real
    decoder and fails when decoding biases its slots by the mask token; fit fails."""
    from types import SimpleNamespace

    from specfoundry.common.weights import target_embeddings, target_lm_head
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.dspark.gate import check_positions_and_fit

    base = dflash_config_from_target(tiny_llama_dir, [1, 3, 5], 2, 4, 49151).to_dict()
    torch.manual_seed(0)
    draft = DSparkDraft(DSparkConfig.from_dict({**base, "markov_rank": 8})).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    with torch.no_grad():  # a bias that dominates the logits
        draft.markov_head.markov_w2.weight.normal_(0, 100)
    g = torch.Generator().manual_seed(2)
    sample = SimpleNamespace(input_ids=torch.randint(0, 1000, (20,), generator=g),
                             loss_mask=torch.arange(20) >= 6, aux_hidden=torch.randn(20, 3 * 64, generator=g))
    runner = DSparkRunner(draft, target_lm_head(tiny_llama_dir).float())
    positions, fit = check_positions_and_fit(runner, sample)
    assert positions.ok and not fit.ok, (positions, fit)
    bias = draft.with_markov_bias

    def masked(base, prev):  # decoding (one row at a time) biases by the mask token, not the proposal
        if base.shape[0] == 1:
            prev = torch.full_like(prev, draft.cfg.mask_token_id)
        return bias(base, prev)

    draft.with_markov_bias = masked
    positions, _ = check_positions_and_fit(runner, sample)
    assert not positions.ok and "differs" in positions.detail, positions


@pytest.mark.slow
def test_dspark_gate_passes_on_the_tiny_target_and_names_broken_pieces(tiny_llama_dir, tmp_path):
    """The whole gate (regen, capture, train 60 steps, export, checks) on the tiny Llama target: 204 s
    on 2 shared cores, hence slow; its checks' fail cases are also covered fast above (positions, fit)
    and by the export tests (names, fields)."""
    from specfoundry.gate import GateConfig, run_gate
    from tests.test_gate import assert_gate_fails_at

    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(tiny_llama_dir), max_steps=60, max_new_tokens=32,
                     device="cpu", family="dspark")
    checks, ok, message = run_gate(cfg)
    assert ok, message
    assert [c.name for c in checks] == ["export names", "mask token", "layers", "layers", "positions", "fit", "decode"]
    export = tmp_path / "gate" / "train" / "export"

    def rename(t):  # SGLang requires the Markov head's tensors under their names
        t["markov_head.w2.weight"] = t.pop("markov_head.markov_w2.weight")

    def other_mask(c):  # both places the engines read it
        c["dflash_config"]["mask_token_id"] -= 1
        c["mask_token_id"] -= 1

    assert_gate_fails_at(cfg, export, tmp_path, "export names", tensors=rename)
    assert_gate_fails_at(cfg, export, tmp_path, "mask token", config=other_mask)
