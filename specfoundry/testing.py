"""Shared test and benchmark helpers: a random feature-set writer, tiny random targets. A family's
named draft shapes and random drafts live in its folder (families/<name>/shapes.py).

Tests and `benchmarks/` import these from here, so no test imports a benchmark script.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specfoundry.common.files import atomic_write_json
from specfoundry.featureset.manifest import MANIFEST, new_manifest
from specfoundry.featureset.store import FeatureSet, shard_name, write_shard


def write_random_featureset(root: Path, n: int, t: int, cfg, codec: str = "safetensors",
                            dtype: str = "bfloat16", final_dtype: str | None = None,
                            teacher_k: int | None = None) -> FeatureSet:
    """A one-shard feature set (safetensors, bf16 unless told) of n samples of t tokens for a
    target of the shape of cfg, a draft config of any family, holding the layers it reads
    (target_layers), random features (seed 0; float8 is quantised from the same bf16 values),
    every token in the loss; with teacher_k, a random top-k teacher (the final states' softmax
    through a random head, kept to its top k) in the final state's place; opened with FeatureSet."""
    g = torch.Generator().manual_seed(0)
    layers = cfg.target_layers
    samples = [{"input_ids": torch.randint(0, cfg.vocab_size, (t,), generator=g),
                "loss_mask": torch.ones(t, dtype=torch.bool),
                "aux_hidden": torch.randn(t, len(layers) * cfg.hidden_size, generator=g).to(torch.bfloat16),
                "final_hidden": torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16)} for _ in range(n)]
    if teacher_k:
        from specfoundry.featureset.teacher import topk_teacher

        head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5 * 4
        for s in samples:
            s["teacher_ids"], s["teacher_probs"] = topk_teacher(s.pop("final_hidden").float(), head, teacher_k)
    rel = shard_name(0, codec)
    digest = write_shard(root, rel, samples, codec, dtype, final_dtype, layers=len(layers))
    manifest = new_manifest(target={"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}, aux_layer_ids=layers,
                            hidden_size=cfg.hidden_size, storage_dtype=dtype, final_storage_dtype=final_dtype,
                            codec=codec, teacher_k=teacher_k, shards=[{"path": rel, "sha256": digest, "num_samples": n,
                                                                       "sample_lengths": [t] * n}])
    atomic_write_json(root / MANIFEST, manifest)
    return FeatureSet(root)


# ---- tiny random targets of the architectures users bring (tests/test_architectures.py) --------

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)
"""What every tiny target shares: width 64, 8 layers (EAGLE-3's default layers [1, 3, 4] and
DFlash's [1, 2, 3, 4, 5] are distinct), 4 query / 2 KV heads."""

TINY_TARGETS = {
    "llama": dict(),
    "qwen3": dict(head_dim=32),  # head_dim stated apart from hidden / heads (16), as Qwen3's is
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma3_text": dict(head_dim=32, sliding_window=16),  # tied, scaled embeddings, 5 sliding : 1 full layers
    "mistral": dict(sliding_window=16),  # every layer slides
}
"""transformers model_type -> what its tiny target sets beyond TINY_SHAPE. The 16-token windows are
shorter than the gate's conversation, so the sliding layers really cut."""

TINY_PARALLEL_TARGETS = {
    "glm4_moe": dict(head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
}
"""More tiny targets, for the tensor-parallel tests only: GLM-4-MoE (one dense layer first, then
routed and shared experts)."""

TINY_MOE_TARGETS = {
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=2, topk_group=1),
}
"""More tiny targets, for the experts-implementation tests: DeepSeek-V3 (multi-head latent
attention, one dense layer first, then shared experts beside 8 routed ones picked within the best
of 2 groups)."""

QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
"""The reasoning rules of Qwen3's chat template, in ChatML (so SmolLM2's tokenizer renders it): the
turns after the last user message show their reasoning, `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`
(an empty block where there is none), the earlier ones only their answer; the generation prompt
is the non-thinking one (Qwen3's enable_thinking=False), which opens the turn with the empty block,
since a random target writes no reasoning of its own."""

QWEN3_THINKING_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
"""QWEN3_STYLE_TEMPLATE with Qwen3's `enable_thinking` (default on): thinking, the generation prompt is
the bare assistant header and the target writes its own <think> block; enable_thinking=False opens
the turn with the empty block, as Qwen3's template does."""

R1_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') if '</think>' in m.content else m.content %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
"""DeepSeek-R1's reasoning rules in ChatML: the generation prompt opens the <think> block (the
target's text starts inside it), and every assistant turn renders its answer alone, the reasoning
dropped."""

HARMONY_STYLE_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium')"
    " + '<|end|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if '<|channel|>' in m.content %}{{- raise_exception('channel tags belong in thinking, not content') }}{%- endif %}"
    "{%- if loop.last and not add_generation_prompt %}"
    "{%- if m.thinking is defined and m.thinking %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
"""The channel rules of gpt-oss's chat template (the harmony format), without its tools: the
reasoning effort a template argument in the system message; the assistant's reasoning taken from the
message's `thinking`, rendered in the analysis channel only for a conversation's last message
rendered for training, every other turn as its final channel alone; the last message ends with
<|return|>, earlier ones with <|end|>; the generation prompt is "<|start|>assistant" (the target
writes the channel header itself); channel tags in the content are refused, as gpt-oss's template does."""

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
"""The special tokens HARMONY_STYLE_TEMPLATE renders (added to SmolLM2's tokenizer by the tests)."""

TINY_TEMPLATES = {"qwen3": QWEN3_STYLE_TEMPLATE, "qwen3_moe": QWEN3_STYLE_TEMPLATE}
"""The chat template a tiny target is saved with, where not its tokenizer's own (SmolLM2's ChatML)."""

WORD = re.compile("Ġ[A-Za-z]+")
"""A byte-level BPE token (SmolLM2's) of a space and a word."""

LOGIT_SHARPNESS = 25.0
"""A random target's logits are nearly flat (weights of std 0.02): its final norm is scaled by this,
so that its greedy choices have the margins a trained model's have and the draft a teacher to fit."""


def write_tiny_target(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A randomly initialised `model_type` target (TINY_TARGETS) built from its transformers config,
    saved with the tokenizer of `tokenizer_dir` (whose vocabulary it takes) and its chat template, or
    the family's own (TINY_TEMPLATES). `overrides`: config fields set otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **{**TINY_SHAPE, **{**TINY_TARGETS, **TINY_PARALLEL_TARGETS, **TINY_MOE_TARGETS}[model_type],
                                     **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    norm = model.model.norm
    with torch.no_grad():  # Gemma's RMSNorm multiplies by (1 + weight), the others by weight
        if "Gemma" in type(norm).__name__:
            norm.weight.copy_(LOGIT_SHARPNESS * (1 + norm.weight) - 1)
        else:
            norm.weight.mul_(LOGIT_SHARPNESS)
        # Capture re-tokenizes an answer's text, and a random model's free choice of sub-word pieces
        # often does not tokenize back to itself (" Kand" "ack" reads back as " Kandack" split
        # otherwise), unlike a trained model's text: the target writes whole words (" word" tokens;
        # the others' output rows are shrunk, which in a tied model shrinks their inputs too).
        words = torch.tensor([bool(WORD.fullmatch(t)) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))])
        model.get_output_embeddings().weight[~words] *= 0.05
    model.save_pretrained(out)
    tokenizer.chat_template = TINY_TEMPLATES.get(model_type, tokenizer.chat_template)
    tokenizer.save_pretrained(out)
    return out


# ---- comparing fp32 results computed in another order -----------------------------------------

def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, rel: float, *, rows: bool = False, msg=None) -> None:
    """got equals want up to `rel` of want's largest magnitude (of each row's, with `rows`): the
    tolerance for two fp32 computations of one function in another order (other batch shapes,
    chunks, a cache against a full forward, another BLAS blocking). Their difference comes from the
    rounding of sums whose terms are as large as the largest entries (about sqrt(K) * 1.2e-7 of them
    for K terms), not from each element's own size: a per-element rtol fails on the small entries
    beside a large one on one machine's BLAS and passes on another's."""
    scale = want.abs().amax(-1, keepdim=True) if rows else want.abs().max()
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(got / scale, want / scale, atol=rel, rtol=0, msg=msg)
