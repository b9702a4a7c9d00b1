"""A feature set of a top-k teacher in the final state's place (sf-capture --teacher-storage topk:K): the
stored top k against a plain reference, the draft-vocabulary teacher it gives against the one the
final state gives (equal on the kept mass), the set's layout, verify, training from it, and the
families that read the final state itself refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specfoundry.capture.stage import CaptureConfig, CaptureError, run_capture
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.cli import build_config
from specfoundry.families.eagle3.shapes import SMOL_DRAFT
from specfoundry.families.teacher import batch_teacher, sparse_teacher_targets, teacher_targets
from specfoundry.featureset.batch import Batch
from specfoundry.featureset.manifest import MANIFEST, FeatureSetError
from specfoundry.featureset.store import FeatureSet, ShardReader, write_shard
from specfoundry.featureset.teacher import parse_teacher, topk_teacher
from specfoundry.testing import write_random_featureset
from specfoundry.train.loader import FeatureLoader
from specfoundry.train.trainer import TrainConfig, run_train
from tests.conftest import CHAT, write_jsonl

FP16_REL = 2.0**-11
"""float16 rounds a stored probability to within 2^-11 of itself (normal values; the ones below 2^-14
are within 2^-25 absolutely, which the tests add)."""


def random_teacher(n=40, h=24, v=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    final = torch.randn(n, h, generator=g)
    head = torch.randn(v, h, generator=g) / h**0.5 * 3  # peaked enough that the top few hold most mass
    draft_ids = torch.sort(torch.randperm(v, generator=g)[:60]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    return final, head, draft_ids, t2d


def test_the_stored_top_k_is_the_full_softmax_at_its_k_most_probable_tokens():
    final, head, _, _ = random_teacher()
    ids, probs = topk_teacher(final, head, 7)
    assert ids.dtype == torch.int32 and probs.dtype == torch.float16 and ids.shape == probs.shape == (40, 7)
    full = torch.softmax(final @ head.T, dim=-1)  # [N, V] the reference
    want, where = torch.topk(full, 7, dim=-1)
    assert torch.equal(ids.long(), where)
    torch.testing.assert_close(probs.float(), want, rtol=FP16_REL, atol=2.0**-25)
    assert (probs[:, 1:] <= probs[:, :-1]).all()


@pytest.mark.parametrize("renormalise", [True, False])
def test_with_every_token_kept_the_sparse_teacher_is_the_dense_one(renormalise):
    final, head, draft_ids, t2d = random_teacher()
    dense = teacher_targets(final, head, draft_ids, t2d, renormalise=renormalise)
    ids, probs = topk_teacher(final, head, head.shape[0])
    sparse = sparse_teacher_targets(ids, probs, draft_ids, t2d, head.shape[0], renormalise=renormalise)
    # each kept probability carries float16's 2^-11 of itself (2^-25 absolute below float16's normals);
    # the renormalising sum's relative error is at most as large, and divides the absolute part by the
    # draft vocabulary's mass
    mass = teacher_targets(final, head, draft_ids, t2d, renormalise=False)[0].sum(-1, keepdim=True)
    floor = 2.0**-25 / (mass if renormalise else torch.ones_like(mass))
    assert ((sparse[0] - dense[0]).abs() <= 2 * FP16_REL * dense[0] + 2 * floor).all()
    assert torch.equal(sparse[1], dense[1]) and torch.equal(sparse[2], dense[2])


def test_with_k_kept_it_is_the_dense_teacher_on_the_kept_draft_tokens_and_zero_elsewhere():
    final, head, draft_ids, t2d = random_teacher(seed=3)
    dense, valid, target = teacher_targets(final, head, draft_ids, t2d, renormalise=False)  # full-softmax columns
    ids, probs = topk_teacher(final, head, 5)
    sparse, s_valid, s_target = sparse_teacher_targets(ids, probs, draft_ids, t2d, head.shape[0], renormalise=False)
    column = {int(t): c for c, t in enumerate(draft_ids)}
    kept = torch.zeros_like(dense, dtype=torch.bool)
    for r in range(len(ids)):
        for t in ids[r].tolist():
            if t in column:
                kept[r, column[t]] = True
    torch.testing.assert_close(sparse[kept], dense[kept], rtol=FP16_REL, atol=2.0**-25)
    assert not sparse[~kept].any()
    assert torch.equal(s_valid, valid) and torch.equal(s_target, target)  # the argmax is always kept
    renormalised = sparse_teacher_targets(ids, probs, draft_ids, t2d, head.shape[0])[0]
    rows = renormalised.sum(-1)
    assert torch.allclose(rows[kept.any(-1)], torch.ones(()), atol=1e-6) and not rows[~kept.any(-1)].any()


def test_the_teacher_option_names_a_bad_value():
    assert parse_teacher("final") is None and parse_teacher("topk:32") == 32
    for bad in ("topk", "topk:0", "topk:2000", "top:4", "sparse"):
        with pytest.raises(ValueError, match="give 'final'"):
            parse_teacher(bad)


def test_a_random_topk_set_is_read_and_batched_with_its_teacher(tmp_path):
    fs = write_random_featureset(tmp_path / "fs", 4, 19, SMOL_DRAFT, teacher_k=6)
    assert fs.teacher_k == 6 and fs.manifest["format_version"] == 4
    reader = ShardReader(fs.shard_path(0), "safetensors", fs.dtype, fs.final_dtype, 6)
    assert reader.shape("teacher_ids") == (4 * 19, 6) and "final_hidden" not in set(reader.file.keys())
    s = fs[1]
    assert s.final_hidden is None and s.teacher_ids.shape == (19, 6) and s.teacher_probs.dtype == torch.float16
    batch = next(iter(FeatureLoader(fs, [0, 1, 2, 3], max_tokens=64, seed=0, num_workers=0)))
    assert batch.final_hidden is None and batch.teacher_ids.shape[-1] == 6
    on = batch.to("cpu", torch.float32)
    vocab = SMOL_DRAFT.vocab_size
    head = torch.zeros(vocab, SMOL_DRAFT.hidden_size)  # unread by a top-k teacher but for its vocabulary size
    draft_ids = torch.arange(vocab)
    p, valid, _ = batch_teacher(on, head, draft_ids, torch.ones(vocab, dtype=torch.bool))
    assert p.shape == (on.input_ids.numel(), vocab) and p.dtype == torch.float32 and valid.all()
    real = torch.cat([torch.arange(n) + r * on.input_ids.shape[1] for r, n in enumerate(on.lengths)])
    torch.testing.assert_close(p[real].sum(-1), torch.ones(len(real)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="neither the final state nor a top-k teacher"):
        batch_teacher(Batch(on.input_ids, on.loss_mask, on.aux_hidden, None, on.lengths), head, draft_ids,
                      torch.ones(vocab, dtype=torch.bool))


@pytest.fixture(scope="module")
def topk_features(tmp_path_factory):
    """SmolLM2 features of CHAT with a top-8 teacher, through sf-capture."""
    root = tmp_path_factory.mktemp("topk")
    src = write_jsonl(root / "chat.jsonl", CHAT)
    run_capture(CaptureConfig(source=str(src), output=str(root / "fs"), shard_size=3, max_length=64,
                              codec="safetensors", teacher_storage="topk:8", families=("eagle3",)), silent=True)
    return root / "fs"


def test_smollm2_topk_capture_stores_the_teacher_and_not_the_final_state(topk_features, smollm2_target):
    manifest = json.loads((topk_features / MANIFEST).read_text())
    assert manifest["format_version"] == 4 and manifest["teacher"]["kind"] == "topk" and manifest["teacher"]["k"] == 8
    assert 0 < manifest["teacher"]["kept_mass_mean"] <= 1 + 8 * FP16_REL
    assert 0 <= manifest["teacher"]["kept_below_0999"] <= 1
    assert verify_featureset(topk_features) == []
    fs = FeatureSet(topk_features)
    s = fs[0]
    assert s.final_hidden is None and s.teacher_ids.shape == (len(s.input_ids), 8)
    # the stored ids are the target's own top 8 after each token
    from specfoundry.capture.runner import HFCaptureRunner

    fresh = HFCaptureRunner(smollm2_target, manifest["aux_layer_ids"])([s.input_ids.tolist()])[0]
    want = torch.topk(fresh["final_hidden"].float() @ smollm2_target.lm_head().float().T, 8, dim=-1).indices
    assert (s.teacher_ids.long() == want).float().mean() > 0.99  # ties aside, the same ids in the same order


def damaged_copy(source, tmp_path, shard: int, damage):
    """A copy of the top-8 set `source` whose shard `shard` is written again, sound as a file, after
    damage(rows, manifest) edited its samples (teacher arrays copied, so they may be edited); (the
    copy's folder, the shard's manifest entry)."""
    manifest = json.loads((source / MANIFEST).read_text())
    fs = tmp_path / "fs"
    shutil.copytree(source, fs)
    entry = manifest["shards"][shard]
    reader = ShardReader(fs / entry["path"], "safetensors", "bfloat16", "bfloat16", 8)
    rows = []
    for i in range(len(reader)):
        s = reader.sample(i)
        rows.append({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "aux_hidden": s.aux_hidden,
                     "teacher_ids": s.teacher_ids.clone(), "teacher_probs": s.teacher_probs.clone()})
    damage(rows, manifest)
    entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", "bfloat16")
    (fs / MANIFEST).write_text(json.dumps(manifest))
    return fs, entry


def test_verify_names_a_teacher_id_outside_the_vocabulary(topk_features, tmp_path):
    def outside(rows, manifest):
        rows[2]["teacher_ids"][4, 3] = manifest["target"]["vocab_size"]

    fs, entry = damaged_copy(topk_features, tmp_path, 1, outside)
    assert verify_featureset(fs) == [f"{entry['path']}: teacher_ids / teacher_probs hold an id outside the vocabulary "
                                     "at sample 2, token 4, the teacher"]


def train_config(fs, out, family, **options):
    return build_config(TrainConfig, dict(featureset=str(fs), output=str(out), family=family, draft_vocab_size=256,
                                          lr=3e-3, warmup_steps=1, max_steps=2, max_batch_tokens=160,
                                          eval_fraction=0.0, save_every=2, num_workers=0, log_every=1000,
                                          loss_kernel="reference", **options))


def test_eagle3_and_dflash_soft_train_from_a_topk_set_and_dspark_is_refused_naming_why(topk_features, tmp_path):
    history = run_train(train_config(topk_features, tmp_path / "e", "eagle3", ttt_length=2), silent=True)["history"]
    assert len(history) == 2 and all(np.isfinite(x["loss_0"]) for x in history)
    history = run_train(train_config(topk_features, tmp_path / "f", "dflash", teacher="soft", num_draft_layers=1,
                                     block_size=4, num_anchors=8, layers="14"), silent=True)["history"]
    assert len(history) == 2 and all(np.isfinite(x["loss_0"]) for x in history)
    with pytest.raises(FeatureSetError, match="stores a top-8 teacher instead of the final state, which dspark reads "
                                              "itself .*L1 term.*: capture with --teacher-storage final"):
        run_train(train_config(topk_features, tmp_path / "d", "dspark", num_draft_layers=1, block_size=4,
                               num_anchors=8, layers="14"), silent=True)


def test_a_bad_teacher_option_is_refused_before_any_work(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    with pytest.raises(CaptureError, match="--teacher-storage 'topk:0': give 'final'"):
        run_capture(CaptureConfig(source=str(src), output=str(tmp_path / "fs"), teacher_storage="topk:0"), silent=True)


def test_a_version_3_set_reads_as_one_that_stores_the_final_state(tmp_path):
    """Version 4 added `teacher`; a set written before it (no key) holds the final state."""
    fs = write_random_featureset(tmp_path / "fs", 3, 11, SMOL_DRAFT)
    path = tmp_path / "fs" / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["teacher"]
    path.write_text(json.dumps({**manifest, "format_version": 3}))
    old = FeatureSet(tmp_path / "fs")
    assert old.teacher_k is None and old.manifest["teacher"] == {"kind": "final_state"}
    assert torch.equal(old[1].final_hidden, fs[1].final_hidden)
    batch = next(iter(FeatureLoader(old, [0, 1, 2], max_tokens=64, seed=0, num_workers=0)))
    assert batch.final_hidden is not None and batch.teacher_ids is None
    path.write_text(json.dumps({**manifest, "teacher": {"kind": "topk", "k": 0}}))
    with pytest.raises(FeatureSetError, match="teacher .* is not one this specfoundry reads"):
        FeatureSet(tmp_path / "fs")


@pytest.mark.parametrize("damage", ["halved", "shifted"])
def test_verify_recompute_finds_aux_states_wrong_at_every_token_but_the_first(topk_features, tmp_path, damage):
    """SmolLM2's first token has states tens of times any other's: one relative error over the whole
    sample let every other token's states be halved, or be the next token's, and still pass. Each
    token's error per layer, its median over the sample, finds both."""

    def wrong(rows, manifest):
        aux = rows[1]["aux_hidden"]  # [T, L*H]
        if damage == "halved":
            aux[1:] = aux[1:] / 2
        else:  # each token's states those of the token after it (the first token's kept)
            aux[1:-1] = aux[2:].clone()

    fs, _ = damaged_copy(topk_features, tmp_path, 0, wrong)
    assert verify_featureset(fs) == []  # sound shards: only a fresh prefill can tell
    (problem,) = verify_featureset(fs, recompute=2)
    assert problem.startswith("sample 1: stored aux_hidden differs from a fresh prefill (layer "), problem


def test_the_median_row_error_is_not_hidden_by_one_massive_row():
    from specfoundry.featureset.store import median_row_error

    want = torch.randn(9, 2 * 16)
    want[0] *= 100  # the first token's massive activations
    got = want.clone()
    got[1:, 16:] /= 2  # the second layer halved at every token but the first
    whole = ((got - want).norm() / want.norm()).item()
    assert whole < 0.01  # what the sample-wide error saw
    torch.testing.assert_close(median_row_error(got, want, 2), torch.tensor([0.0, 0.5]))


def test_verify_recompute_compares_the_stored_teacher_with_a_fresh_prefills(topk_features, tmp_path):
    """--recompute reruns the target: a sound set agrees; probabilities halved at one token (still a
    descending row of mass below 1, so the shard's own checks pass) are named."""
    assert verify_featureset(topk_features, recompute=2) == []

    def halved(rows, manifest):
        rows[1]["teacher_probs"][3] /= 2

    fs, _ = damaged_copy(topk_features, tmp_path, 0, halved)
    assert verify_featureset(fs) == []
    assert verify_featureset(fs, recompute=2) == ["sample 1: the stored top-8 teacher differs from a fresh prefill's"]
