"""Feature sets stored as packed codes (--storage-dtype fp6_e2m3 / fp4_e2m1, featureset/blockfp.py):
the shard layout, the loader's batches decoded on the device within the derived bound, SmolLM2's
features through sf-capture, sf-capture verify (sound, a NaN block scale, a negative one) and
training from such a set."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.cli import build_config
from specfoundry.families.eagle3.shapes import SMOL_DRAFT
from specfoundry.featureset import blockfp
from specfoundry.featureset.manifest import MANIFEST
from specfoundry.featureset.store import PACKED, FeatureSet, ShardReader, write_shard
from specfoundry.testing import write_random_featureset
from specfoundry.train.loader import FeatureLoader
from specfoundry.train.trainer import TrainConfig, run_train
from tests.conftest import CHAT, write_jsonl
from tests.test_fp8 import assert_decoded_close, stored_rows

DTYPES = sorted(PACKED)


def bound(rows: torch.Tensor, fmt: blockfp.Format) -> torch.Tensor:
    """blockfp's bound before the scales, per element of rows [..., H] (float32): absmax(block) D/(2G)
    (1 + 2^-3) + s D/2 2^-9, plus float32's 2^-22 of the element."""
    h = rows.shape[-1]
    block = rows.abs().unflatten(-1, (h // blockfp.BLOCK, blockfp.BLOCK)).amax(-1)
    scale = rows.abs().amax(-1, keepdim=True) / (fmt.largest * 448)
    d, g = fmt.largest_gap, fmt.largest
    per_block = block * d / (2 * g) * (1 + 2.0**-3) + scale * d / 2 * 2.0**-9
    return per_block.repeat_interleave(blockfp.BLOCK, dim=-1) + 2.0**-22 * rows.abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("final_dtype", [None, "bfloat16"])
def test_the_loader_hands_bf16_batches_within_the_bound_of_the_bf16_sets(tmp_path, dtype, final_dtype):
    """A packed set and a bf16 set of the same values: the stored rows are R bytes a layer, uint8 across
    the worker boundary, decoded in Batch.to by the set's storage dtype, within the bound plus one bf16
    rounding; the chosen layers keep their own bytes and scales; padding decodes to zeros."""
    fmt = PACKED[dtype]
    a = write_random_featureset(tmp_path / "packed", 6, 23, SMOL_DRAFT, "safetensors", dtype, final_dtype)
    b = write_random_featureset(tmp_path / "bf16", 6, 23, SMOL_DRAFT)
    h = SMOL_DRAFT.hidden_size
    assert ShardReader(a.shard_path(0), "safetensors", dtype, final_dtype).shape("aux_hidden") == (
        6 * 23, 3 * fmt.row_bytes(h))
    for layers in (None, [2, 0]):
        kw = dict(max_tokens=64, seed=0, num_workers=1, layers=layers)
        for _, x, y in zip(range(2), FeatureLoader(a, list(range(6)), **kw), FeatureLoader(b, list(range(6)), **kw),
                           strict=False):
            chosen = len(layers or [0, 1, 2])
            assert x.aux_hidden.dtype == torch.uint8 and x.aux_hidden.shape[-1] == chosen * fmt.row_bytes(h)
            assert x.aux_scale.shape == (*x.aux_hidden.shape[:2], chosen) and x.aux_storage == dtype
            assert_decoded_close(x, y, final_dtype, h, lambda rows: bound(rows, fmt))


@pytest.fixture(scope="module")
def packed_features(tmp_path_factory):
    """SmolLM2 features of CHAT in each packed dtype and in bf16, through sf-capture's own path (the
    codes made in the runner, on the capture device, before the writer)."""
    root = tmp_path_factory.mktemp("packed")
    src = write_jsonl(root / "chat.jsonl", CHAT)
    sets = {}
    for dtype in [*DTYPES, "bfloat16"]:
        run_capture(CaptureConfig(source=str(src), output=str(root / dtype), shard_size=3, max_length=64,
                                  codec="safetensors", storage_dtype=dtype, families=("eagle3",)), silent=True)
        sets[dtype] = root / dtype
    return sets


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_features_captured_packed_verify_and_read_within_the_bound(packed_features, dtype):
    fmt = PACKED[dtype]
    assert verify_featureset(packed_features[dtype]) == []
    packed, plain = FeatureSet(packed_features[dtype]), FeatureSet(packed_features["bfloat16"])
    h = plain.manifest["hidden_size"]
    for i in range(len(plain)):
        got, want = packed[i], plain[i]  # decoded to bf16 by the reader
        for name in ("aux_hidden", "final_hidden"):
            rows = getattr(want, name).float().unflatten(-1, (-1, h))
            err = (getattr(got, name).float().unflatten(-1, (-1, h)) - rows).abs()
            # the capture quantised the float32 features, bf16's copy rounded them: one 2^-8 each way
            assert (err <= bound(rows, fmt) * (1 + 2**-7) + 2**-7 * rows.abs()).all(), (i, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_names_a_nan_block_scale_and_a_negative_one(packed_features, tmp_path, dtype):
    fmt = PACKED[dtype]
    source = packed_features[dtype]
    manifest = json.loads((source / MANIFEST).read_text())
    layer = manifest["aux_layer_ids"][1]
    row = fmt.row_bytes(manifest["hidden_size"])
    for code, words in ((0x7F, f"aux_hidden holds NaN or Inf at sample 2, token 4, layer {layer}"),
                        (0xB8, f"aux_scale holds an impossible scale, .* at sample 2, token 4, layer {layer} "
                               r"\(a row's scale and its blocks' scales are never negative")):
        fs = tmp_path / f"fs{code}"
        shutil.copytree(source, fs)
        entry = manifest["shards"][1]
        rows = stored_rows(fs / entry["path"], dtype)
        blockfp.block_scales(rows[2]["aux_hidden"][4, row:2 * row], fmt)[3] = code  # the second layer's fourth block
        entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", dtype)  # a sound file of bad values
        (fs / MANIFEST).write_text(json.dumps(manifest))
        found = verify_featureset(fs)
        assert len(found) == 1 and re.search(words, found[0]), found


@pytest.mark.parametrize("dtype", DTYPES)
def test_eagle3_trains_from_a_packed_set(packed_features, tmp_path, dtype):
    cfg = build_config(TrainConfig, dict(featureset=str(packed_features[dtype]), output=str(tmp_path / "run"),
                                         family="eagle3", draft_vocab_size=256, ttt_length=2, lr=3e-3,
                                         warmup_steps=1, max_steps=2, max_batch_tokens=160, eval_fraction=0.0,
                                         save_every=2, num_workers=0, log_every=1000, loss_kernel="reference"))
    history = run_train(cfg, silent=True)["history"]
    assert len(history) == 2 and all(np.isfinite(x["loss_0"]) for x in history)
