"""float8 (e4m3fn) feature sets: the per-row error bound on random rows and on SmolLM2's features
(its massive activations included), exact zero rows, the shard layout, the previous format
version, non-finite rows refused by name, the loader's bf16 batches, and training from a float8 set.

The bound tested (featureset/fp8.py derives it): per element,
    |dequantize(quantize(x)) - x| <= 2^-4 |x| + 2^-10 scale,   scale = absmax(row) / 448,
so at most 2^-4 of the row's absmax. Each test also checks the bound is nearly reached, so a
wrong scale or a truncating cast would fail it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specfoundry.capture.runner import HFCaptureRunner, NonFiniteFeatures, PendingCapture, pack
from specfoundry.capture.stage import (
    CaptureConfig,
    CaptureError,
    capture_shards,
    length_batches,
    plan_capture,
    prepare_samples,
    run_capture,
)
from specfoundry.capture.verify import verify_featureset
from specfoundry.common.cli import build_config
from specfoundry.common.progress import Progress
from specfoundry.common.settings import config_dict
from specfoundry.common.shards import OutputFolderError, ShardedOutput, check_output_folder
from specfoundry.families.eagle3.shapes import SMOL_DRAFT
from specfoundry.featureset import fp8
from specfoundry.featureset.manifest import MANIFEST, FeatureSetError
from specfoundry.featureset.store import FeatureSet, ShardReader, decode_state, encode_state, write_shard
from specfoundry.testing import write_random_featureset
from specfoundry.train.loader import FeatureLoader
from specfoundry.train.trainer import TrainConfig, run_train
from tests.conftest import CHAT, write_jsonl
from tests.data import make_featureset_v2 as v2

FP8 = "float8_e4m3fn"
V2_SETS = Path(__file__).parent / "data" / "featureset-v2"


def bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The per-element error bound of x [..., H] rows with scale [...]."""
    return fp8.RELATIVE_ERROR * x.abs() + fp8.SUBNORMAL_ERROR * scale.unsqueeze(-1)


def assert_within_bound(x: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor) -> None:
    """x, decoded [..., H] float32; scale [...]: every element within the bound, which is nearly reached."""
    err = (decoded - x).abs()
    limit = bound(x, scale)
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"
    assert worst > 0.5, f"error only {worst:.3f} x the bound: is the bound or the test wrong?"
    # stated against the row's absmax: at most 2^-4 of it (+ the subnormal term, 2^-10/448 of it)
    absmax = x.abs().amax(-1, keepdim=True)
    assert (err <= (fp8.RELATIVE_ERROR + fp8.SUBNORMAL_ERROR / fp8.E4M3_MAX) * absmax).all()


def random_rows(dtype: torch.dtype) -> torch.Tensor:
    """[64, 3, 256] rows of many kinds: Gaussian, heavy-tailed over six decades, one massive element
    per row, and rows at very small and very large scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 256, generator=g)
    x[16:32] *= torch.exp(3 * torch.randn(16, 3, 256, generator=g))
    x[32:48, :, 7] = 3e4  # a massive activation: the rest of the row falls partly into subnormals
    x[48:56] *= 1e-20
    x[56:64] *= 1e20
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_round_trip_within_the_e4m3_bound(dtype):
    x = random_rows(dtype)
    values, scale = fp8.quantize(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    torch.testing.assert_close(scale, x.float().abs().amax(-1) / 448, rtol=0, atol=0)  # absmax / 448 exactly
    assert_within_bound(x.float(), fp8.dequantize(values, scale, torch.float32), scale)
    # the row's largest element takes e4m3's largest value, so the whole range is used
    assert (values.float().abs().amax(-1) == 448).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_gives_the_float32_product_cast_once(dtype):
    """Every e4m3fn bit pattern (NaN included) times scales from 0 through subnormal-making to huge:
    dequantize's bf16-then-mul path gives the bits of the float32 product cast to dtype."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).repeat(6, 1)  # [6, 256]
    scale = torch.tensor([0.0, 1e-30, 2.0**-9 / 448, 0.37, 1.0, 3e4])  # [6]
    ref = (values.float() * scale.unsqueeze(-1)).to(dtype)
    torch.testing.assert_close(fp8.dequantize(values, scale, dtype), ref, rtol=0, atol=0, equal_nan=True)


def test_zero_rows_round_trip_exactly_and_nonfinite_rows_are_found():
    x = torch.randn(4, 3, 16)
    x[1, 2] = 0.0
    x[3] = 0.0
    values, scale = fp8.quantize(x)
    assert scale[1, 2] == 0 and (scale[3] == 0).all()
    back = fp8.dequantize(values, scale, torch.float32)
    assert torch.equal(back[1, 2], torch.zeros(16)) and torch.equal(back[3], torch.zeros(3, 16))
    assert torch.isfinite(back).all() and fp8.find_nonfinite(scale) is None and fp8.is_finite(values, scale)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2, 1, 5] = bad
        y[3, 0, 0] = bad  # a later one: the first is named
        v, s = fp8.quantize(y)
        assert fp8.find_nonfinite(s) == (2, 1)
    nan_byte = values.clone()
    nan_byte.view(torch.uint8)[0, 0, 3] = 0xFF  # e4m3fn's NaN, as a damaged file could hold
    assert not fp8.is_finite(nan_byte, scale)


def mixed_samples(k: int = 3, h: int = 16, lengths=(5, 1, 9)) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        aux = (torch.randn(n, k * h, generator=g) * 4).bfloat16()
        aux[0, :h] = 0  # a padding-like zero row: layer 0 of the first token
        out.append({"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.5,
                    "aux_hidden": aux, "final_hidden": torch.randn(n, h, generator=g).bfloat16()})
    return out


def raw_arrays(path: Path, codec: str) -> dict[str, np.ndarray]:
    """Every array of a shard straight from the file, with the dtype names of its header/metadata."""
    if codec == "safetensors":
        with safe_open(str(path), framework="numpy") as f:
            header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
            return {name: (f.get_tensor(name), header[name]["dtype"]) for name in f.keys()}
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return {name: (a[...], str(a.dtype)) for name, a in group.arrays()}


@pytest.mark.parametrize("codec", ["safetensors", "zarr"])
@pytest.mark.parametrize("final_dtype", [None, "bfloat16"])
def test_float8_shard_layout_with_mixed_lengths(tmp_path, codec, final_dtype):
    """Values as e4m3 bit patterns (uint8), float32 scales [N, K] and [N, 1] beside them, samples
    back to back; the reader gives each sample its own rows, decoded or as stored."""
    samples, k, h = mixed_samples(), 3, 16
    write_shard(tmp_path, "s", samples, codec, FP8, final_dtype)
    arrays = raw_arrays(tmp_path / "s", codec)
    n = sum(len(s["input_ids"]) for s in samples)
    want = {"offsets", "input_ids", "loss_mask", "aux_hidden", "aux_scale", "final_hidden"}
    assert set(arrays) == want | ({"final_scale"} if final_dtype is None else set())
    u8, f32, u16 = ("U8", "F32", "U16") if codec == "safetensors" else ("uint8", "float32", "uint16")
    assert [arrays["aux_hidden"][1], arrays["aux_scale"][1]] == [u8, f32]
    assert arrays["aux_hidden"][0].shape == (n, k * h) and arrays["aux_scale"][0].shape == (n, k)
    aux = torch.cat([s["aux_hidden"] for s in samples])  # [N, K*H]
    values, scale = fp8.quantize(aux.view(n, k, h))
    assert np.array_equal(arrays["aux_scale"][0], scale.numpy())
    assert np.array_equal(arrays["aux_hidden"][0], values.view(torch.uint8).view(n, k * h).numpy())
    assert arrays["aux_scale"][0][0, 0] == 0  # the zero row
    if final_dtype is None:
        assert arrays["final_hidden"][1] == u8 and arrays["final_scale"][0].shape == (n, 1)
    else:  # bf16 as always: its uint16 bit pattern, no scale
        assert arrays["final_hidden"][1] == u16
    reader = ShardReader(tmp_path / "s", codec, FP8, final_dtype)
    start = 0
    for i, s in enumerate(samples):
        t = len(s["input_ids"])
        got, raw = reader.sample(i), reader.sample(i, decode=False)
        assert torch.equal(got.input_ids, s["input_ids"]) and torch.equal(got.loss_mask, s["loss_mask"])
        assert raw.aux_hidden.dtype == torch.float8_e4m3fn and torch.equal(raw.aux_scale, scale[start : start + t])
        assert got.aux_hidden.dtype == torch.bfloat16 and got.aux_scale is None
        assert torch.equal(got.aux_hidden, fp8.dequantize(values[start : start + t], scale[start : start + t]).view(t, -1))
        assert torch.equal(got.aux_hidden[0, :h], torch.zeros(h, dtype=torch.bfloat16))  # exactly zero
        if final_dtype == "bfloat16":
            assert torch.equal(got.final_hidden, s["final_hidden"]) and raw.final_scale is None
        start += t


@pytest.mark.parametrize("codec", ["safetensors", "zarr"])
def test_a_set_of_the_previous_format_version_reads_and_verifies(codec):
    """tests/data/featureset-v2 was written by the version-2 writer (tests/data/make_featureset_v2.py)."""
    root = V2_SETS / codec
    assert json.loads((root / MANIFEST).read_text())["format_version"] == 2
    fs = FeatureSet(root)
    assert fs.final_dtype == fs.dtype == "bfloat16" and len(fs) == len(v2.LENGTHS)
    for i in range(len(fs)):
        want, got = v2.sample(i), fs[i]
        for name in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"):
            assert torch.equal(getattr(got, name), want[name]), name
    assert verify_featureset(root) == []
    batch = next(iter(FeatureLoader(fs, [0, 1, 2], max_tokens=64, seed=0, num_workers=0)))
    assert batch.aux_scale is None and batch.to("cpu", torch.float32).aux_hidden.dtype == torch.float32


def test_a_manifest_that_misnames_the_storage_dtype_is_refused_in_one_line(tmp_path):
    shutil.copytree(V2_SETS / "safetensors", tmp_path / "fs")
    path = tmp_path / "fs" / MANIFEST
    manifest = json.loads(path.read_text())
    for dtype, words in (("float8", r"storage_dtype 'float8' is not one this specfoundry reads"),
                         (FP8, r"shard-000000.safetensors: no aux_scale or final_scale array, which scaled states need")):
        path.write_text(json.dumps({**manifest, "storage_dtype": dtype}))
        with pytest.raises(FeatureSetError, match=words):
            FeatureSet(tmp_path / "fs")[0]
    assert "no aux_scale or final_scale array" in verify_featureset(tmp_path / "fs")[0]


@pytest.mark.parametrize("final_dtype", [None, "bfloat16"])
def test_the_loader_hands_bf16_batches_close_to_the_bf16_sets(tmp_path, final_dtype):
    """A float8 set and a bf16 set of the same values: batches on the device (here the CPU) hold
    bf16 within the float8 bound plus one bf16 rounding; the chosen layers keep their own scales;
    float8 crosses the worker boundary as float8 (the decoding happens in Batch.to)."""
    a = write_random_featureset(tmp_path / "fp8", 6, 23, SMOL_DRAFT, "safetensors", FP8, final_dtype)
    b = write_random_featureset(tmp_path / "bf16", 6, 23, SMOL_DRAFT)
    h = SMOL_DRAFT.hidden_size
    for layers in (None, [2, 0]):
        kw = dict(max_tokens=64, seed=0, num_workers=1, layers=layers)
        for _, x, y in zip(range(2), FeatureLoader(a, list(range(6)), **kw), FeatureLoader(b, list(range(6)), **kw),
                           strict=False):
            assert x.aux_hidden.dtype == torch.float8_e4m3fn
            assert x.aux_scale.shape == (*x.aux_hidden.shape[:2], len(layers or [0, 1, 2]))
            assert_decoded_close(x, y, final_dtype, h, lambda rows: bound(rows, rows.abs().amax(-1) / 448))


def assert_decoded_close(stored, plain, final_dtype, h: int, element_bound) -> None:
    """Batches of a scaled set and of the bf16 set of the same values, decoded to bf16 by Batch.to:
    every state within element_bound(rows [B, T, L, H]) of the bf16 values plus one bf16 rounding, a
    bf16 final state equal, padding exact zeros."""
    got, want = stored.to("cpu", torch.bfloat16), plain.to("cpu", torch.bfloat16)
    assert got.aux_scale is None and got.final_scale is None and got.lengths == want.lengths
    for name in ("aux_hidden", "final_hidden"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        if name == "final_hidden" and final_dtype == "bfloat16":
            assert torch.equal(g, w)
            continue
        rows = w.float().unflatten(-1, (-1, h))  # [B, T, L, H]: what was quantised
        err = (g.float().unflatten(-1, (-1, h)) - rows).abs()
        # the bound B, then the bf16 rounding of the decoded value d: 2^-8 |d| <= 2^-8 (|x| + B)
        assert (err <= element_bound(rows) * (1 + 2**-8) + 2**-8 * rows.abs()).all()
    for r, n in enumerate(got.lengths):  # padding decodes to exact zeros
        assert not got.aux_hidden[r, n:].any()


def test_one_packed_copy_gives_every_array_back_and_names_a_nonfinite_row():
    """The runner's device-to-host copy: each array's per-sample pieces in one flat byte buffer,
    widest dtype first, read back as aligned views (here the "host" copy is a clone on the CPU)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4]
    values, scale = fp8.quantize(torch.randn(8, 2, 5, generator=g))
    arrays = {"aux_hidden": values.view(8, 10), "aux_scale": scale,
              "final_hidden": torch.randn(8, 5, generator=g).bfloat16()}
    pieces = {name: list(a.split(lengths)) for name, a in arrays.items()}
    flat, views = pack(pieces)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(a.numel() * a.element_size() for a in arrays.values())
    host = flat.clone()
    back = views(host)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and torch.equal(back[name].view(torch.uint8), a.view(torch.uint8)), name
        assert back[name].untyped_storage().data_ptr() == host.untyped_storage().data_ptr()  # a view, not a copy
    back["aux_scale"][5, 1] = float("inf")  # token 5 of the batch: sample 2's token 1, its second layer
    pending = PendingCapture(lengths, back, None, 7, ["layer 3", "layer 9"])
    with pytest.raises(NonFiniteFeatures, match="batch 7 sample 2: token 1, layer 9: absmax inf"):
        pending.result()


# ---- SmolLM2 -------------------------------------------------------------------------------------

@pytest.fixture
def target(smollm2_target):
    return smollm2_target


@pytest.fixture(scope="module")
def fp8_features(tmp_path_factory):
    """SmolLM2 features of CHAT in float8, with the layers of both families (EAGLE-3 reads three of
    the six), through sf-capture's own path: quantised in the runner, before the writer."""
    root = tmp_path_factory.mktemp("fp8")
    src = write_jsonl(root / "chat.jsonl", CHAT)
    run_capture(CaptureConfig(source=str(src), output=str(root / "fs"), shard_size=3, max_length=64,
                              codec="safetensors", storage_dtype=FP8, families=("eagle3", "dflash")), silent=True)
    return root / "fs"


def test_smollm2_features_round_trip_within_the_bound_massive_rows_included(target, chat_file):
    tok = target.tokenizer
    samples, _, _, _ = prepare_samples(CaptureConfig(source=str(chat_file), output="unused"), tok)
    batch = [s["input_ids"] for s in samples]  # mixed lengths: one right-padded batch
    plain = HFCaptureRunner(target, [1, 14, 26])(batch)  # fp32, as the model computes them
    encoded = HFCaptureRunner(target, [1, 14, 26], storage=(FP8, "bfloat16"))(batch)  # padded batch, one pass
    massive = 0
    for p, e in zip(plain, encoded, strict=True):
        t = len(p["aux_hidden"])
        rows = p["aux_hidden"].view(t, 3, -1)  # [T, 3, H]
        assert e["aux_hidden"].dtype == torch.float8_e4m3fn and e["aux_scale"].shape == (t, 3)
        # quantised in the runner as the writer would have quantised the fp32 features
        values, scale = encode_state(p["aux_hidden"], FP8, 3)
        assert torch.equal(e["aux_hidden"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(e["aux_scale"], scale)
        assert_within_bound(rows, decode_state(e["aux_hidden"], e["aux_scale"], torch.float32).view(t, 3, -1), scale)
        absmax = rows.abs().amax(-1)  # [T, 3]
        massive += int((absmax > 100 * absmax.median()).sum())
        assert torch.equal(e["final_hidden"], p["final_hidden"].bfloat16()) and "final_scale" not in e
    assert massive >= 4  # SmolLM2's massive activations (absmax in the thousands) are among the rows tested


def test_a_nonfinite_row_is_refused_naming_sample_token_and_layer(tmp_path, target):
    model, tok, identity = target.model, target.tokenizer, target.identity
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    cfg = CaptureConfig(source=str(src), output=str(tmp_path / "fs"), shard_size=3, max_length=64, storage_dtype=FP8)
    plan = plan_capture(cfg, tok, identity)
    # the last stored layer: an Inf in an earlier one spreads NaN to every token of the layers after
    # it (attention weighs it by 0, and 0 * Inf is NaN), and the first non-finite row is named
    layer = model.model.layers[26]

    def overflow(module, args, output):
        (output[0] if isinstance(output, tuple) else output)[:, 2, 5] = float("inf")  # token 2 of every row

    hook = layer.register_forward_hook(overflow)  # before the runner's tap, so the tap sees it
    runner = HFCaptureRunner(target, list(plan.cfg.aux_layers), storage=(FP8, FP8))
    try:
        with pytest.raises(CaptureError) as e, Progress(None, "sample", "t", silent=True) as progress:
            capture_shards(plan, runner, [0], ShardedOutput(tmp_path / "fs"), progress)
    finally:
        hook.remove()
        runner.tap.remove()
    part = plan.part(0)
    first = part[length_batches([len(x["input_ids"]) for x in part], cfg.max_batch_tokens)[0][0]]["id"]
    message = str(e.value)
    assert "\n" not in message
    assert f"sample {first}: token 2, layer 26: the target's hidden state has absmax inf" in message
    assert not list((tmp_path / "fs").glob("shards/*.done.json"))  # nothing of it is stored


def stored_rows(shard, dtype: str = FP8):
    """A scaled shard's samples as stored (codes and scales, not decoded), one dict each, the
    scales copied so that a test can damage them and write the shard again."""
    reader = ShardReader(shard, "safetensors", dtype)
    rows = [reader.sample(i, decode=False) for i in range(len(reader))]
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask, "aux_hidden": s.aux_hidden, "final_hidden": s.final_hidden,
             "aux_scale": s.aux_scale.clone(), "final_scale": s.final_scale} for s in rows]


def test_verify_checks_a_float8_set_and_names_a_nonfinite_row(fp8_features, tmp_path):
    assert verify_featureset(fp8_features) == []
    manifest = json.loads((fp8_features / MANIFEST).read_text())
    assert (manifest["format_version"], manifest["storage_dtype"], manifest["final_storage_dtype"]) == (4, FP8, FP8)
    fs = tmp_path / "fs"
    shutil.copytree(fp8_features, fs)
    entry = manifest["shards"][1]
    rows = stored_rows(fs / entry["path"])
    rows[2]["aux_scale"][4, 3] = float("nan")  # token 4, the fourth stored layer
    entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", FP8)  # a sound file of bad values
    (fs / MANIFEST).write_text(json.dumps(manifest))
    layer = manifest["aux_layer_ids"][3]
    assert verify_featureset(fs) == [f"{entry['path']}: aux_hidden holds NaN or Inf at sample 2, token 4, layer {layer}"]
    with pytest.raises(FeatureSetError, match=rf"shard {entry['path']} sample 2 .*non-finite"):
        batches = FeatureLoader(FeatureSet(fs), list(range(6)), max_tokens=4096, seed=0, num_workers=0)
        next(iter(batches))


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_each_family_trains_from_a_float8_set(fp8_features, tmp_path, family):
    options = {"dflash": dict(num_draft_layers=3, block_size=4, num_anchors=16)}.get(family, {})
    cfg = build_config(TrainConfig, dict(featureset=str(fp8_features), output=str(tmp_path / "run"), family=family,
                                         draft_vocab_size=256, ttt_length=2, lr=3e-3, warmup_steps=1, max_steps=2,
                                         max_batch_tokens=160, eval_fraction=0.0, save_every=2, num_workers=0,
                                         log_every=1000, loss_kernel="reference", **options))
    history = run_train(cfg, silent=True)["history"]
    assert len(history) == 2 and all(np.isfinite(x["loss_0"]) for x in history)
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


def test_a_capture_begun_before_final_storage_dtype_existed_still_resumes(tmp_path):
    """Its capture_config.json lacks the setting; left unset (None: as --storage-dtype) it is the
    same run, given it is another."""
    cfg = CaptureConfig(source="chat.jsonl", output=str(tmp_path))
    old = config_dict(cfg)
    del old["final_storage_dtype"]
    (tmp_path / "capture_config.json").write_text(json.dumps(old))
    check_output_folder(tmp_path, "capture", cfg)
    with pytest.raises(OutputFolderError, match=r"final_storage_dtype: '<unset>' -> 'bfloat16'"):
        check_output_folder(tmp_path, "capture", replace(cfg, final_storage_dtype="bfloat16"))


@pytest.mark.parametrize("bad, words", [(-0.5, "-0.5"), (0.0, "0.0")])
def test_verify_names_an_impossible_scale(fp8_features, tmp_path, bad, words):
    """A negative scale flips every value's sign, a zero one beside non-zero values reads the row as
    zeros: both decode to finite numbers, so verify checks the scales themselves (before: ok)."""
    manifest = json.loads((fp8_features / MANIFEST).read_text())
    fs = tmp_path / "fs"
    shutil.copytree(fp8_features, fs)
    entry = manifest["shards"][1]
    rows = stored_rows(fs / entry["path"])
    assert bool((rows[2]["aux_hidden"][4].view(torch.uint8) & 0x7F).any())  # the row holds non-zero values
    rows[2]["aux_scale"][4, 1] = bad  # token 4, the second stored layer
    entry["sha256"] = write_shard(fs, entry["path"], rows, "safetensors", FP8)
    (fs / MANIFEST).write_text(json.dumps(manifest))
    layer = manifest["aux_layer_ids"][1]
    assert verify_featureset(fs) == [f"{entry['path']}: aux_scale holds an impossible scale, {words} at sample 2, "
                                     f"token 4, layer {layer} (a scale is absmax/448: never negative, and 0 only for "
                                     "a row of zeros)"]
