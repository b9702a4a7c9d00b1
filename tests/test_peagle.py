"""The P-EAGLE family: the mask against a plain-Python loop, COD sampling's counts and determinism,
the packed loss and its gradients against a reference outside the packing (each rollout its own
causal forward), the first decoding round against the training forward, greedy decoding equal to the
target's own, the speculators export against vLLM's loader (names, shapes, config fields), the
configs it refuses, the gate's fast checks and (slow) the whole gate."""

from __future__ import annotations

import json

import pytest
import torch

from specfoundry.decoding.cache import StaticKVCache
from specfoundry.families import FAMILIES
from specfoundry.families.peagle.config import PEagleConfig
from specfoundry.families.peagle.decode import PEagleRunner, decode_matches_training, decode_settings
from specfoundry.families.peagle.export import expected_tensors, export_draft, load_export
from specfoundry.families.peagle.loss import (
    cod_sample,
    cod_sizes,
    every_rollout,
    pack_batch,
    pack_row,
    peagle_loss,
)
from specfoundry.families.peagle.mask import dense_peagle_mask
from specfoundry.families.peagle.model import PEagleDraft
from specfoundry.featureset.batch import Batch
from tests.conftest import assert_export_refuses_tensors, edited_export_refusal, holed_batch
from tests.test_train import run_stopped_and_resumed, small_cfg, smol_features  # noqa: F401 (a fixture)

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=97, draft_vocab_size=40, target_hidden_size=32, aux_layer_ids=(1, 2, 3), num_hidden_layers=2,
            num_depths=4, mask_token_id=96)


def tiny_draft(seed=0, **overrides) -> PEagleDraft:
    """A random tiny draft whose vocabulary is every other target id."""
    torch.manual_seed(seed)
    draft = PEagleDraft(PEagleConfig(**{**TINY, **overrides}))
    vd = draft.cfg.draft_vocab_size
    draft.d2t.copy_(torch.arange(vd))  # draft id i is target id 2i
    draft.t2d[torch.arange(vd) * 2] = True
    return draft


def tiny_batch(lengths=(14, 10), seed=1) -> Batch:
    """Two rows, right-padded, with holes in the loss mask (a prompt, a gap mid-answer)."""
    return holed_batch(lengths, seed, aux_width=3 * 32, final_width=32)


# ---- the mask ----------------------------------------------------------------------------------------


def test_the_mask_matches_a_plain_python_loop():
    """Two packed rows (one padded): q sees k iff both are real and k is context up to q's anchor, or
    an earlier-or-same slot of q's own rollout; a padding element sees itself only."""
    ones = torch.ones(20, dtype=torch.bool)
    rows = [pack_row(12, cod_sample(ones, 12, 4, 0.7, 0.2, 5)), pack_row(7, cod_sample(ones, 7, 4, 0.9, 0.5, 6))]
    anchor, depth, real = pack_batch(rows, "cpu")
    dense = dense_peagle_mask(anchor, depth, real)
    assert dense.shape == (2, 1, anchor.shape[1], anchor.shape[1])
    assert real[1].sum() < real.shape[1] and (depth > 0).any()
    for b in range(2):
        a, d, r = anchor[b].tolist(), depth[b].tolist(), real[b].tolist()
        for q in range(len(a)):
            for k in range(len(a)):
                want = r[q] and r[k] and ((d[k] == 0 and a[k] <= a[q]) or (a[k] == a[q] and d[k] <= d[q]))
                assert bool(dense[b, 0, q, k]) == (want or q == k), (b, q, k)


@pytest.mark.filterwarnings("ignore")  # flex_attention run eagerly (no compile on the CPU) warns
def test_the_block_mask_attends_as_the_dense_mask():
    """The GPU path's BlockMask (create_block_mask over the same mask_mod) against SDPA under the dense
    mask: the same attention output (flex_attention's forward, eager, runs on the CPU)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from specfoundry.families.peagle.mask import peagle_block_mask

    ones = torch.ones(200, dtype=torch.bool)
    rows = [pack_row(150, cod_sample(ones, 150, 5, 0.7, 0.2, 1)), pack_row(90, cod_sample(ones, 90, 5, 0.7, 0.2, 2))]
    anchor, depth, real = pack_batch(rows, "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, anchor.shape[1], 16, generator=g)
    k, v = torch.randn(2, 2, anchor.shape[1], 16, generator=g), torch.randn(2, 2, anchor.shape[1], 16, generator=g)
    out = flex_attention(q, k, v, block_mask=peagle_block_mask(anchor, depth, real), enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_peagle_mask(anchor, depth, real), enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- COD sampling ------------------------------------------------------------------------------------


def test_cod_sampling_keeps_the_stated_counts_as_nested_supervised_rollouts_and_is_deterministic():
    n = 40
    mask = torch.ones(n, dtype=torch.bool)
    mask[:5] = False  # the prompt
    mask[20:23] = False  # a hole mid-answer
    supervised = int(mask.sum())
    sizes = cod_sizes(supervised, 6, 0.7, 0.2)
    assert sizes == [int((supervised - d) * max(0.7 ** d, 0.2)) for d in range(1, 6)]
    kept = cod_sample(mask, n, 6, 0.7, 0.2, seed=11)
    assert len(kept) == 5
    previous = set(range(n - 1))
    for d, anchors in enumerate(kept, start=1):
        candidates = [i for i in previous if i + 2 + d < n and mask[i + 2 + d]]
        assert len(anchors) == min(sizes[d - 1], len(candidates)), d
        assert anchors.tolist() == sorted(set(anchors.tolist())) and set(anchors.tolist()) <= set(candidates)
        previous = set(anchors.tolist())
    assert [len(a) for a in kept] == sorted((len(a) for a in kept), reverse=True)  # deeper: fewer anchors
    again = cod_sample(mask, n, 6, 0.7, 0.2, seed=11)
    assert all(torch.equal(x, y) for x, y in zip(kept, again, strict=True))
    other = cod_sample(mask, n, 6, 0.7, 0.2, seed=12)
    assert any(not torch.equal(x, y) for x, y in zip(kept, other, strict=True))
    assert cod_sizes(3, 7, 0.7, 0.0) == [1]  # stops at the first empty depth
    everything = every_rollout(mask, n, 4)  # the gate's fit check: every supervised rollout
    assert everything[0].tolist() == [i for i in range(n - 1) if i + 3 < n and mask[i + 3]]
    assert everything[2].tolist() == [i for i in range(n - 1) if i + 5 < n and mask[i + 3 : i + 6].all()]


# ---- the loss ----------------------------------------------------------------------------------------


def reference_loss(draft, batch, lm_head, kept, num_depths, weights):
    """Each rollout on its own: a causal forward over rows 0..i (token x_{i+1}, fc(a_i)) then its D mask
    slots (D: the deepest depth kept for anchor i), element (i, d) the state at row i + d; the soft CE of
    every counted element: their mean (weights "element"), or per depth the mean, weighted 1/K ("depth")."""
    from specfoundry.families.vocab import draft_ids_from_d2t

    draft_ids = draft_ids_from_d2t(draft.d2t)
    per_depth = [[] for _ in range(num_depths)]
    for r, n in enumerate(batch.lengths):
        ids, aux, final = batch.input_ids[r], batch.aux_hidden[r], batch.final_hidden[r]
        for i in range(n - 1):
            deepest = max([d for d, a in enumerate(kept[r], 1) if i in a.tolist()], default=0)
            hidden = torch.cat([draft.project(aux[: i + 1]), draft.mask_state().expand(deepest, -1)])[None]
            tokens = torch.cat([ids[1 : i + 2], torch.full((deepest,), draft.cfg.mask_token_id)])[None]
            t = i + 1 + deepest
            cache = StaticKVCache(t)
            cache.columns = torch.arange(t)
            causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # [1, 1, T, T]: the rollout alone
            states = draft.decode_forward(tokens, hidden, torch.arange(t)[None], cache, causal)[0]
            for d in range(deepest + 1):
                label = i + 2 + d
                full = final[min(label - 1, len(final) - 1)] @ lm_head.T
                if label >= n or not batch.loss_mask[r, label] or not draft.t2d[full.argmax()]:
                    continue
                p = torch.softmax(full[draft_ids], -1)
                per_depth[d].append(-(p * torch.log_softmax(draft.lm_head(states[i + d]), -1)).sum())
    if weights == "element":
        return torch.stack([x for d in per_depth for x in d]).mean()
    return sum(torch.stack(x).mean() / num_depths for x in per_depth if x)


@pytest.mark.parametrize("weights", ["element", "depth"])
def test_the_loss_and_its_gradients_match_a_per_rollout_reference(weights):
    draft, batch = tiny_draft(), tiny_batch()
    lm_head = torch.randn(97, 32)
    lm_head[torch.arange(48) * 2] *= 3  # most teacher argmaxes in the draft vocabulary
    kept = [cod_sample(batch.loss_mask[r], batch.lengths[r], 4, 0.7, 0.2, r) for r in range(2)]
    loss, metrics = peagle_loss(draft, batch, lm_head, num_depths=4, ratio=0.7, ratio_min=0.2, seed=0,
                                attention="sdpa", loss_kernel="reference", kept=kept, weights=weights)
    assert len(metrics) == 4 and all(m["valid"] > 0 for m in metrics)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ref = reference_loss(draft, batch, lm_head, kept, 4, weights)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert {"mask_hidden", "fc.weight", "layers.1.self_attn.q_proj.weight", "lm_head.weight"} <= set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(draft.named_parameters())[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    assert grads["mask_hidden"].abs().sum() > 0  # the mask slots' features train


def test_the_loss_draws_its_sampling_from_seed_epoch_and_sample():
    draft, batch = tiny_draft(), tiny_batch()
    lm_head = torch.randn(97, 32)
    with torch.no_grad():
        run = [peagle_loss(draft, batch, lm_head, num_depths=4, ratio=0.5, ratio_min=0.1, seed=s,
                           loss_kernel="reference")[0] for s in (3, 3, 4)]
    assert run[0] == run[1] and run[0] != run[2]
    loss, metrics = peagle_loss(draft, batch, lm_head, num_depths=4, ratio=0.01, ratio_min=0.0, seed=0,
                                loss_kernel="reference")  # no anchor kept past depth 0
    loss.backward()
    assert torch.isfinite(loss) and metrics[0]["valid"] > 0 and [int(m["valid"]) for m in metrics[1:]] == [0, 0, 0]


# ---- decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "k"), [(12, None), (5, None), (9, 2)])
def test_the_first_decoding_round_equals_the_training_forward(length, k):
    draft = tiny_draft().eval()
    g = torch.Generator().manual_seed(length)
    ids, aux = torch.randint(0, 96, (length,), generator=g), torch.randn(length, 96, generator=g)
    decoded, trained = decode_matches_training(draft, ids, aux, k)
    assert decoded.shape == (k or 4, 40)
    torch.testing.assert_close(decoded, trained, rtol=1e-5, atol=1e-5)


def test_decode_settings_take_the_trained_depths_and_refuse_more():
    cfg = PEagleConfig(**TINY)
    assert decode_settings(cfg, k=3, tree=None, k_given=False, source="d") == (4, None, None)
    assert decode_settings(cfg, k=2, tree=None, k_given=True, source="d") == (2, None, None)
    with pytest.raises(ValueError, match="trained for 4 depths"):
        decode_settings(cfg, k=5, tree=None, k_given=True, source="d")
    with pytest.raises(ValueError, match="trees"):
        decode_settings(cfg, k=4, tree=(2, 2), k_given=False, source="d")


def test_greedy_peagle_decoding_equals_the_targets_greedy(tiny_llama_dir):
    """A random tiny P-EAGLE draft, and the same draft nudged to propose the target's own tokens at two
    of every three slots (so that proposals are accepted, partly): both decode to the target's greedy
    output, token for token, one draft forward per round (and one at the start, over the prompt)."""
    from specfoundry.common.target import Target
    from specfoundry.common.weights import target_embeddings
    from specfoundry.decoding.sampler import Sampler
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.families.peagle.config import peagle_config_from_target
    from specfoundry.families.peagle.decode import PEagleDecoder

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    layers = [1, 3, 4]
    cfg = peagle_config_from_target(tiny_llama_dir, 49152, layers, num_hidden_layers=2, num_depths=3,
                                    mask_token_id=49151)
    torch.manual_seed(0)
    draft = PEagleDraft(cfg).eval()  # d2t zero: the draft vocabulary is the target's
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    prompt = list(range(100, 112))
    n = 18
    ref = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    runner_target = TargetRunner(target, layers)
    runner = PEagleRunner(draft)
    forwards = {"n": 0}
    one_round = runner.round

    def counted(k):
        forwards["n"] += 1
        return one_round(k)

    runner.round = counted
    out = PEagleDecoder(runner, 3).generate(runner_target, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    assert out.tokens == ref and forwards["n"] == 1 + len(out.accepted)

    full = prompt + ref

    def nudged(k):  # +1e4 on the target's own next tokens, at 2 of 3 slots (and the proposals after them)
        logits = one_round(k)[0].clone()
        m = len(runner_target)  # the committed text the round drafts after
        for j in range(k):
            if m + j < len(full) and (m + j) % 3:
                logits[j, full[m + j]] += 1e4
        return logits, runner.draft_to_target[logits.argmax(-1)]

    runner.round = nudged
    out = PEagleDecoder(runner, 3).generate(runner_target, prompt, max_new_tokens=n, eos=set(), sampler=Sampler())
    runner_target.remove_hooks()
    assert out.tokens == ref
    assert 0 < sum(out.accepted) < 3 * len(out.accepted), out.accepted


# ---- export --------------------------------------------------------------------------------------------


def vllm_reads(config: dict) -> tuple[dict, dict]:
    """What vLLM makes of a speculators config.json, after its public code (transformers_utils/configs/
    speculators/base.py and algos.py update_peagle): (the draft's HF config, the speculative config)."""
    assert config["speculators_model_type"] in ("eagle3", "peagle", "dflash", "dspark")
    pre = dict(config["transformer_layer_config"])
    pre["architectures"] = ["PeagleLlamaForCausalLM"]
    pre["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = config["target_hidden_size"]
    pre["norm_before_residual"] = config.get("norm_before_residual", False)
    pre["norm_before_fc"] = config.get("norm_before_fc", False)
    pre["pard_token"] = config["mask_token_id"]  # a KeyError in vLLM too
    if config.get("eagle_aux_hidden_state_layer_ids"):
        pre["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    spec = config["speculators_config"]
    first = spec["proposal_methods"][0]
    assert "name_or_path" in spec["verifier"]
    return pre, {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": first["speculative_tokens"]}


def vllm_parameters(pre: dict) -> dict[str, tuple[int, ...]]:
    """The parameters Eagle3LlamaForCausalLM (llama_eagle3.py) builds for that config, and their shapes."""
    h, heads, kv = pre["hidden_size"], pre["num_attention_heads"], pre["num_key_value_heads"]
    hd, inter, ht = pre["head_dim"], pre["intermediate_size"], pre.get("target_hidden_size", pre["hidden_size"])
    params = {"model.fc.weight": (h, 3 * ht), "model.norm.weight": (h,), "lm_head.weight": (pre["draft_vocab_size"], h),
              "draft_id_to_target_id": (pre["draft_vocab_size"],), "mask_hidden": (1, 3 * h)}
    for i in range(pre["num_hidden_layers"]):
        width = 2 * h if i == 0 else h
        p = f"model.layers.{i}."
        params.update({p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, width),
                       p + "self_attn.o_proj.weight": (h, heads * hd), p + "mlp.gate_up_proj.weight": (2 * inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,), p + "hidden_norm.weight": (h,)})
    return params


def vllm_load(tensors: dict[str, torch.Tensor], params: dict) -> set[str]:
    """llama_eagle3.py load_weights' renaming: t2d skipped, d2t -> draft_id_to_target_id, mask_hidden
    viewed (1, -1), "model." before all but lm_head, q/k/v and gate/up stacked. Returns what it filled
    (each shard's shape checked against the stacked parameter)."""
    stacked = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
               ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
    shards: dict[str, list] = {}
    filled = set()
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "mask_hidden" in name:
            assert t.view(1, -1).shape == params["mask_hidden"], t.shape
            filled.add("mask_hidden")
            continue
        elif "lm_head" not in name:
            name = "model." + name
        for shard, (param, _) in stacked.items():
            if shard in name:
                shards.setdefault(name.replace(shard, param), []).append(t.shape)
                break
        else:
            assert name in params and tuple(t.shape) == params[name], (name, tuple(t.shape))
            filled.add(name)
    for name, shapes in shards.items():
        assert name in params and sum(s[0] for s in shapes) == params[name][0], name
        assert all(s[1] == params[name][1] for s in shapes), name
        filled.add(name)
    return filled


def test_export_is_what_vllms_peagle_loader_reads_and_reads_back(tmp_path):
    draft = tiny_draft()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export", target={"path": "/models/t"},
                       verifier={"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]})
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleDraftModel"]
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    pre, speculative = vllm_reads(config)
    assert speculative == {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 4}
    assert pre["pard_token"] == 96 and pre["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM's numbering
    assert pre["num_hidden_layers"] == 2 and pre["model_type"] == "llama" and pre["vocab_size"] == 97
    assert (pre["draft_vocab_size"], pre["target_hidden_size"]) == (40, 32)
    assert pre["norm_before_residual"] is False and pre["norm_before_fc"] is False
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    params = vllm_parameters(pre)
    filled = vllm_load(tensors, params)
    # every parameter the forward reads is filled; layer 1's hidden_norm is built by vLLM but never used
    assert set(params) - filled == {"model.layers.1.hidden_norm.weight"}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: s for k, (s, _) in expected_tensors(draft.cfg).items()}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg, back = load_export(out)
    assert cfg == draft.cfg and FAMILIES.family_of_config(config, "c") == "peagle"
    state = draft.state_dict()
    for name, t in back.items():
        want = state[name].to(torch.bfloat16) if state[name].is_floating_point() else state[name]
        torch.testing.assert_close(t, want, rtol=0, atol=0, msg=name)
    (out / "specfoundry_draft.json").unlink()  # as another tool would write it: config.json alone
    from safetensors.torch import save_file

    extra = {**tensors, "embed_tokens.weight": torch.zeros(97, 32), "verifier_lm_head.weight": torch.zeros(97, 32),
             "mask_hidden": tensors["mask_hidden"].view(1, 1, -1)}  # speculators' own layout of it
    save_file(extra, str(out / "model.safetensors"))
    cfg, again = load_export(out)
    assert cfg == draft.cfg and set(again) == set(tensors) and again["mask_hidden"].shape == (1, 96)
    three = export_draft(draft.state_dict(), draft.cfg, tmp_path / "k3", speculative_tokens=3)
    assert vllm_reads(json.loads((three / "config.json").read_text()))[1]["num_speculative_tokens"] == 3
    assert load_export(three)[0] == draft.cfg  # num_depths kept beside the proposals served


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.pop("mask_token_id"), "lacks 'mask_token_id'"),
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual is true"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type 'qwen3'"),
    (lambda c: c.update(mask_token_id=500), "mask_token_id 500 is outside"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]), "reads 3 target layers"),
])
def test_a_config_vllm_would_refuse_or_misread_is_one_line(tmp_path, edit, words):
    draft = tiny_draft()
    message = edited_export_refusal(export_draft(draft.state_dict(), draft.cfg, tmp_path / "export"), edit)
    assert words in message, message


def test_sf_export_keeps_the_trained_depths_and_names_the_verifier_as_sf_train_does(tmp_path, tiny_llama_dir):
    """sf-export without -k proposes the trained K (not EAGLE-3's 3), and names the verifier by the
    rule sf-train's export uses (serving_verifier); -k still asks for fewer."""
    from click.testing import CliRunner

    from specfoundry.families.folders import serving_verifier
    from specfoundry.train.cli import export_main

    draft = tiny_draft(vocab_size=49152, target_hidden_size=64, hidden_size=64, intermediate_size=128,
                       head_dim=16)  # as wide as the tiny target
    src = export_draft(draft.state_dict(), draft.cfg, tmp_path / "trained", target={"name": str(tiny_llama_dir)},
                       verifier=serving_verifier(str(tiny_llama_dir), tiny_llama_dir))
    for extra, k in (([], 4), (["-k", "2"], 2)):
        out = tmp_path / f"vllm{k}"
        result = CliRunner().invoke(export_main, ["run", str(src), "-o", str(out), "--format", "speculators",
                                                  "--target", str(tiny_llama_dir), *extra])
        assert result.exit_code == 0, result.output
        config = json.loads((out / "config.json").read_text())
        assert vllm_reads(config)[1]["num_speculative_tokens"] == k
        assert config["speculators_config"]["verifier"] == json.loads((src / "config.json").read_text())[
            "speculators_config"]["verifier"] == {"name_or_path": str(tiny_llama_dir.resolve()),
                                                  "architectures": ["LlamaForCausalLM"]}


def test_a_missing_mask_hidden_or_misshaped_layer_is_refused_on_export(tmp_path):
    draft = tiny_draft()
    assert_export_refuses_tensors(export_draft, draft, tmp_path, "mask_hidden", "layers.1.self_attn.q_proj.weight",
                                  (32, 64))
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="trained for 4 depths"):
        export_draft(draft.state_dict(), draft.cfg, tmp_path / "c", speculative_tokens=5)
    with pytest.raises(ValueError, match="speculators layout only"):
        FAMILIES.provider("peagle").export(draft.state_dict(), draft.cfg, tmp_path / "d", None, layout="sglang")


# ---- the gate ------------------------------------------------------------------------------------------


def test_the_positions_check_names_a_wrong_mask_token_and_fit_an_untrained_draft(tiny_llama_dir):
    """Fast cases of the gate's checks on a random draft: positions passes for the real decoder and fails
    when decoding feeds the mask slots another token than training; fit fails (nothing learnt)."""
    from types import SimpleNamespace

    from specfoundry.common.weights import target_embeddings
    from specfoundry.families.peagle.config import peagle_config_from_target
    from specfoundry.families.peagle.gate import check_fit, check_positions

    cfg = peagle_config_from_target(tiny_llama_dir, 49152, [1, 3, 4], num_hidden_layers=2, num_depths=3,
                                    mask_token_id=49151)
    torch.manual_seed(0)
    draft = PEagleDraft(cfg).eval()
    draft.embed_tokens.weight.data.copy_(target_embeddings(tiny_llama_dir).float())
    g = torch.Generator().manual_seed(2)
    sample = SimpleNamespace(input_ids=torch.randint(0, 1000, (20,), generator=g),
                             loss_mask=torch.arange(20) >= 6, aux_hidden=torch.randn(20, 3 * 64, generator=g))
    positions = check_positions(draft, sample)
    fit = check_fit(PEagleRunner(draft), sample)
    assert positions.ok and not fit.ok, (positions, fit)
    decode = draft.decode_forward

    def other_mask(ids, hidden, pos, cache, mask):  # decoding's mask slots read token 0, training's the mask token
        return decode(torch.where(ids == cfg.mask_token_id, 0, ids), hidden, pos, cache, mask)

    draft.decode_forward = other_mask
    positions = check_positions(draft, sample)
    assert not positions.ok and "differs" in positions.detail, positions


@pytest.mark.slow
def test_peagle_gate_passes_on_the_tiny_target_and_names_broken_pieces(tiny_llama_dir, tmp_path):
    """The whole gate (regen, capture, train, export, checks) on the tiny Llama target; then an export
    whose layer ids or mask token were changed is named at that check."""
    from specfoundry.gate import GateConfig, run_gate
    from tests.test_gate import assert_gate_fails_at

    cfg = GateConfig(output=str(tmp_path / "gate"), target=str(tiny_llama_dir), max_steps=80, max_new_tokens=32,
                     device="cpu", family="peagle")
    checks, ok, message = run_gate(cfg)
    assert ok, message
    assert [c.name for c in checks] == ["vocab map", "export", "mask token", "layers", "layers", "positions", "fit",
                                        "decode"]
    export = tmp_path / "gate" / "train" / "export"

    def other_layers(c):  # vLLM's numbering: the first layer one deeper
        c["eagle_aux_hidden_state_layer_ids"][0] += 1

    def other_mask(c):
        c["mask_token_id"] -= 1

    assert_gate_fails_at(cfg, export, tmp_path, "layers", config=other_layers)
    assert_gate_fails_at(cfg, export, tmp_path, "mask token", config=other_mask)


def test_init_from_reads_an_export_back_and_refuses_other_layers(tiny_llama_dir, tmp_path):
    """--init-from: a P-EAGLE export builds the same draft (the target's embeddings copied in); one that
    reads other layers than the run is refused, naming both."""
    from specfoundry.featureset.manifest import FeatureSetError
    from tests.test_families import family_options, stub_featureset

    family, options = FAMILIES.provider("peagle"), family_options("peagle", tmp_path)
    fs = stub_featureset(tmp_path, tiny_llama_dir, [1, 3, 4])
    torch.manual_seed(0)
    draft, dcfg = family.build(options, fs, tiny_llama_dir, [1, 3, 4], None)
    assert dcfg.mask_token_id == 49151 and dcfg.num_hidden_layers == 2  # the highest id the set never uses (no spare row)
    out = family.export(draft.state_dict(), dcfg, tmp_path / "export", {"num_layers": 8})
    again, cfg = family.build(options, fs, tiny_llama_dir, [1, 3, 4], str(out))
    assert cfg == dcfg
    for name, t in again.state_dict().items():
        want = draft.state_dict()[name]
        want = want.to(torch.bfloat16).to(want.dtype) if want.is_floating_point() and name != "embed_tokens.weight" else want
        torch.testing.assert_close(t, want, rtol=0, atol=0, msg=name)
    with pytest.raises(FeatureSetError, match=r"reads layers \[1, 3, 4\], but the run reads layers \[1, 2, 4\]"):
        family.build(options, stub_featureset(tmp_path, tiny_llama_dir, [1, 2, 4]), tiny_llama_dir, [1, 2, 4], str(out))


@pytest.mark.slow
def test_a_peagle_run_resumed_after_a_stop_equals_an_uninterrupted_one(tmp_path, smol_features):  # noqa: F811
    """COD sampling is drawn from (seed, epoch, sample index): a run stopped after a checkpoint and
    resumed ends with the uninterrupted run's weights and losses, bit for bit (SmolLM2's capture
    included, hence slow)."""

    def cfg(out):
        return small_cfg(smol_features, out, family="peagle", peagle_vocab_size=512, peagle_layers=2, num_depths=3,
                         max_steps=6, max_batch_tokens=160, save_every=3)

    whole, resumed, names = run_stopped_and_resumed(cfg, tmp_path)
    assert "mask_hidden" in names
    from specfoundry.families.folders import EMBEDDED_HF_ID

    served = json.loads((tmp_path / "whole" / "export" / "config.json").read_text())["speculators_config"]
    assert served["verifier"]["name_or_path"] == EMBEDDED_HF_ID  # not this machine's converted copy
    assert served["proposal_methods"][0]["speculative_tokens"] == 3  # the trained K
    assert [(x["loss_0"], x["loss_2"]) for x in whole["history"]] == [(x["loss_0"], x["loss_2"])
                                                                      for x in resumed["history"]]
