"""EAGLE-3's named draft shapes and random drafts, for tests and benchmarks."""

from __future__ import annotations

import torch

from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.eagle3.ttt import TTTModule
from specfoundry.families.vocab import vocab_maps

LLAMA8B_DRAFT = Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, rope_theta=500000.0, max_position_embeddings=131072, vocab_size=128256,
                            draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=(1, 15, 28))
"""The EAGLE-3 draft of Llama-3.1-8B: H 4096, 32 query / 8 KV heads of 128, target vocab 128256 -> 32000."""

SMOL_DRAFT = Eagle3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, draft_vocab_size=16000, target_hidden_size=576,
                         aux_layer_ids=(1, 14, 26))
"""The EAGLE-3 draft of SmolLM2-135M: H 576, 9 query / 3 KV heads of 64, target vocab 49152 -> 16000."""


def random_eagle3_draft(cfg: Eagle3Config, vocab_stride: int, first_id: int = 0,
                        norms_off_one: bool = False) -> Eagle3Draft:
    """A draft of shape `cfg` with random weights (seed 0) and every `vocab_stride`-th target token
    from `first_id` in its vocabulary. norms_off_one: norm weights drawn from U(0.5, 1.5), so that
    a skipped or misplaced norm shows."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    d2t, t2d = vocab_maps(torch.arange(first_id, cfg.vocab_size, vocab_stride)[: cfg.draft_vocab_size],
                          cfg.vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    if norms_off_one:
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return draft


def random_ttt_module(cfg: Eagle3Config, vocab_stride: int, head_scale: float,
                      compile_elementwise: bool = True) -> TTTModule:
    """random_eagle3_draft with a random bf16 teacher head of scale `head_scale`, on the CPU: the
    caller moves or wraps it. compile_elementwise: as TTTModule's."""
    draft = random_eagle3_draft(cfg, vocab_stride)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * head_scale).to(torch.bfloat16)
    return TTTModule(draft, lm_head, compile_elementwise)


def llama8b_ttt_module(compile_elementwise: bool = True) -> TTTModule:
    """The 8B-shaped draft (every 4th token in the draft vocab, teacher head scale 0.02)."""
    return random_ttt_module(LLAMA8B_DRAFT, vocab_stride=4, head_scale=0.02, compile_elementwise=compile_elementwise)
