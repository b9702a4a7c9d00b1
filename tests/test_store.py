"""The feature-set shard writers: the streamed safetensors file is what the library reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specfoundry.featureset.store import ShardReader, checksum, write_safetensors, write_shard


@pytest.mark.parametrize("block_rows", [[3, 1, 7], [5], [0, 4]])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float16, np.int64, np.uint8])
def test_streamed_safetensors_reads_back_as_the_concatenated_blocks(tmp_path, block_rows, dtype):
    rng = np.random.default_rng(0)
    blocks = {
        "b": [(rng.standard_normal((n, 5)) * 1000).astype(dtype) for n in block_rows],
        "a": [rng.integers(0, 100, size=(n,)).astype(np.int32) for n in block_rows],
        "one": [np.arange(3, dtype=np.int64)],
    }
    path = tmp_path / "x.safetensors"
    digest = write_safetensors(path, blocks)
    assert digest == checksum(path)
    assert (len(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")]) % 8) == 0
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == ["a", "b", "one"]
        for name, parts in blocks.items():
            got = f.get_tensor(name)
            assert got.dtype == parts[0].dtype
            np.testing.assert_array_equal(got, np.concatenate(parts))


def test_mixed_blocks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="differ in dtype or trailing shape"):
        write_safetensors(tmp_path / "x", {"a": [np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)]})


@pytest.mark.parametrize("codec", ["safetensors", "zarr"])
def test_shard_samples_read_back(tmp_path, codec):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9]
    samples = [{"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.5,
                "aux_hidden": torch.randn(n, 12, generator=g).bfloat16(),
                "final_hidden": torch.randn(n, 4, generator=g).bfloat16()} for n in lengths]
    digest = write_shard(tmp_path, "shards/s.x", samples, codec, "bfloat16")
    assert digest == checksum(tmp_path / "shards/s.x")
    assert not list((tmp_path / "shards").glob(".partial-*"))
    reader = ShardReader(tmp_path / "shards/s.x", codec, "bfloat16")
    assert len(reader) == len(samples)
    for i, s in enumerate(samples):
        got = reader.sample(i)
        assert torch.equal(got.input_ids.long(), s["input_ids"])
        assert torch.equal(got.loss_mask.bool(), s["loss_mask"])
        assert torch.equal(got.aux_hidden, s["aux_hidden"]) and torch.equal(got.final_hidden, s["final_hidden"])



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_equals_torch_isfinite_on_every_kind_of_value(dtype):
    """all_finite reads the exponent bits (float64 falls back to torch.isfinite): the same answer
    as torch.isfinite for the largest finite values, subnormals, signed zeros, Inf and NaN, alone
    and among ordinary values at any position."""
    from specfoundry.featureset.store import all_finite

    info = torch.finfo(dtype)
    specials = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0, 1.0], dtype=torch.float64)
    finite = torch.cat([specials.to(dtype), torch.randn(97).to(dtype)])  # subnormals stay subnormal in dtype
    assert all_finite(finite) and torch.isfinite(finite).all()
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 50, len(finite) - 1):
            x = finite.clone()
            x[at] = bad
            assert not all_finite(x)
            assert not all_finite(x.view(8, 13))  # any shape
