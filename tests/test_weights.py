"""The target's weights are identified and read without reading the whole checkpoint
(common/weights.py): the fingerprint samples a bounded number of bytes, and a tensor is read from
the one shard the index names. benchmarks/identity.py measures the same on a 21 GB checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specfoundry.common import weights
from specfoundry.common.weights import read_target_tensor, weight_fingerprint, weight_fingerprint_v1


def write_sharded(root, tensors_per_shard: list[dict[str, torch.Tensor]]):
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(tensors_per_shard):
        name = f"model-{k + 1:05d}-of-{len(tensors_per_shard):05d}.safetensors"
        save_file(tensors, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    shards = [{f"model.layers.{3 * k + i}.mlp.weight": torch.randn(1024, 1024, generator=g) for i in range(3)}
              for k in range(3)]  # 3 shards of 12 MiB
    shards[0]["model.embed_tokens.weight"] = torch.randn(512, 64, generator=g)
    shards[2]["lm_head.weight"] = torch.randn(512, 64, generator=g)
    return write_sharded(tmp_path / "ckpt", shards), shards


class CountingFile:
    def __init__(self, f, counter):
        self.f, self.counter = f, counter

    def read(self, n=-1):
        data = self.f.read(n)
        self.counter[0] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_the_fingerprint_reads_a_bounded_sample_of_every_file(checkpoint, monkeypatch):
    root, _ = checkpoint
    counter = [0]
    monkeypatch.setattr(weights, "open", lambda path, mode="r": CountingFile(open(path, mode), counter), raising=False)
    fingerprint = weight_fingerprint(root)
    assert fingerprint.startswith("v2:")
    files = sorted(root.glob("*.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    # the rule: 64 samples of 16 KiB a file, each file's header, nothing else (the index via read_bytes)
    assert counter[0] == headers + len(files) * weights.SAMPLES_PER_FILE * weights.SAMPLE_BLOCK
    assert counter[0] < sum(f.stat().st_size for f in files) / 10
    monkeypatch.setattr(weights, "SAMPLE_BUDGET", 4 * weights.SAMPLE_BLOCK)  # a checkpoint of many files
    counter[0] = 0
    weight_fingerprint(root)
    assert counter[0] == headers + len(files) * 2 * weights.SAMPLE_BLOCK  # at least 2 samples a file


def test_the_fingerprint_changes_with_the_weights_and_only_with_them(checkpoint, tmp_path):
    root, shards = checkpoint
    same = write_sharded(tmp_path / "same", shards)
    assert weight_fingerprint(same) == weight_fingerprint(root)
    tuned = [{n: t * 1.001 if n == "model.layers.4.mlp.weight" else t for n, t in s.items()} for s in shards]
    assert weight_fingerprint(write_sharded(tmp_path / "tuned", tuned)) != weight_fingerprint(root)
    renamed = [{n.replace("layers.8.", "layers.9."): t for n, t in s.items()} for s in shards]
    assert weight_fingerprint(write_sharded(tmp_path / "renamed", renamed)) != weight_fingerprint(root)
    retyped = [{n: t.bfloat16() if n == "lm_head.weight" else t for n, t in s.items()} for s in shards]
    assert weight_fingerprint(write_sharded(tmp_path / "retyped", retyped)) != weight_fingerprint(root)


def test_a_fingerprint_recorded_by_the_rule_before_compares_by_that_rule(checkpoint, tmp_path):
    root, shards = checkpoint
    old = weight_fingerprint_v1(root)
    assert not old.startswith("v2:") and weight_fingerprint(root, like=old) == old
    assert weight_fingerprint(root, like=weight_fingerprint(root)) == weight_fingerprint(root)
    tuned = [{n: -t for n, t in s.items()} for s in shards]
    assert weight_fingerprint(write_sharded(tmp_path / "tuned", tuned), like=old) != old


def test_a_tensor_is_read_from_the_one_shard_the_index_names(checkpoint, monkeypatch):
    root, shards = checkpoint
    opened = []
    real = weights.safe_open
    monkeypatch.setattr(weights, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    torch.testing.assert_close(read_target_tensor(root, ("lm_head.weight",)), shards[2]["lm_head.weight"],
                               rtol=0, atol=0)
    assert [p.split("/")[-1] for p in opened] == ["model-00003-of-00003.safetensors"]
    (root / "model.safetensors.index.json").unlink()  # no index: the files in name order, until one holds it
    opened.clear()
    read_target_tensor(root, ("lm_head.weight",))
    assert len(opened) == 3
