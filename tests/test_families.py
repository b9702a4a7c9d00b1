"""Draft families: the interface's layer choice, one capture for every family, the EAGLE-3.1
options (shapes, export fields, decoding equal to training), the contract every registered family
keeps, no fallback for an unknown family or architecture, and the catalogue's own rules."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from specfoundry.capture.stage import CaptureConfig, CaptureError, stored_layers
from specfoundry.common.settings import Settings, setting
from specfoundry.decoding.tree import EngineTree
from specfoundry.families import FAMILIES
from specfoundry.families.dflash.options import DFlashOptions, dflash_default_layers
from specfoundry.families.eagle3.chain import DraftRunner
from specfoundry.families.eagle3.config import Eagle3Config
from specfoundry.families.eagle3.export import expected_tensors, export_draft, validate
from specfoundry.families.eagle3.model import Eagle3Draft, TTTCache
from specfoundry.families.eagle3.options import Eagle3Options, default_aux_layers
from specfoundry.families.eagle3.shapes import random_eagle3_draft
from specfoundry.families.eagle3.ttt import shift
from specfoundry.families.folders import find_draft_files, locate_draft
from specfoundry.featureset.batch import Batch
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.train.loader import select_layers
from tests.conftest import parse_python

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=97, draft_vocab_size=40, target_hidden_size=24, aux_layer_ids=(1, 2, 3))


@pytest.mark.parametrize(("layers", "drafts", "want"), [
    (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B's public DFlash drafts
    (28, 5, [1, 7, 13, 19, 25]),
    (36, 1, [18]),
    (30, 3, [1, 14, 27]),
])
def test_dflash_default_layers_follow_the_public_formula(layers, drafts, want):
    assert dflash_default_layers(layers, drafts) == want


def test_one_capture_stores_the_union_of_the_families_layers_ascending():
    cfg = CaptureConfig(source="s", output="o", families=("eagle3", "dflash"))
    assert stored_layers(cfg, 36) == sorted(set(default_aux_layers(36)) | {1, 9, 17, 25, 33})
    assert stored_layers(CaptureConfig(source="s", output="o", aux_layers=(20, 3)), 36) == [3, 20]
    with pytest.raises(CaptureError, match="outside 0..34"):
        stored_layers(CaptureConfig(source="s", output="o", aux_layers=(3, 35)), 36)
    with pytest.raises(CaptureError, match="twice"):
        stored_layers(CaptureConfig(source="s", output="o", aux_layers=(3, 3)), 36)


def test_each_family_takes_its_layers_from_a_union_set_and_names_a_missing_one():
    held = sorted(set(default_aux_layers(36)) | set(dflash_default_layers(36)))
    manifest = {"aux_layer_ids": held}
    eagle3, dflash = FAMILIES.provider("eagle3"), FAMILIES.provider("dflash")
    assert select_layers(manifest, eagle3, Eagle3Options(), None, 36, "set") == default_aux_layers(36)
    assert select_layers(manifest, dflash, DFlashOptions(), None, 36, "set") == [1, 9, 17, 25, 33]
    assert select_layers(manifest, eagle3, Eagle3Options(), (9, 17, 25), 36, "set") == [9, 17, 25]
    with pytest.raises(FeatureSetError, match=r"set lacks layers 12, 22 that the dflash draft reads"):
        select_layers(manifest, dflash, DFlashOptions(num_draft_layers=4), None, 36, "set")
    with pytest.raises(FeatureSetError, match="reads 3 layers"):
        select_layers(manifest, eagle3, Eagle3Options(), (1, 9), 36, "set")
    with pytest.raises(FeatureSetError, match="ascending"):
        select_layers(manifest, eagle3, Eagle3Options(), (17, 9, 25), 36, "set")
    # a set of exactly the family's count is read whole, whatever its ids
    assert select_layers({"aux_layer_ids": [2, 5, 7]}, eagle3, Eagle3Options(), None, 36, "set") == [2, 5, 7]


def random_draft(**options) -> Eagle3Draft:
    return random_eagle3_draft(Eagle3Config(**TINY, **options), vocab_stride=2, norms_off_one=True).eval()


@pytest.mark.parametrize("options", [{}, {"fc_norm": True}, {"norm_output": True},
                                     {"fc_norm": True, "norm_output": True}])
def test_chain_decoding_equals_the_ttt_steps(options):
    """sf-eval's cached chain, fed the sequence's own tokens, gives TTT step s's logits at the
    last index: the EAGLE-3.1 options decode exactly as they train."""
    draft = random_draft(**options)
    n, m, steps = 12, 9, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (1, n), generator=g)
    aux = torch.randn(1, n, 3 * 24, generator=g)
    with torch.no_grad():
        hidden, cache, ttt = draft.project(aux), TTTCache(), []
        for s in range(steps):
            hidden, normed = draft.ttt_forward(shift(ids, 1 + s, n), hidden, (torch.arange(n) + s)[None], cache,
                                               [n], s, "sdpa")
            ttt.append(draft.lm_head(normed)[0, m - 2])
        runner = DraftRunner(draft)
        runner.extend(ids[0, 1:m].tolist(), aux[0, : m - 1])
        decoded, state = [runner.logits], runner.pre
        for s in range(1, steps):
            state, out = runner.run([int(ids[0, m - 1 + s])], state, [m - 2 + s])
            decoded.append(out[-1])
    for s in range(steps):
        torch.testing.assert_close(decoded[s], ttt[s], rtol=1e-5, atol=1e-5)


def test_the_options_change_the_draft():
    """fc_norm adds a norm per captured layer before fc; norm_output passes the normed state on."""
    plain, normed = random_draft(), random_draft(fc_norm=True)
    assert [tuple(n.weight.shape) for n in normed.fc_norm] == [(24,)] * 3
    aux = torch.randn(1, 4, 72)
    scaled = aux * torch.tensor([10.0] * 24 + [1.0] * 48)
    with torch.no_grad():  # each layer's state is normed alone: scaling one layer changes nothing
        torch.testing.assert_close(normed.project(scaled), normed.project(aux), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain.project(scaled), plain.project(aux))
    out = random_draft(norm_output=True)
    pre = torch.randn(1, 4, 32)
    passed, logits_state = out.outputs(pre)
    torch.testing.assert_close(passed, logits_state)
    assert torch.equal(random_draft().outputs(pre)[0], pre)


def test_eagle31_export_has_sglangs_fields_and_reads_back(tmp_path):
    draft = random_draft(fc_norm=True, norm_output=True)
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True  # top level: where both engines read them
    names = set(expected_tensors(draft.cfg))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
    cfg, tensors = find_draft_files(locate_draft(out))
    assert cfg.fc_norm and cfg.norm_output and set(tensors) == names
    (out / "specfoundry_draft.json").unlink()  # as another tool would write it: config.json alone
    cfg, _ = find_draft_files(locate_draft(out))
    assert cfg.fc_norm and cfg.norm_output
    del tensors["fc_norm.1.weight"]
    with pytest.raises(ValueError, match=r"missing \['fc_norm.1.weight'\]"):
        validate(tensors, draft.cfg)


def tiny_dflash(**over):
    from specfoundry.families.dflash.config import DFlashConfig
    from specfoundry.families.dflash.model import DFlashDraft

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=97, target_hidden_size=32,
                       target_layer_ids=(1, 3, 5), block_size=4, mask_token_id=96, **over)
    torch.manual_seed(0)
    return DFlashDraft(cfg).eval()


def test_dflash_export_is_what_sglangs_loader_reads_and_reads_back(tmp_path):
    """The fields SGLang's DFlash loader reads (spec in families/dflash/export.py), exactly its 11 tensors
    per layer + fc, hidden_norm, norm (no embedding, no lm_head), and the same draft read back."""
    from specfoundry.families.dflash.export import export_draft
    from specfoundry.families.dflash.export import validate as validate_dflash

    draft = tiny_dflash()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export", target={"num_layers": 8})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 8 and config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 96}
    assert config["layer_types"] == ["full_attention"] * 2 and config["use_sliding_window"] is False
    per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"}
    want = {f"layers.{n}.{p}.weight" for n in range(2) for p in per_layer} | {
        "fc.weight", "hidden_norm.weight", "norm.weight"}
    cfg, tensors = find_draft_files(locate_draft(out))
    assert set(tensors) == want and tuple(tensors["fc.weight"].shape) == (32, 96)
    assert cfg == draft.cfg
    (out / "specfoundry_draft.json").unlink()  # another tool's export: config.json alone
    assert find_draft_files(locate_draft(out))[0] == draft.cfg
    del tensors["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.k_norm.weight'\]"):
        validate_dflash(tensors, draft.cfg)


def test_the_loader_hands_out_the_chosen_layers_of_a_union_set(tmp_path):
    """A set holding 6 layers: each family's batch holds exactly its layers' stored columns, in order,
    and no final state where the family reads none."""
    from dataclasses import replace

    from specfoundry.families.eagle3.shapes import SMOL_DRAFT
    from specfoundry.testing import write_random_featureset
    from specfoundry.train.loader import FeatureLoader

    cfg = replace(SMOL_DRAFT, aux_layer_ids=(1, 8, 14, 20, 26, 27))
    fs = write_random_featureset(tmp_path, 2, 16, cfg)
    h = cfg.hidden_size
    manifest = fs.manifest
    for family, options, want in [("eagle3", Eagle3Options(), [1, 14, 26]),
                                  ("dflash", DFlashOptions(num_draft_layers=5), [1, 8, 14, 20, 27])]:
        fam = FAMILIES.provider(family)
        layers = select_layers(manifest, fam, options, None, 30, "set")
        assert layers == want
        positions = [manifest["aux_layer_ids"].index(i) for i in layers]
        loader = FeatureLoader(fs, [0, 1], max_tokens=64, seed=0, num_workers=0, layers=positions,
                               final=fam.needs_final_state(options))
        batch = next(iter(loader))
        stored = fs[batch.indices[0]].aux_hidden.view(16, 6, h)
        torch.testing.assert_close(batch.aux_hidden[0, :16], stored[:, positions].reshape(16, -1), rtol=0, atol=0)
        assert (batch.final_hidden is None) == (family == "dflash")


def test_a_bad_dflash_config_or_another_familys_draft_is_one_line(tmp_path):
    from specfoundry.families.dflash.export import export_draft
    from specfoundry.families.dflash.export import load_export as load_dflash
    from specfoundry.families.eagle3.export import load_export as load_eagle3
    from specfoundry.families.folders import DraftLoadError, locate_draft

    draft = tiny_dflash()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    with pytest.raises(ValueError, match="is a draft of family dflash, not eagle3: pass --family dflash"):
        load_eagle3(out)
    eagle = export_draft_eagle3(tmp_path / "eagle3")
    with pytest.raises(ValueError, match="is a draft of family eagle3, not dflash: pass --family eagle3"):
        load_dflash(eagle)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [5, 3, 1]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError, match=r"config.json: target_layer_ids must be .*ascending"):
        find_draft_files(locate_draft(out))


def export_draft_eagle3(out):
    draft = random_draft()
    return export_draft(draft.state_dict(), draft.cfg, out)


# ---- the catalogue: every registered family keeps the contract --------------------------------------


def stub_featureset(root, target_dir, layers):
    """What a family's build reads of a feature set: the target's shape, the stored layers and the
    token counts (the first 200 ids seen, most often the lowest)."""
    config = json.loads((target_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    counts = torch.zeros(vocab, dtype=torch.int64)
    counts[:200] = torch.arange(200, 0, -1)
    target = {"vocab_size": vocab, "hidden_size": config["hidden_size"], "num_layers": config["num_hidden_layers"]}
    return SimpleNamespace(root=root, manifest={"target": target, "aux_layer_ids": list(layers)},
                           token_counts=lambda: counts)


def family_options(name, tmp_path):
    """The options of the gate's overfit (k = 3; EAGLE-3's draft vocabulary the tiny target's whole
    one, so that the random teacher's choices are all in it), as TrainConfig holds them."""
    from specfoundry.gate import GateConfig
    from specfoundry.train.trainer import TrainConfig

    groups = FAMILIES.provider(name).gate_options(GateConfig(output=str(tmp_path / "gate"), k=3, draft_vocab_size=49152))
    cfg = TrainConfig(featureset="fs", output=str(tmp_path / "run"), family=name, **groups)
    return FAMILIES.options_for(cfg, name)


def random_batch(layers, hidden, vocab, lengths=(16, 12)):
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    return Batch(torch.randint(0, 200, (len(lengths), width), generator=g), mask,
                 torch.randn(len(lengths), width, len(layers) * hidden, generator=g),
                 torch.randn(len(lengths), width, hidden, generator=g), list(lengths), list(range(len(lengths))))


@pytest.mark.parametrize("name", FAMILIES.names())
def test_every_registered_family_keeps_the_contract(name, tiny_llama_dir, tmp_path):
    """Through its provider alone: build on a tiny target, a finite loss with finite gradients,
    an export its architecture is recognised by and that reads back as built, and a first decode
    round of the read-back draft equal to the training forward at the same positions."""
    from specfoundry.common.weights import target_lm_head
    from specfoundry.families.folders import family_of_export, load_draft, locate_draft

    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    assert dcfg.family == name and list(dcfg.target_layers) == layers
    module = family.module(draft, tiny_llama_dir, torch.float32, options, 0)
    loss, metrics = module(random_batch(layers, dcfg.target_hidden_size, dcfg.vocab_size), attention="sdpa",
                           loss_kernel="reference")
    loss.backward()
    grads = [p.grad for p in draft.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and metrics and grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)

    out = family.export(draft.state_dict(), dcfg, tmp_path / "export", {"num_layers": 8})
    assert family_of_export(out) == name
    cfg, tensors = find_draft_files(locate_draft(out, 8))
    assert cfg == dcfg
    state = draft.state_dict()
    for tensor, t in tensors.items():
        want = state[tensor].to(torch.bfloat16) if state[tensor].is_floating_point() else state[tensor]
        torch.testing.assert_close(t.to(want.dtype), want, rtol=0, atol=0, msg=tensor)
    loaded = load_draft(locate_draft(out), tiny_llama_dir, torch.device("cpu"), torch.float32)
    assert type(loaded) is type(draft)

    batch = random_batch(layers, dcfg.target_hidden_size, dcfg.vocab_size, lengths=(11,))
    decoded, trained = family.decode_matches_training(loaded, target_lm_head(tiny_llama_dir).float(),
                                                      batch.input_ids[0], batch.aux_hidden[0])
    assert decoded.shape == trained.shape and decoded.shape[0] >= 1
    torch.testing.assert_close(decoded, trained, rtol=1e-4, atol=1e-4)


BLOCK_FAMILIES = ("dflash", "dflash2", "domino", "dspark")


@pytest.mark.parametrize("name", BLOCK_FAMILIES)
def test_a_block_drafter_served_at_a_smaller_block_is_that_blocks_draft_and_decodes_the_targets_tokens(
        name, tiny_llama_dir, tmp_path):
    """-k serves a block drafter at a block below its trained one, as the engines allow: its proposals
    are those of the same weights configured for the served block (DFlash2's convolution bounded by
    it), its greedy tokens the target's own; -k past the trained block is one line."""
    import dataclasses

    from specfoundry.common.target import Target
    from specfoundry.decoding.rounds import target_generate
    from specfoundry.decoding.sampler import Sampler
    from specfoundry.decoding.target import TargetRunner

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    with torch.no_grad():  # every piece acting (DFlash2's convolutions are the identity at init)
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    draft = draft.eval().requires_grad_(False)
    k, _, _ = family.decode_settings(dcfg, k=2, tree=None, temperature=0.0, k_given=True, source="draft")
    assert k == 2
    served = family.decoder(draft, target, k=k, tree=None).runner
    assert served.proposal_count == 2
    block = served.block_size
    assert block < dcfg.block_size
    same = family.draft_module(dataclasses.replace(dcfg, block_size=block))
    same.load_state_dict(draft.state_dict())
    same.embed_tokens = draft.embed_tokens  # the target's, outside the state dict (never exported)
    own = family.decoder(same.eval().requires_grad_(False), target, k=k, tree=None).runner
    assert own.block_size == block
    aux = torch.randn(9, draft.fc.in_features)
    for runner in (served, own):
        runner.reset(64)
        runner.extend(aux)
    got, want = served.propose(105), own.propose(105)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the same ops in the same order: exact
    runner = TargetRunner(target, list(dcfg.target_layers))
    prompt = list(range(100, 113))
    expected = target_generate(runner, prompt, max_new_tokens=20, eos=set(), sampler=Sampler()).tokens
    decoder = family.decoder(draft, target, k=k, tree=None)
    assert decoder.generate(runner, prompt, max_new_tokens=20, eos=set(), sampler=Sampler()).tokens == expected
    too_many = dcfg.block_size + 1
    with pytest.raises(ValueError, match=f"-k {too_many}: .*trained"):
        family.decode_settings(dcfg, k=too_many, tree=None, temperature=0.0, k_given=True, source="draft")


@pytest.mark.parametrize("name", FAMILIES.names())
def test_every_registered_family_decodes_the_targets_greedy_tokens_through_the_core(name, tiny_llama_dir, tmp_path):
    """Through its provider alone: an untrained draft of the family, decoded greedily by its sf-eval
    decoder against the decoding core's target runner (its chain or block, and EAGLE-3's tree),
    gives the target's own greedy tokens, token for token, whatever it proposes."""
    from specfoundry.common.target import Target
    from specfoundry.decoding.rounds import target_generate
    from specfoundry.decoding.sampler import Sampler
    from specfoundry.decoding.target import TargetRunner

    target = Target.load(str(tiny_llama_dir), device="cpu", dtype=torch.float32)
    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    draft = draft.eval().requires_grad_(False)
    runner = TargetRunner(target, list(dcfg.target_layers))
    prompt = list(range(100, 113))
    want = target_generate(runner, prompt, max_new_tokens=20, eos=set(), sampler=Sampler()).tokens
    shapes = 0
    for tree in (None, (2, 2, 1)):  # its chain or block, and a tree where the family drafts one
        try:
            k, tree, _ = family.decode_settings(dcfg, k=3, tree=tree, temperature=0.0, k_given=False, source="draft")
        except ValueError:
            assert tree is not None, "every family decodes without a tree"
            continue
        shapes += 1
        decoder = family.decoder(draft, target, k=k, tree=tree)
        got = decoder.generate(runner, prompt, max_new_tokens=20, eos=set(), sampler=Sampler())
        assert got.tokens == want, (name, tree)
        assert got.rounds >= 1
    assert shapes >= 1


def graphs_on(runner) -> None:
    """A draft runner built off a GPU, made to capture its steps (their CPU stand-in) as on a GPU."""
    from specfoundry.decoding.steps import CapturedSteps

    runner.graphs = True
    for steps in vars(runner).values():
        if isinstance(steps, CapturedSteps):
            steps.graphs = True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", FAMILIES.names())
def test_every_registered_familys_preparation_leaves_no_capture_to_a_timed_decode(name, device, tiny_llama_dir,
                                                                                  tmp_path, monkeypatch):
    """sf-eval's preparation (decode_sets: the caches reserved for the longest prompt, then the
    warm-up on the first, shorter one) with graphs on: CUDA graphs on a GPU; on a CPU each
    CapturedCall runs its stand-in, built at the step's first use as on a GPU. After it, the timed decodes build none, the longer
    prompt's included (without the draft's reserve its cache grew and dropped every step); every
    count a round may commit (a + 1 for a = 0..its proposals) has its captured step, an untrained
    draft's decode meeting few of them; and the tokens are the target's own (its baseline's)."""
    from specfoundry.common.target import Target
    from specfoundry.decoding import graphs
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.eval import evaluate

    target = Target.load(str(tiny_llama_dir), device=device, dtype=torch.float32)
    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    draft = draft.to(device).eval().requires_grad_(False)
    short, long = list(range(100, 113)), list(range(100, 360))  # 13 and 260 tokens: caches of 256 and 512 columns

    built_after_warm_up = []
    armed = [False]
    real_init, real_warm_up = graphs.CapturedCall.__init__, evaluate.warm_up

    def counting_init(self, fn, *args, **kwargs):
        if armed[0]:
            built_after_warm_up.append(fn)
        real_init(self, fn, *args, **kwargs)

    def warm_up_then_arm(*args):
        real_warm_up(*args)
        armed[0] = True

    monkeypatch.setattr(graphs.CapturedCall, "__init__", counting_init)
    monkeypatch.setattr(evaluate, "warm_up", warm_up_then_arm)
    monkeypatch.setattr(evaluate, "warms_up", lambda _: True)  # (a GPU's preparation, on the CPU too)
    served = EngineTree(3, 2, 6)  # SGLang's tree, where the family drafts it (sf-eval --num-steps ...)
    for tree in (None, (2, 2, 1), *((served,) if family.serves_engine_tree else ())):
        # its chain or block, and a tree where the family drafts one
        if tree is served:
            k, knobs = served.num_steps, dict(num_steps=3, topk=2, num_draft_tokens=6)
        else:
            try:
                k, tree, _ = family.decode_settings(dcfg, k=3, tree=tree, temperature=0.0, k_given=False,
                                                    source="draft")
            except ValueError:
                continue
            knobs = dict(tree=tree)
        armed[0] = False
        decoder = family.decoder(draft, target, k=k, tree=tree)
        graphs_on(decoder.runner)
        runner = TargetRunner(target, list(dcfg.target_layers), graphs=True)
        # with the target alone beside it (baseline), whose greedy tokens the draft's must equal
        cfg = evaluate.EvalConfig(draft="draft", k=k, max_new_tokens=12, baseline=True, device=device, **knobs)
        sets = {"first": [("short", short)], "second": [("long", long)]}
        out, _ = evaluate.decode_sets(cfg, runner, {"trained": decoder}, sets, set(), silent=True)
        assert armed[0] and built_after_warm_up == [], (name, tree, len(built_after_warm_up))
        assert [entry["trained"]["identical_to_target"] for entry in out.values()] == ["1/1", "1/1"], (name, tree)
        r = decoder.runner
        committed = (set(r.extends.captured) if hasattr(r, "extends") else set(r.appends.captured)
                     if hasattr(r, "appends") else {n for n, _ in r.rounds.captured})
        depth = served.num_steps if tree is served else len(tree) if tree else k
        assert set(range(1, depth + 2)) <= committed, (name, tree, sorted(committed))


# ---- no fallback: an unknown architecture or family is one line at every entry point -----------------


def bogus_export(path, architectures):
    """A draft folder whose config.json names `architectures` (no family exports them)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": architectures, "hidden_size": 64}))
    save_file({"fc.weight": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def one_line(fn, words, error=ValueError):
    with pytest.raises(error) as e:
        fn()
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def cli_one_line(command, argv, words):
    from click.testing import CliRunner

    result = CliRunner().invoke(command, argv)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output, (result.output, result.exception)
    assert len(errors) == 1 and words in errors[0], result.output


def test_an_unknown_architecture_is_one_line_at_every_entry_point(tiny_llama_dir, tmp_path):
    from specfoundry.cli import sf_eval as eval_main
    from specfoundry.families.folders import family_of_export, locate_draft
    from specfoundry.gate import GateConfig, run_checks
    from specfoundry.train.cli import export_main

    bogus = bogus_export(tmp_path / "bogus", ["BogusForCausalLM"])
    unnamed = bogus_export(tmp_path / "unnamed", [])
    words = "which no draft family exports"
    for folder in (bogus, unnamed):
        for fn in (lambda f=folder: family_of_export(f), lambda f=folder: locate_draft(f)):
            one_line(fn, words)
    for name in FAMILIES.names():  # --init-from, which each family reads itself
        family = FAMILIES.provider(name)
        options = family_options(name, tmp_path)
        layers = family.default_layers(8, options)
        fs = stub_featureset(tmp_path, tiny_llama_dir, layers)
        one_line(lambda f=family, o=options, s=fs, la=layers: f.build(o, s, tiny_llama_dir, la, str(bogus)), words)
    checks = run_checks(GateConfig(output=str(tmp_path / "gate")), bogus)  # sf-eval gate --export
    assert [c.name for c in checks] == ["export"] and not checks[0].ok and words in checks[0].detail
    cli_one_line(export_main, ["run", str(bogus), "-o", str(tmp_path / "out"), "--target", str(tiny_llama_dir)], words)
    cli_one_line(eval_main, ["run", str(bogus), "--target", str(tiny_llama_dir), "--prompts", "chat", "--limit", "1",
                             "--device", "cpu"], words)


def test_an_unknown_family_is_one_line_at_every_entry_point(tmp_path):
    from specfoundry.capture.cli import main as capture_main
    from specfoundry.cli import sf_eval as eval_main
    from specfoundry.gate import GateConfig
    from specfoundry.train.cli import export_main
    from specfoundry.train.cli import main as train_main
    from specfoundry.train.trainer import TrainConfig

    words = "unknown draft family 'bogus'"
    one_line(lambda: FAMILIES.provider("bogus"), words)
    one_line(lambda: FAMILIES.default_layers("bogus", 8), words)
    one_line(lambda: TrainConfig(featureset="fs", output="o", family="bogus"), words)
    one_line(lambda: GateConfig(output="o", family="bogus"), words)
    one_line(lambda: CaptureConfig(source="s", output="o", families=("eagle3", "bogus")), "unknown draft family bogus")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  family: bogus\n")
    cli_one_line(train_main, ["run", "fs", "-o", str(tmp_path / "o"), "--family", "bogus"], "'bogus' is not one of")
    cli_one_line(train_main, ["run", "fs", "-o", str(tmp_path / "o"), "--recipe", str(recipe)], "'bogus' is not one of")
    cli_one_line(capture_main, ["run", "src", "-o", str(tmp_path / "c"), "--families", "bogus"],
                 "unknown draft family bogus")
    cli_one_line(eval_main, ["gate", "-o", str(tmp_path / "g"), "--family", "bogus"], "'bogus' is not one of")
    # a checkpoint whose run records an unknown family, or none (sf-eval run, sf-export run, --init-from)
    for record, said in (({"family": "bogus"}, words), ({}, "names no family")):
        run = tmp_path / f"run-{len(record)}"
        step = run / "checkpoints" / "step-1"
        step.mkdir(parents=True)
        (step / "model.safetensors").write_bytes(b"")
        (run / "draft_config.json").write_text(json.dumps(record))
        one_line(lambda s=step: find_draft_files(locate_draft(s)), said)
        cli_one_line(export_main, ["run", str(step), "-o", str(tmp_path / f"out-{len(record)}")], said)


def test_another_familys_option_on_the_command_line_is_one_line(tmp_path):
    """An option of a group that --family does not read is refused before anything runs (and
    sf-capture's --aux-layers, which overrides --families, beside it); the
    parent's group is read on purpose (Domino: DFlash's --block-size), and a recipe may hold
    several families' options (only the trained family's are read)."""
    from specfoundry.train.cli import main as train_main

    out = tmp_path / "o"
    for family, option, said in (("dflash", ["--gru-hidden-dim", "64"], "--gru-hidden-dim is an option of domino"),
                                 ("peagle", ["--draft-vocab-size", "512"], "--draft-vocab-size is an option of eagle3"),
                                 ("eagle3", ["--objective", "dpace"], "--objective is an option of dflash"),
                                 ("domino", ["--ttt-length", "3"], "reads only dflash and domino's options")):
        cli_one_line(train_main, ["run", "fs", "-o", str(out), "--family", family, *option], said)
        assert not out.exists()
    from specfoundry.capture.cli import main as capture_main

    cli_one_line(capture_main, ["run", "src", "-o", str(out), "--aux-layers", "1,2", "--families", "dflash"],
                 "--aux-layers names the layers stored, --families picks them")
    assert not out.exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: smollm2\ntrain:\n  ttt_length: 3\n")  # an EAGLE-3 key in a recipe shared by families: not read
    from click.testing import CliRunner

    result = CliRunner().invoke(train_main, ["run", str(tmp_path / "missing"), "-o", str(out), "--family", "domino",
                                             "--block-size", "8", "--recipe", str(recipe)])
    assert result.exit_code != 0 and "is an option of" not in result.output and "missing" in result.output


# ---- the catalogue's own rules ---------------------------------------------------------------------


def entry(name, options, extends=None, architectures=None):
    from specfoundry.families import Family

    return Family(name=name, summary=name, options=f"tests.test_families:{options}",
                  default_layers="tests.test_families:no_layers", proposes="chain",
                  architectures=architectures or (f"{name.title()}Model",), provider="tests.test_families:nothing",
                  extends=extends)


def no_layers(num_target_layers, options):
    return []


def config_of_groups(registry):
    """A stage config whose family groups come from `registry`, as TrainConfig's come from FAMILIES."""
    from dataclasses import dataclass

    from specfoundry.common.settings import Settings, setting, unique_options

    @unique_options
    @dataclass(frozen=True, kw_only=True)
    @registry.option_groups(after="family")
    class Config(Settings):
        family: str = setting("a", help="which")
        lr: float = setting(1.0, help="lr")

    return Config


def test_options_cannot_collide_and_a_child_reads_its_parents_group_on_purpose():
    from specfoundry.families import Extended, Registry

    ok = Registry((entry("a", "ParentOptions"), entry("b", "ChildOptions", extends="a")))
    cfg = config_of_groups(ok)(family="b")
    assert [f.name for f in ok.chain("b")] == ["a", "b"]
    assert ok.options_for(cfg, "b") == Extended(cfg.a, cfg.b) and ok.options_for(cfg, "a") is cfg.a
    assert ok.options_for(cfg, "b").parent.block_size == 16  # the parent's setting, read through the parent
    clash = Registry((entry("a", "ParentOptions"), entry("b", "ClashingOptions", extends="a")))
    with pytest.raises(TypeError, match="option 'block_size' of b.block_size collides with a.block_size"):
        config_of_groups(clash)
    shadow = Registry((entry("a", "ShadowingOptions"),))
    with pytest.raises(TypeError, match="option 'lr' of lr collides with a.lr"):
        config_of_groups(shadow)
    with pytest.raises(TypeError, match="registered twice"):
        Registry((entry("a", "ParentOptions"), entry("a", "ChildOptions")))
    with pytest.raises(TypeError, match="extends 'c', which is not an earlier entry"):
        Registry((entry("b", "ChildOptions", extends="c"),))
    with pytest.raises(TypeError, match="architecture 'XModel' names two families"):
        Registry((entry("a", "ParentOptions", architectures=("XModel",)),
                  entry("b", "ChildOptions", architectures=("XModel",))))


def test_each_registered_architecture_names_its_family_and_the_catalogue_loads_no_torch():
    import subprocess
    import sys

    for name in FAMILIES.names():
        for arch in FAMILIES.get(name).architectures:
            assert FAMILIES.family_of_config({"architectures": [arch]}, "c") == name
    assert FAMILIES.family_of_config({"speculators_model_type": "eagle3"}, "c") == "eagle3"
    code = ("import sys; from specfoundry.families import FAMILIES; FAMILIES.get('dflash'); "
            "FAMILIES.family_of_config({'architectures': ['DFlashDraftModel']}, 'c'); "
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('specfoundry.families.')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_import_circle_through_the_family_interface_or_the_backend_interface():
    """Imports inside functions count: the catalogue names providers by string, so neither
    interface module (families/interface.py, generate/backends/interface.py) is on a circle."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
               for f in (root / "specfoundry").rglob("*.py")}
    graph = {m: set() for m in modules}
    for m, f in modules.items():
        for node in ast.walk(parse_python(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specfoundry"):
                graph[m] |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                             for a in node.names}
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in modules}

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    for interface in ("specfoundry.families.interface", "specfoundry.generate.backends.interface",
                      "specfoundry.families"):
        assert not reaches(interface, interface, set()), interface


@dataclass(frozen=True, kw_only=True)
class ParentOptions(Settings):
    block_size: int = setting(16, help="A parent's option.")


@dataclass(frozen=True, kw_only=True)
class ChildOptions(Settings):
    gru_hidden_dim: int = setting(8, help="A child's own option.")


@dataclass(frozen=True, kw_only=True)
class ClashingOptions(Settings):
    block_size: int = setting(8, help="A child redefining its parent's option.")


@dataclass(frozen=True, kw_only=True)
class ShadowingOptions(Settings):
    lr: float = setting(0.1, help="A family option named as a stage setting.")

