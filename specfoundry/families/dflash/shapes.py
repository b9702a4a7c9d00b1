"""DFlash's named draft shapes, for tests and benchmarks."""

from __future__ import annotations

from specfoundry.families.dflash.config import DFlashConfig

QWEN3_8B_DFLASH = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                               vocab_size=151936, target_hidden_size=4096, target_layer_ids=(1, 9, 17, 25, 33),
                               block_size=16, mask_token_id=151669)
"""The DFlash draft of Qwen3-8B (the public drafts' shape): 5 layers, H 4096, intermediate 12288, 32 query /
8 KV heads of 128, block 16, target vocab 151936, target layers [1, 9, 17, 25, 33]."""
