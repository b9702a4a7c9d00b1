"""The Domino family: shifted labels and masks, the loss and its gradient against plain-torch
references, the curriculum, sequential decoding against the teacher-forced training forward,
greedy speculative decoding equal to the target's own, the SGLang export spec, the gate."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.families import FAMILIES, DraftLoadError
from specfoundry.families.dflash.anchors import batch_anchors
from specfoundry.families.domino.config import DominoConfig
from specfoundry.families.domino.decode import DominoRunner, decode_matches_training
from specfoundry.families.domino.export import expected_tensors, export_draft, load_export
from specfoundry.families.domino.loss import DominoModule, base_weight_at, domino_loss, shifted_targets
from specfoundry.families.domino.model import DominoDraft
from specfoundry.featureset.batch import Batch
from specfoundry.testing import assert_close_scaled
from tests.conftest import edited_export_refusal, holed_batch
from tests.test_train import run_stopped_and_resumed, small_cfg, smol_features  # noqa: F401 (a fixture)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=97, target_hidden_size=32, target_layer_ids=(1, 2), block_size=5,
            mask_token_id=96, gru_hidden_dim=12, emb_dim=10)


def tiny_draft(seed=0, **overrides) -> DominoDraft:
    torch.manual_seed(seed)
    return DominoDraft(DominoConfig(**{**TINY, **overrides}))


def tiny_batch(lengths=(14, 9), seed=1) -> Batch:
    """Two rows, right-padded, with holes in the loss mask (a prompt, a gap mid-answer)."""
    return holed_batch(lengths, seed, aux_width=2 * 32)


# ---- labels and masks -------------------------------------------------------------------------------


def test_shifted_labels_and_masks_match_a_plain_loop():
    """Slot j of anchor a predicts x_{a+j+1}, counts iff inside the row and supervised; the GRU reads
    x_{a+j}: against a loop over rows, anchors and slots."""
    batch, b = tiny_batch(), 5
    anchors, keep = batch_anchors(batch, 6, b, seed=3)
    keep[1, -1] = False  # a dropped anchor counts nowhere
    labels, valid, tokens = shifted_targets(batch, anchors, keep, b)
    width = batch.input_ids.shape[1]
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[r, n])
            for j in range(b):
                t = a + j + 1
                counts = bool(keep[r, n]) and t < batch.lengths[r] and bool(batch.loss_mask[r, t])
                assert bool(valid[r, n, j]) == counts, (r, n, j)
                if counts:
                    assert int(labels[r, n, j]) == int(batch.input_ids[r, t])
                assert int(tokens[r, n, j]) == int(batch.input_ids[r, min(a + j, width - 1)])
    assert valid[:, :, 0].any() and not valid.all()  # slot 0 predicts (unlike DFlash's), and holes are there


# ---- the loss against a plain-torch reference ------------------------------------------------------


def gru_reference(w_ih, w_hh, xs):
    """PyTorch's GRU equations (gates r, z, n; no biases), one step at a time: the state after each x."""
    h = xs[0].new_zeros(w_hh.shape[1])
    out = []
    for x in xs:
        gi, gh = w_ih @ x, w_hh @ h
        (ir, iz, i_n), (hr, hz, hn) = gi.chunk(3), gh.chunk(3)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * hn)
        h = (1 - z) * n + z * h
        out.append(h)
    return out


def reference_loss(draft, batch, lm_head, anchors, keep, base_weight, gamma):
    """(1 - lambda) CE_f + lambda CE_b by loops over rows, anchors and slots (module docstring of loss.py)."""
    b = draft.cfg.block_size
    from specfoundry.families.dflash.anchors import block_inputs

    ids, positions = block_inputs(batch.input_ids, anchors, b, draft.cfg.mask_token_id)
    states = draft.train_forward(draft.project_context(batch.aux_hidden), ids, positions, anchors, keep,
                                 batch.lengths, "sdpa")
    p1, p2 = draft.embed_proj[0].weight, draft.embed_proj[2].weight
    emb = draft.embed_tokens.weight
    num_f = num_b = den = 0.0
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[r, n]:
                continue
            a = int(anchors[r, n])
            xs = [emb[int(batch.input_ids[r, min(a + j, batch.input_ids.shape[1] - 1)])] for j in range(b)]
            gs = gru_reference(draft.prefix_gru.weight_ih_l0, draft.prefix_gru.weight_hh_l0, xs)
            for j in range(b):
                t = a + j + 1
                if t >= batch.lengths[r] or not batch.loss_mask[r, t]:
                    continue
                zj = states[r, n * b + j]
                base = lm_head @ zj
                final = base + (p2 @ F.silu(p1 @ torch.cat([zj, gs[j]])) if j >= 1 else 0)
                y = batch.input_ids[r, t]
                w = math.exp(-j / gamma)
                num_f = num_f + w * (torch.logsumexp(final, 0) - final[y])
                num_b = num_b + w * (torch.logsumexp(base, 0) - base[y])
                den += w
    return (1 - base_weight) * num_f / den + base_weight * num_b / den


@pytest.mark.parametrize("base_weight", [0.0, 0.3])
@pytest.mark.parametrize("gradient, upstream", [("manual", 1.0), ("manual", 0.25), ("autograd", 1.0)])
def test_loss_and_gradients_match_a_plain_torch_reference(base_weight, gradient, upstream):
    """Both gradient paths (the hand-written one, told the upstream gradient the backward then
    sends, and autograd's) against plain torch over the whole [rows, V] logits."""
    batch, gamma = tiny_batch(), 4.0
    draft = tiny_draft()
    lm_head = torch.randn(97, 32, generator=torch.Generator().manual_seed(5))
    anchors, keep = batch_anchors(batch, 6, 5, 0)
    # label_chunk 7: the rows go through several chunks, across slot boundaries
    loss, metrics = domino_loss(draft, batch, lm_head, base_weight=base_weight, num_anchors=6, gamma=gamma, seed=0,
                                attention="sdpa", label_chunk=7, gradient=gradient, loss_scale=upstream)
    loss.backward(torch.tensor(upstream))
    got = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    ref = reference_loss(draft, batch, lm_head, anchors, keep, base_weight, gamma)
    (ref * upstream).backward()
    torch.testing.assert_close(loss, ref.float(), rtol=1e-5, atol=1e-6)
    for name, p in draft.named_parameters():
        # the hand-written gradient against autograd over the full logits: other sums, relative to
        # the largest entry (~sqrt(rows) * 1.2e-7 of it)
        assert_close_scaled(got[name], p.grad, 1e-5, msg=name)
    head = ["prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"]
    assert all(got[n].abs().sum() > 0 for n in head)  # the GRU and the projection train
    _, valid, _ = shifted_targets(batch, anchors, keep, 5)
    assert len(metrics) == 5 and [int(m["valid"]) for m in metrics] == valid.sum((0, 1)).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_chunk_gradients_equal_their_formula_in_float64(device, dtype, compiled):
    """domino_grads (eager, and compiled as a GPU step runs it: inductor on the GPU, aot_eager on
    a CPU) against dfinal = coef_f (softmax(final) - onehot), dbase = coef_b (softmax(base) -
    onehot) + dfinal, dcorrection = on dfinal, in float64; two row counts in one process (the
    chunks' shapes change)."""
    from specfoundry.families.dflash.loss import hard_ce_rows
    from specfoundry.families.domino.loss import domino_grads

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fn = domino_grads
    if compiled:
        fn = torch.compile(domino_grads, backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True,
                           dynamic=True)
    for rows, vocab in ((9, 97), (40, 1031)):
        g = torch.Generator().manual_seed(rows)
        final, base = ((torch.randn(rows, vocab, generator=g) * 3).to(dtype) for _ in range(2))
        labels = torch.randint(0, vocab, (rows,), generator=g)
        coef_f, coef_b = torch.rand(rows, generator=g), torch.rand(rows, generator=g)
        on = torch.arange(rows) % 3 > 0
        onehot = F.one_hot(labels, vocab).double()
        dfinal = coef_f.double()[:, None] * (torch.softmax(final.double(), -1) - onehot)
        dbase = coef_b.double()[:, None] * (torch.softmax(base.double(), -1) - onehot) + dfinal
        args = [x.to(device) for x in (final, base, labels)]
        lse = [hard_ce_rows(x, args[2])[2] for x in args[:2]]
        got_base, got_corr = fn(*args, *lse, coef_f.to(device), coef_b.to(device), on.to(device), dtype)
        assert got_base.dtype == got_corr.dtype == dtype
        # fp32: exp and sums of fp32 values of size <= ~e^12 (unit roundoff 6e-8); bf16: one
        # rounding of values at most 2 in size to 8 bits (2^-8 relative)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
        torch.testing.assert_close(got_base.double().cpu(), dbase, **tol)
        torch.testing.assert_close(got_corr.double().cpu(), dfinal * on.double()[:, None], **tol)


def test_with_lambda_one_only_the_backbone_learns():
    """lambda = 1 is DFlash's loss on shifted labels: the head gets exactly zero gradient."""
    draft = tiny_draft()
    loss, _ = domino_loss(draft, tiny_batch(), torch.randn(97, 32), base_weight=1.0, num_anchors=6, attention="sdpa")
    loss.backward()
    assert draft.embed_proj[2].weight.grad.abs().sum() == 0 and draft.prefix_gru.weight_hh_l0.grad.abs().sum() == 0
    assert draft.fc.weight.grad.abs().sum() > 0


def test_nothing_to_learn_gives_zero_loss_and_zero_gradients():
    batch = tiny_batch()
    batch.loss_mask[:] = False
    draft = tiny_draft()
    loss, metrics = domino_loss(draft, batch, torch.randn(97, 32), base_weight=0.5, attention="sdpa")
    loss.backward()
    assert loss.item() == 0 and all(int(m["valid"]) == 0 for m in metrics)
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in draft.parameters())


# ---- the curriculum --------------------------------------------------------------------------------


def test_lambda_decays_linearly_from_start_to_end():
    assert [base_weight_at(s, 100, 1.0, 0.0, 1.0) for s in (0, 50, 100)] == [1.0, 0.5, 0.0]
    assert [base_weight_at(s, 100, 0.8, 0.2, 0.5) for s in (0, 25, 50, 99)] == pytest.approx([0.8, 0.5, 0.2, 0.2])
    module = DominoModule(tiny_draft(), torch.randn(97, 32), base_weight_start=1.0, base_weight_end=0.0,
                          compile_elementwise=False)
    assert module.base_weight == 1.0  # before the Trainer announces a step
    module.set_progress(30, 40)
    assert module.base_weight == pytest.approx(0.25)


def test_the_trainer_announces_its_step_to_the_module():
    """Trainer.train_step announces (step, total_steps) through the family contract's set_progress before
    its forward; Domino's provider hands it to its module (a family that schedules nothing ignores it)."""
    from types import SimpleNamespace

    from specfoundry.train.trainer import Trainer

    seen = []

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    trainer = Trainer.__new__(Trainer)
    trainer.step, trainer.total_steps = 7, 20
    trainer.unwrapped = SimpleNamespace(set_progress=lambda s, t: seen.append((s, t)))
    trainer.provider = FAMILIES.provider("domino")
    trainer.cfg = SimpleNamespace(grad_accum=1)
    trainer.model = SimpleNamespace(train=stop)
    with pytest.raises(Stop):
        trainer.train_step(tiny_batch())
    assert seen == [(7, 20)]


# ---- decoding ----------------------------------------------------------------------------------------


def test_sequential_decoding_equals_the_teacher_forced_forward_and_the_gru_matters():
    """The first round's GRU over its own proposals gives the training forward's logits teacher-forced
    on those proposals; teacher-forced on other tokens, the corrected slots differ (slot 0 does not)."""
    draft = tiny_draft(seed=2).eval()
    with torch.no_grad():
        draft.embed_proj[2].weight.mul_(30)  # a correction large enough to change the proposals
    lm_head = torch.randn(97, 32, generator=torch.Generator().manual_seed(6))
    batch = tiny_batch(lengths=(11,))
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    decoded, trained = decode_matches_training(draft, lm_head, ids, aux)
    assert decoded.shape == (4, 97)
    # a cached decode against the training forward: sums in another order, relative to each row's
    # largest logit (up to ~20); 1e-5 of it, far under the 1e-2 below
    assert_close_scaled(decoded, trained, 1e-5, rows=True)
    from specfoundry.families.domino.decode import training_block_logits

    other = torch.cat([ids, (ids[-4:] + 1) % 96])  # the true-looking but different continuation
    forced = training_block_logits(draft, lm_head, other, torch.cat([aux, aux[:4]]), len(ids) - 1)
    assert_close_scaled(forced[0], decoded[0], 1e-5)  # (as above)
    assert (forced[1:] - decoded[1:]).abs().max() > 1e-2


def test_greedy_domino_decoding_equals_the_targets_greedy(tiny_llama_dir):
    """A random tiny Domino draft, and the same draft nudged to propose the target's own tokens at
    two of every three positions (so that proposals are accepted, partly): both decode to the
    target's greedy output, token for token."""
    from specfoundry.common.target import Target
    from specfoundry.common.weights import target_embeddings
    from specfoundry.families.dflash.block import block_generate
    from specfoundry.families.dflash.config import dflash_config_from_target

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    layers = [1, 3, 5]
    base = dflash_config_from_target(tiny_llama_dir, layers, 2, 5, 49151).to_dict()
    torch.manual_seed(0)
    draft = DominoDraft(DominoConfig.from_dict({**base, "gru_hidden_dim": 16, "emb_dim": 8})).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    prompt = list(range(100, 112))
    n = 24
    ref = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    runner_target = TargetRunner(target, layers)
    runner = DominoRunner(draft, target.lm_head())
    out = block_generate(runner_target, runner, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    assert out.tokens == ref

    full = prompt + ref
    corrected = draft.corrected_logits

    def nudged(states, head, slots, prefix, base=None):  # +1e4 on the target's own next token, at 2 of 3 positions
        final, base_logits = corrected(states, head, slots, prefix, base)
        pos = len(runner.cache) + int(slots[0]) + 1
        if pos < len(full) and pos % 3:
            final = final.clone()
            final[:, full[pos]] += 1e4
        return final, base_logits

    draft.corrected_logits = nudged
    out = block_generate(runner_target, runner, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    runner_target.remove_hooks()
    assert out.tokens == ref
    assert 0 < sum(out.accepted) < 4 * len(out.accepted), out.accepted


# ---- export ------------------------------------------------------------------------------------------


def test_export_holds_sglangs_domino_names_shapes_and_fields_and_reads_back(tmp_path):
    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export", target={"num_layers": 4})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 5
    assert config["num_target_layers"] == 4 and config["emb_dim"] == 10
    assert config["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 96, "projector_type": "domino",
                                       "shift_label": True, "pure_draft_prefix_len": 1, "gru_hidden_dim": 12,
                                       "emb_dim": 10}
    spec = expected_tensors(draft.cfg)
    assert {k: spec[k] for k in spec if not k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))} == {
        "prefix_gru.weight_ih_l0": (36, 32), "prefix_gru.weight_hh_l0": (36, 12),
        "embed_proj.0.weight": (10, 44), "embed_proj.2.weight": (97, 10)}
    cfg, tensors = load_export(out)
    assert cfg == draft.cfg and FAMILIES.family_of_config(config, "c") == "domino"
    assert {k: tuple(v.shape) for k, v in tensors.items()} == spec
    state = draft.state_dict()
    for name, t in tensors.items():
        torch.testing.assert_close(t, state[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c["dflash_config"].update(shift_label=False), "shift_label is False"),
    (lambda c: c["dflash_config"].update(pure_draft_prefix_len=2), "pure_draft_prefix_len is 2"),
    (lambda c: c.update(emb_dim=11), "emb_dim differs"),
    (lambda c: c["dflash_config"].pop("gru_hidden_dim"), "lacks 'gru_hidden_dim'"),
    (lambda c: c["dflash_config"].update(projector_type="dspark"), "projector_type 'dspark' names no draft family"),
])
def test_a_config_sglang_would_refuse_is_one_line(tmp_path, edit, words):
    draft = tiny_draft()
    message = edited_export_refusal(export_draft(draft.state_dict(), draft.cfg, tmp_path / "export"), edit)
    assert words in message, message


def test_a_domino_export_without_its_projector_type_names_the_family_it_was_read_as(tmp_path, tiny_llama_dir):
    """Without dflash_config.projector_type the folder reads as plain DFlash; sf-eval's load then
    names that reading and Domino's tensors, not an empty list of missing ones."""
    from specfoundry.families.folders import load_draft, locate_draft

    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].pop("projector_type")
    (out / "config.json").write_text(json.dumps(config))
    (out / "specfoundry_draft.json").unlink()  # as another tool would write it: config.json alone
    with pytest.raises(DraftLoadError) as e:
        load_draft(locate_draft(out), tiny_llama_dir, torch.device("cpu"), torch.float32)
    said = str(e.value)
    assert "read as dflash from its config.json" in said and "prefix_gru.weight_ih_l0" in said, said
    assert "missing" not in said and "\n" not in said, said


def test_projector_type_names_the_family_only_on_its_parents_architecture():
    dflash = {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 1}}
    assert FAMILIES.family_of_config(dflash, "c") == "dflash"
    domino = {"architectures": ["DFlashDraftModel"], "dflash_config": {"projector_type": "domino"}}
    assert FAMILIES.family_of_config(domino, "c") == "domino"  # SGLang's way of serving it
    assert FAMILIES.family_of_config({"architectures": ["DominoDraftModel"]}, "c") == "domino"  # upstream's
    eagle = {"architectures": ["LlamaForCausalLMEagle3"], "dflash_config": {"projector_type": "domino"}}
    assert FAMILIES.family_of_config(eagle, "c") == "eagle3"


# ---- the gate ----------------------------------------------------------------------------------------


def test_the_positions_check_names_a_gru_fed_the_wrong_tokens_and_fit_an_untrained_draft(tiny_llama_dir):
    """Fast cases of the gate's Domino checks on a random draft: positions passes for the real decoder
    and fails when decoding feeds the GRU the mask token instead of its proposals; fit fails."""
    from types import SimpleNamespace

    from specfoundry.common.weights import target_embeddings, target_lm_head
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.domino.gate import check_positions_and_fit

    base = dflash_config_from_target(tiny_llama_dir, [1, 3, 5], 2, 5, 49151).to_dict()
    torch.manual_seed(0)
    draft = DominoDraft(DominoConfig.from_dict({**base, "gru_hidden_dim": 16, "emb_dim": 8})).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    with torch.no_grad():  # a correction that dominates the logits and reads the GRU strongly
        draft.embed_proj[0].weight[:, 64:].mul_(20)
        draft.embed_proj[2].weight.mul_(1000)
    g = torch.Generator().manual_seed(2)
    sample = SimpleNamespace(input_ids=torch.randint(0, 1000, (20,), generator=g),
                             loss_mask=torch.arange(20) >= 6, aux_hidden=torch.randn(20, 3 * 64, generator=g))
    runner = DominoRunner(draft, target_lm_head(tiny_llama_dir).float())
    positions, fit = check_positions_and_fit(runner, sample)
    assert positions.ok and not fit.ok, (positions, fit)
    step = draft.gru_step
    draft.gru_step = lambda token, state: step(torch.full_like(token, 49151), state)
    positions, _ = check_positions_and_fit(runner, sample)
    assert not positions.ok and "differs" in positions.detail, positions


@pytest.mark.slow
def test_domino_gate_passes_on_the_tiny_target_and_names_broken_pieces(tiny_llama_dir, tmp_path):
    """The whole gate (regen, capture, train 60 steps, export, checks) on the tiny Llama target:
    about 25 s alone on one core, minutes on shared cores, hence slow; its checks' fail cases are also covered fast above
    (positions, fit) and by the export tests (names, fields)."""
    from specfoundry.gate import GateConfig, run_gate
    from tests.test_gate import assert_gate_fails_at

    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(tiny_llama_dir), max_steps=60, max_new_tokens=32,
                     device="cpu", family="domino")
    checks, ok, message = run_gate(cfg)
    assert ok, message
    assert [c.name for c in checks] == ["export names", "mask token", "layers", "layers", "positions", "fit", "decode"]
    export = tmp_path / "gate" / "train" / "export"

    def rename(t):  # SGLang requires each of the head's tensors
        t["embed_proj.1.weight"] = t.pop("embed_proj.2.weight")

    def other_mask(c):
        c["dflash_config"]["mask_token_id"] -= 1

    assert_gate_fails_at(cfg, export, tmp_path, "export names", tensors=rename)
    assert_gate_fails_at(cfg, export, tmp_path, "mask token", config=other_mask)


def test_dflash_only_objectives_are_refused():
    from specfoundry.families import FAMILIES, Extended
    from specfoundry.families.dflash.options import DFlashOptions
    from specfoundry.families.domino.options import DominoOptions

    family = FAMILIES.provider("domino")
    for parent, words in ((DFlashOptions(teacher="soft"), "--teacher soft"), (DFlashOptions(objective="dpace"),
                                                                            "--objective dpace")):
        with pytest.raises(ValueError, match=words):
            family.module(tiny_draft(), "unused", torch.float32, Extended(parent, DominoOptions()), 0)


@pytest.mark.slow
def test_a_domino_run_resumed_after_a_stop_equals_an_uninterrupted_one(tmp_path, smol_features):  # noqa: F811
    """The curriculum follows the Trainer's step, restored on resume: the resumed run's lambda, and so
    its weights, are the uninterrupted run's, bit for bit (about 20 s with its capture, hence slow; the
    hook itself is tested fast above)."""

    def cfg(out):
        return small_cfg(smol_features, out, family="domino", num_draft_layers=3, block_size=4, num_anchors=16,
                         gru_hidden_dim=16, correction_dim=16, max_steps=6, max_batch_tokens=160, save_every=3)

    whole, resumed, names = run_stopped_and_resumed(cfg, tmp_path)
    assert "prefix_gru.weight_hh_l0" in names
    assert [x["loss_0"] for x in whole["history"]] == [x["loss_0"] for x in resumed["history"]]
