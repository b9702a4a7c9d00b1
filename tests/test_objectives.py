"""sf-train's objectives: --token-loss (the LK losses, kernels/lk_loss.py) through the EAGLE-3 and
P-EAGLE losses, refused in one line where a family cannot take it, and --keep-best (the draft of
the best held-out evaluation exported, the choice recorded, a resumed run byte-identical)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specfoundry.families.eagle3.ttt import ttt_loss
from specfoundry.families.folders import TRAINING_FILE
from specfoundry.families.teacher import teacher_targets
from specfoundry.kernels.lk_loss import TokenLoss
from specfoundry.train.trainer import TrainConfig, run_train
from tests.test_train import run_stopped_and_resumed, small_cfg, smol_features, tiny_setup  # noqa: F401

LK = ["lk-alpha", "lk-lambda", "tv"]


def test_the_lk_teacher_keeps_the_mass_outside_the_draft_vocabulary():
    _, batch, lm_head, draft_ids = tiny_setup()
    h = batch.final_hidden.reshape(-1, batch.final_hidden.shape[-1])
    t2d = torch.zeros(lm_head.shape[0], dtype=torch.bool)
    t2d[draft_ids] = True
    p_full, ok, tgt = teacher_targets(h, lm_head, draft_ids, t2d, renormalise=False)
    p_hat, ok2, tgt2 = teacher_targets(h, lm_head, draft_ids, t2d)
    want = torch.softmax(h @ lm_head.T, -1)[:, draft_ids]
    torch.testing.assert_close(p_full, want)
    inside = p_full.sum(-1)  # the mass of the 40 draft tokens; the 57 others (shrunk heads) hold the rest
    assert (inside <= 1 + 1e-6).all() and (1 - inside).max() > 0.05
    torch.testing.assert_close(p_hat, p_full / p_full.sum(-1, keepdim=True))
    assert torch.equal(ok, ok2) and torch.equal(tgt, tgt2)


@pytest.mark.parametrize("kind", LK)
def test_eagle3_lk_losses_by_the_kernel_equal_the_reference(kind):
    """The TTT unroll with an LK token loss: the in-place kernel (interpreted) against the
    reference's autograd, fp32: summation order only (the tolerances of test_train.py)."""
    model, batch, lm_head, draft_ids = tiny_setup()
    out = {}
    for impl in ("reference", "triton"):
        model.zero_grad()
        loss, metrics = ttt_loss(model, batch, lm_head, draft_ids, ttt_length=3, attention="sdpa", loss_kernel=impl,
                                 token_loss=TokenLoss(kind))
        loss.backward()
        out[impl] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        assert len(metrics) == 3 and torch.isfinite(loss)
    torch.testing.assert_close(out["triton"][0], out["reference"][0], atol=1e-5, rtol=1e-5)
    for name, g in out["reference"][1].items():
        torch.testing.assert_close(out["triton"][1][name], g, atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().max() > 0 for g in out["reference"][1].values())


def test_lk_alpha_and_ce_differ_but_agree_in_direction():
    """Both train the draft towards the teacher: one step of each lowers the other's loss too."""
    model, batch, lm_head, draft_ids = tiny_setup(teacher_scale=3.0)
    losses = {}
    for kind in ("ce", "lk-alpha"):
        model.zero_grad()
        loss, _ = ttt_loss(model, batch, lm_head, draft_ids, ttt_length=2, attention="sdpa", loss_kernel="reference",
                           token_loss=TokenLoss(kind))
        losses[kind] = loss
    assert not torch.isclose(losses["ce"], losses["lk-alpha"])


def test_a_family_that_cannot_take_a_token_loss_refuses_it_in_one_line():
    with pytest.raises(ValueError, match=r"^--token-loss lk-lambda: the domino family trains with ce$"):
        TrainConfig(featureset="f", output="o", family="domino", token_loss="lk-lambda")
    with pytest.raises(ValueError, match="--keep-best picks by the held-out evaluation"):
        TrainConfig(featureset="f", output="o", keep_best=True, eval_fraction=0.0)
    TrainConfig(featureset="f", output="o", family="peagle", token_loss="tv")  # P-EAGLE takes them all


def keep_best_cfg(fs, **kw):
    def cfg(out):
        return small_cfg(fs, out, max_steps=6, max_batch_tokens=160, save_every=2, eval_fraction=0.2, eval_every=2,
                         token_loss="lk-lambda", keep_best=True, **kw)
    return cfg


def test_keep_best_exports_the_best_evaluation_and_records_it(tmp_path, smol_features):  # noqa: F811
    result = run_train(keep_best_cfg(smol_features)(tmp_path / "run"), silent=True)
    evals = [(h["step"], h["eval_sim_accept_len"]) for h in result["history"] if "eval_sim_accept_len" in h]
    assert [s for s, _ in evals] == [2, 4, 6]
    best_step, best_value = max(evals, key=lambda e: (e[1], -e[0]))  # the first of equals
    record = json.loads((tmp_path / "run" / "export" / TRAINING_FILE).read_text())
    assert record["token_loss"] == "lk-lambda" and record["lk_kl_decay"] == 3.0
    assert record["kept"] == "best" and record["step"] == best_step
    assert record["eval_sim_accept_len"] == best_value and record["last_step"] == 6
    assert record["last_eval_sim_accept_len"] == evals[-1][1]
    kept = load_file(str(tmp_path / "run" / "best" / "draft.safetensors"))
    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    for name, t in exported.items():  # the export is the kept weights, in the export's dtype
        assert torch.equal(t, kept[name].to(t.dtype)), name


def test_keep_best_resumed_after_a_stop_exports_the_same_bytes(tmp_path, smol_features):  # noqa: F811
    run_stopped_and_resumed(keep_best_cfg(smol_features), tmp_path, at=4)
    a = json.loads((tmp_path / "whole" / "export" / TRAINING_FILE).read_text())
    b = json.loads((tmp_path / "part" / "export" / TRAINING_FILE).read_text())
    assert a == b


def test_without_keep_best_the_last_step_is_exported_and_said_so(tmp_path, smol_features):  # noqa: F811
    run_train(small_cfg(smol_features, tmp_path / "run", max_steps=2, save_every=1), silent=True)
    record = json.loads((tmp_path / "run" / "export" / TRAINING_FILE).read_text())
    modes = record.pop("modes")
    template = {"chat_template_source": "target", "chat_template_sha256": record["chat_template_sha256"]}
    assert len(template["chat_template_sha256"]) == 64  # the feature set's template (sf-eval warns under another)
    assert record == {"token_loss": "ce", "lk_kl_scale": 1.0, "lk_kl_decay": 3.0, "kept": "last", "step": 2,
                      "eval_sim_accept_len": None, **template}
    # the feature set's samples (conftest's CHAT, read as it is: no recorded mode) all in the template's defaults
    assert list(modes) == [json.dumps({"chat_template_kwargs": {}, "reasoning": None}, sort_keys=True)]
    # sf-export's other layout keeps the record (sf-eval's default mode reads it)
    from specfoundry.train.export import ExportConfig, run_export

    run_export(ExportConfig(draft=str(tmp_path / "run"), output=str(tmp_path / "speculators"), format="speculators"))
    assert json.loads((tmp_path / "speculators" / TRAINING_FILE).read_text()) == {**record, "modes": modes}
    # a checkpoint's export says it is one, at its own step, with what holds for the whole run
    run_export(ExportConfig(draft=str(tmp_path / "run" / "checkpoints" / "step-0000002"), output=str(tmp_path / "ckpt")))
    assert json.loads((tmp_path / "ckpt" / TRAINING_FILE).read_text()) == {
        "token_loss": "ce", "lk_kl_scale": 1.0, "lk_kl_decay": 3.0, "modes": modes, "kept": "checkpoint", "step": 2,
        **template}


# ---- the DFlash family: the LK losses per block slot, the target's whole distribution the teacher ------

def dflash_lk_reference(model, batch, head, kind, *, num_anchors, gamma, seed):
    """test_dflash.py's block-by-block reference with the LK row loss in the soft CE's place."""
    from specfoundry.kernels.lk_loss import lk_rows_reference
    from tests.test_dflash import reference_loss

    return reference_loss(model, batch, head, num_anchors=num_anchors, gamma=gamma, seed=seed, teacher="soft",
                          row_loss=lambda z, p: lk_rows_reference(z[None], p[None], kind)[0][0])[0]


@pytest.mark.parametrize("kind", LK)
@pytest.mark.parametrize("loss_kernel", ["reference", "triton"])
def test_dflash_lk_losses_match_the_block_by_block_reference(kind, loss_kernel):
    """fp32; the chunked loss against the spelled-out one: summation order only (test_dflash.py's
    tolerances)."""
    from specfoundry.families.dflash.loss import dflash_loss
    from tests.test_dflash import TINY as DTINY
    from tests.test_dflash import loss_and_grads, make_batch, random_draft

    model = random_draft()
    head = torch.randn(DTINY.vocab_size, DTINY.hidden_size)
    batch = make_batch([14, 9], seed=4)
    kw = dict(num_anchors=5, gamma=7.0, seed=3)
    loss, grads = loss_and_grads(model, lambda: dflash_loss(
        model, batch, head, teacher="soft", label_chunk=2, loss_kernel=loss_kernel, attention="sdpa",
        token_loss=TokenLoss(kind), **kw)[0])
    ref, ref_grads = loss_and_grads(model, lambda: dflash_lk_reference(model, batch, head, kind, **kw))
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dflash_dpace_composes_with_an_lk_loss():
    """D-PACE weighs each slot by the draft's own acceptance so far: with LK-alpha its q_k =
    exp(-loss) is alpha itself. The kernel and reference paths agree, and the weights differ from
    the fixed decay's."""
    from specfoundry.families.dflash.loss import dflash_loss
    from tests.test_dflash import TINY as DTINY
    from tests.test_dflash import loss_and_grads, make_batch, random_draft

    model = random_draft()
    head = torch.randn(DTINY.vocab_size, DTINY.hidden_size)
    batch = make_batch([14, 9], seed=4)
    out = {}
    for impl in ("reference", "triton"):
        out[impl] = loss_and_grads(model, lambda impl=impl: dflash_loss(
            model, batch, head, teacher="soft", label_chunk=3, loss_kernel=impl, attention="sdpa", num_anchors=5,
            seed=3, objective="dpace", token_loss=TokenLoss("lk-alpha"))[0])
    torch.testing.assert_close(out["triton"][0], out["reference"][0], atol=1e-5, rtol=1e-5)
    for name, g in out["reference"][1].items():
        torch.testing.assert_close(out["triton"][1][name], g, atol=1e-5, rtol=1e-4, msg=name)
    fixed = dflash_loss(model, batch, head, teacher="soft", label_chunk=3, loss_kernel="reference", attention="sdpa",
                        num_anchors=5, seed=3, token_loss=TokenLoss("lk-alpha"))[0]
    assert not torch.isclose(fixed, out["reference"][0])


def test_dflash_lk_needs_the_soft_teacher_and_the_others_take_ce_only():
    from specfoundry.families.dflash.loss import dflash_loss
    from tests.test_dflash import TINY as DTINY
    from tests.test_dflash import make_batch, random_draft

    model = random_draft()
    head = torch.randn(DTINY.vocab_size, DTINY.hidden_size)
    with pytest.raises(ValueError, match="^--token-loss tv measures acceptance .*give --teacher soft"):
        dflash_loss(model, make_batch([9], seed=1), head, teacher="hard", num_anchors=2, attention="sdpa",
                    token_loss=TokenLoss("tv"))
    for family in ("domino", "dspark", "dflash2"):
        with pytest.raises(ValueError, match=f"the {family} family trains with ce$"):
            TrainConfig(featureset="f", output="o", family=family, token_loss="lk-alpha")
