"""Shared test and benchmark helpers: named draft shapes, a random feature-set writer, random drafts.

Tests and `benchmarks/` import these from here, so no test imports a benchmark script.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.files import atomic_write_json
from specfoundry.featureset.manifest import FORMAT, FORMAT_VERSION, MANIFEST
from specfoundry.featureset.store import FeatureSet, shard_name, write_shard
from specfoundry.train.dflash.config import DFlashConfig
from specfoundry.train.eagle3.config import Eagle3Config
from specfoundry.train.eagle3.model import Eagle3Draft
from specfoundry.train.eagle3.ttt import TTTModule
from specfoundry.train.vocab import vocab_maps

LLAMA8B_DRAFT = Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, rope_theta=500000.0, max_position_embeddings=131072, vocab_size=128256,
                            draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=(1, 15, 28))
"""The EAGLE-3 draft of Llama-3.1-8B: H 4096, 32 query / 8 KV heads of 128, target vocab 128256 -> 32000."""

SMOL_DRAFT = Eagle3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, draft_vocab_size=16000, target_hidden_size=576,
                         aux_layer_ids=(1, 14, 26))
"""The EAGLE-3 draft of SmolLM2-135M: H 576, 9 query / 3 KV heads of 64, target vocab 49152 -> 16000."""


QWEN3_8B_DFLASH = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                               vocab_size=151936, target_hidden_size=4096, target_layer_ids=(1, 9, 17, 25, 33),
                               block_size=16, mask_token_id=151669)
"""The DFlash draft of Qwen3-8B (the public drafts' shape): 5 layers, H 4096, intermediate 12288, 32 query /
8 KV heads of 128, block 16, target vocab 151936, target layers [1, 9, 17, 25, 33]."""


def write_random_featureset(root: Path, n: int, t: int, cfg: Eagle3Config | DFlashConfig) -> FeatureSet:
    """A one-shard safetensors (bf16) feature set of n samples of t tokens for a target of cfg's
    shape, holding the layers cfg reads, random features (seed 0), every token in the loss;
    opened with FeatureSet."""
    g = torch.Generator().manual_seed(0)
    layers = cfg.target_layer_ids if isinstance(cfg, DFlashConfig) else cfg.aux_layer_ids
    samples = [{"input_ids": torch.randint(0, cfg.vocab_size, (t,), generator=g),
                "loss_mask": torch.ones(t, dtype=torch.bool),
                "aux_hidden": torch.randn(t, len(layers) * cfg.hidden_size, generator=g).to(torch.bfloat16),
                "final_hidden": torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16)} for _ in range(n)]
    rel = shard_name(0, "safetensors")
    digest = write_shard(root, rel, samples, "safetensors", "bfloat16")
    atomic_write_json(root / MANIFEST, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "codec": "safetensors", "storage_dtype": "bfloat16",
        "aux_layer_ids": list(layers), "hidden_size": cfg.hidden_size,
        "target": {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        "shards": [{"path": rel, "sha256": digest, "num_samples": n, "sample_lengths": [t] * n}]})
    return FeatureSet(root)


def random_ttt_module(cfg: Eagle3Config, vocab_stride: int, head_scale: float,
                      compile_elementwise: bool = True) -> TTTModule:
    """A draft of shape `cfg` with random weights (seed 0), every `vocab_stride`-th target token
    in its vocabulary, and a random bf16 teacher head of scale `head_scale`, on the CPU: the
    caller moves or wraps it. compile_elementwise: as TTTModule's."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    d2t, t2d = vocab_maps(torch.arange(0, cfg.vocab_size, vocab_stride)[: cfg.draft_vocab_size], cfg.vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * head_scale).to(torch.bfloat16)
    return TTTModule(draft, lm_head, compile_elementwise)


def llama8b_ttt_module(compile_elementwise: bool = True) -> TTTModule:
    """The 8B-shaped draft (every 4th token in the draft vocab, teacher head scale 0.02)."""
    return random_ttt_module(LLAMA8B_DRAFT, vocab_stride=4, head_scale=0.02, compile_elementwise=compile_elementwise)
