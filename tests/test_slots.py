"""The hf backend's slot engine (continuous batching) against `model.generate` on a tiny random
Llama in fp32: greedy output token for token, with prompts of spread lengths, more requests than
slots, and follow-up requests joining while others run; seeded samples that do not depend on
which requests share the batch. Its decode step attends over the unexpanded KV cache (full,
sliding-window and mixed layouts), to the same result as transformers' repeat_kv path."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.integrations import sdpa_attention

from specfoundry.common.target import Target, mask_layout
from specfoundry.decoding.attention import one_query_folded_attention
from specfoundry.generate.backends.hf import HFBackend
from specfoundry.generate.backends.interface import Request, SamplingConfig
from specfoundry.generate.backends.sampling import next_tokens, uniform
from specfoundry.generate.backends.slots import SLOT_ATTENTION, SlotEngine, supported

# every graph-replay test runs twice: on a GPU (captured graphs, `-m gpu`) and on a CPU, where
# decoding/graphs.CapturedCall does eagerly what a replay does and fails on any host read
GRAPH_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

STOP = 13  # a token this random model emits in some answers: some stop early, others hit the cap


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 96, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def reference(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=STOP, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(model, items, sampling, slots, follow=lambda tag, ids: (), sync_every=None):
    results = {}

    def on_done(tag, ids):
        results[tag] = ids
        return follow(tag, ids)

    SlotEngine(Target.wrap(model), slots=slots, stop_ids=[STOP], sampling=sampling, sync_every=sync_every).run(items, on_done)
    return results


# a CPU looks at the slots after every step; a GPU every few (finished slots step on, unchanged)
@pytest.mark.parametrize("sync_every", [1, 5])
def test_greedy_equals_model_generate_with_refills_and_follow_ups(model, sync_every):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=20)
    first = prompts(9)

    def follow(tag, ids):  # each of the first requests asks once more, on its answer (a second turn)
        return [(first[tag] + ids + [5, 6], 0, ("again", tag))] if isinstance(tag, int) else []

    results = run(model, [(p, 0, i) for i, p in enumerate(first)], sampling, slots=3, follow=follow,
                  sync_every=sync_every)
    assert len(results) == 18
    stopped = 0
    for i, p in enumerate(first):
        assert results[i] == reference(model, p, 20), f"request {i}"
        again = first[i] + results[i] + [5, 6]
        assert results[("again", i)] == reference(model, again, 20), f"follow-up of {i}"
        stopped += results[i][-1] == STOP
    assert 0 < stopped < 9  # both kinds of finish were exercised


def test_samples_depend_on_the_seed_not_on_the_batch(model):
    sampling = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=12)
    items = [(p, 100 + i, i) for i, p in enumerate(prompts(7, seed=1))]
    alone = {i: run(model, [item], sampling, slots=1)[i] for i, item in enumerate(items)}
    assert run(model, items, sampling, slots=3) == alone
    assert run(model, items[::-1], sampling, slots=7) == alone
    reseeded = run(model, [(p, seed + 1, tag) for p, seed, tag in items], sampling, slots=3)
    assert reseeded != alone


def test_the_sampler_draws_from_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    seeds = torch.arange(20000)
    counts = torch.bincount(next_tokens(logits, SamplingConfig(temperature=1.0), seeds, seeds * 0), minlength=4)
    torch.testing.assert_close(counts / 20000, probs, atol=0.015, rtol=0)  # ~4 standard errors at 20,000 draws
    top = next_tokens(logits, SamplingConfig(temperature=1.0, top_k=2), seeds, seeds * 0)
    assert set(top.tolist()) == {0, 1}
    nucleus = next_tokens(logits, SamplingConfig(temperature=1.0, top_p=0.7), seeds, seeds * 0)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7
    u = uniform(seeds, seeds * 0 + 3)
    assert 0 < u.min() and u.max() < 1 and not torch.equal(u, uniform(seeds, seeds * 0 + 4))


def test_the_backend_falls_back_to_generate_where_the_engine_cannot_run(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    assert supported(model) and HFBackend(Target.wrap(model, tok), engine="slots").engine == "slots"
    assert HFBackend(Target.wrap(model, tok)).engine == "generate"  # auto: the slot engine on a GPU only
    model.config._attn_implementation = "flash_attention_2"  # a kernel that ignores our 4D masks
    try:
        assert not supported(model) and HFBackend(Target.wrap(model, tok)).engine == "generate"
        with pytest.raises(ValueError, match="--hf-engine slots cannot drive this model"):
            HFBackend(Target.wrap(model, tok), engine="slots")
    finally:
        model.config._attn_implementation = "sdpa"
    # both engines answer a round of requests alike (greedy)
    requests = [Request(tag=i, seed=0, text=t) for i, t in enumerate(["a b c", "hello there, how", "x"])]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=10)
    slots = HFBackend(Target.wrap(model, tok), batch_size=2).generate(requests, sampling)
    plain = HFBackend(Target.wrap(model, tok), batch_size=2, engine="generate").generate(requests, sampling)
    assert [g.token_ids for g in slots] == [g.token_ids for g in plain]


def test_the_memory_check_counts_what_the_caching_allocator_holds_unused(model, monkeypatch):
    """A KV cache that fits only in blocks torch's allocator has cached (left by an earlier
    model.generate batch, say) is allowed; one larger than free plus cached memory is refused."""
    from specfoundry.generate.backends.slots import EngineMemoryError, kv_bytes_per_token

    engine = SlotEngine(Target.wrap(model), slots=8, stop_ids=[STOP],
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    engine.device = torch.device("cuda")  # the check runs on a GPU only; its memory readings are faked below
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 30 * gib)
    per_slot_token = kv_bytes_per_token(model)
    engine.check_memory(8, 40 * gib // (8 * per_slot_token))  # 40 GiB: 10 free + 70 cached unused
    with pytest.raises(EngineMemoryError, match="lower --batch-size"):
        engine.check_memory(8, 75 * gib // (8 * per_slot_token))  # over 0.9 x 80 GiB


def gqa_model(layout: str, attention: str = "sdpa"):
    """A tiny random decoder whose layers attend as `layout` says ('sliding': window 8, 'mixed': a
    full layer then a sliding one), 6 query heads over 2 KV heads (G = 3), fp32."""
    shape = dict(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation=attention)
    torch.manual_seed(0)
    if layout == "full":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif layout == "sliding":
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **shape))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **shape))
    assert mask_layout(model.config) == layout and model.config._attn_implementation == attention
    return model.eval()


def engine_tokens(model, fold: bool = True) -> dict:
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    engine = SlotEngine(Target.wrap(model), slots=3, stop_ids=[STOP], sampling=sampling)
    engine.fold = engine.fold and fold  # False: transformers' own sdpa path
    results = {}
    engine.run([(p, 0, i) for i, p in enumerate(prompts(6, seed=2))], lambda tag, ids: results.update({tag: ids}))
    return results


@pytest.mark.parametrize("layout", ["full", "sliding", "mixed"])
def test_a_decode_step_attends_over_the_unexpanded_cache(layout, monkeypatch):
    """In every decode step each layer's SDPA call gets the cache's keys and values with their 2 KV
    heads and the 6 query heads folded onto them as 3 query rows each, through the engine's
    attention function; transformers' repeat_kv is not called; each call's output equals the
    repeat_kv path's (the same queries, head by head, against the repeated cache) to fp32
    rounding; and the greedy tokens equal those of the engine on transformers' own sdpa path."""
    model = gqa_model(layout)
    sdpa, repeat_kv = torch.nn.functional.scaled_dot_product_attention, sdpa_attention.repeat_kv
    seen = {"decoding": False, "calls": 0, "repeats": 0}

    def spy_sdpa(query, key, value, attn_mask=None, **kwargs):
        out = sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        if seen["decoding"]:
            seen["calls"] += 1
            b, kv_heads, g, d = query.shape
            assert (kv_heads, g) == (2, 3) and key.shape[1] == value.shape[1] == 2, (query.shape, key.shape)
            assert model.config._attn_implementation == SLOT_ATTENTION  # (transformers 5.24 folds on its own)
            assert attn_mask.shape == (b, 1, 1, key.shape[2])
            per_head = sdpa(query.reshape(b, 6, 1, d), repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=attn_mask,
                            **kwargs)  # [B, 6, 1, D]
            # another attention call's shapes: softmax sums over <= 64 keys in another order, ~sqrt(64) *
            # 1.2e-7 of values up to ~1
            torch.testing.assert_close(out.reshape(b, 6, 1, -1), per_head, rtol=0, atol=1e-5)
        return out

    def counting_repeat_kv(hidden, n_rep):
        seen["repeats"] += seen["decoding"] and n_rep > 1
        return repeat_kv(hidden, n_rep)

    step = SlotEngine.step

    def spied_step(engine):
        seen["decoding"] = True
        try:
            step(engine)
        finally:
            seen["decoding"] = False

    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
        m.setattr(sdpa_attention, "repeat_kv", counting_repeat_kv)
        m.setattr(SlotEngine, "step", spied_step)
        folded = engine_tokens(model)
    assert seen["calls"] >= 2 * 12 and seen["repeats"] == 0  # 2 layers, at least max_new_tokens steps
    assert model.config._attn_implementation == "sdpa"  # restored after the engine's forwards
    assert len(folded) == 6 and folded == engine_tokens(model, fold=False)


def test_the_folded_attention_of_one_ranks_heads_and_what_it_leaves_to_transformers():
    """A tensor-parallel rank's shard (3 of 6 query heads, 1 of 2 KV heads; the module still says
    G = 3) over a column window of a larger cache, with a padded, partly masked row: equal to the
    repeat_kv path. Prefill (several queries per row) is transformers' sdpa path, bit for bit."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    cache_k, cache_v = torch.randn(4, 1, 64, 16), torch.randn(4, 1, 64, 16)
    key, value = cache_k[:, :, :40], cache_v[:, :, :40]  # the engine's window: a view, not contiguous
    query = torch.randn(4, 1, 3, 16).transpose(1, 2)  # [B, 3, 1, D] as a layer makes it
    mask = torch.rand(4, 1, 1, 40) > 0.3
    mask[:, :, :, 0] = True
    out, _ = one_query_folded_attention(module, query, key, value, mask, scaling=0.25)
    per_head = torch.nn.functional.scaled_dot_product_attention(
        query, sdpa_attention.repeat_kv(key, 3), sdpa_attention.repeat_kv(value, 3), attn_mask=mask, scale=0.25)
    # [B, 1, 3, D]; another call's shapes: sums over 40 keys in another order, ~sqrt(40) * 1.2e-7 of
    # values up to ~1
    torch.testing.assert_close(out, per_head.transpose(1, 2), rtol=0, atol=1e-5)
    prefill = torch.randn(4, 3, 40, 16)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None].expand(4, 1, 40, 40)
    got, _ = one_query_folded_attention(module, prefill, key, value, causal, scaling=0.25)
    want, _ = sdpa_attention.sdpa_attention_forward(module, prefill, key, value, causal, scaling=0.25)
    assert torch.equal(got, want)


def test_eager_targets_keep_their_attention(monkeypatch):
    model = gqa_model("full", attention="eager")
    kinds = set()
    forward = Target.forward

    def spied(target, *args, **kwargs):
        kinds.add(target.config._attn_implementation)
        return forward(target, *args, **kwargs)

    monkeypatch.setattr(Target, "forward", spied)
    engine = SlotEngine(Target.wrap(model), slots=2, stop_ids=[STOP], sampling=SamplingConfig(temperature=0.0,
                                                                                                max_new_tokens=4))
    assert not engine.fold
    engine.run([([10, 11, 12], 0, 0)], lambda tag, ids: ())
    assert kinds == {"eager"}


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graph_replayed_decode_steps_write_what_eager_steps_write(temperature, device):
    """The slot engine with each window's decode step captured as a CUDA graph (after one eager step)
    and without graphs: the same tokens for every request, greedy and sampled (the draws are
    counter-based, so they replay as they ran), refills and follow-ups included."""
    model = gqa_model("mixed").to(device)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=40)
    outs = []
    for graphs in (False, True):
        engine = SlotEngine(Target.wrap(model), slots=3, stop_ids=[STOP], sampling=sampling, graphs=graphs)
        results = {}

        def done(tag, ids, results=results, engine=engine):
            results[tag] = ids
            results["captured"] = bool(engine.decode_steps.captured)  # (run releases them when it ends)
            return [(ids[:5] + [tag], 7, tag + 100)] if tag < 100 else []  # a follow-up request

        engine.run([(p, i, i) for i, p in enumerate(prompts(6, seed=2))], done)
        assert results.pop("captured") == graphs
        outs.append(results)
    assert outs[0] == outs[1]


def test_a_finished_run_frees_its_cache_without_the_cycle_collector():
    """A captured step's closure refers back to the engine (a reference cycle): run must free the
    KV cache and the captured steps itself, or every engine sf-regen made (one per group of shards)
    kept its cache until the cycle collector happened to run, and three of them filled a GPU."""
    import gc
    import weakref

    model = gqa_model("mixed")
    engine = SlotEngine(Target.wrap(model), slots=3, stop_ids=[STOP],
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=12), graphs=True)
    seen, running = {}, [engine]  # (a list, emptied below: the callback must not keep the engine alive)

    def done(tag, ids):
        current = running[0]
        seen.setdefault("keys", weakref.ref(current.cache.keys[0]))  # [slots, kv_heads, capacity, head_dim]
        seen["captured"] = seen.get("captured", False) or bool(current.decode_steps.captured)
        return []

    gc.disable()
    try:
        engine.run([(p, i, i) for i, p in enumerate(prompts(4, seed=3))], done)
        assert seen["captured"], "the run captured no step: the test would not see the cycle"
        assert seen["keys"]() is None, "the KV cache outlived the run"
        gone = weakref.ref(engine)
        running.clear()
        del engine
        assert gone() is None, "the engine is held by a reference cycle"
    finally:
        gc.enable()
