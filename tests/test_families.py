"""Draft families: the interface's layer choice, one capture for every family, and the EAGLE-3.1
options (shapes, export fields, decoding equal to training)."""

from __future__ import annotations

import json

import pytest
import torch

from specfoundry.capture.stage import CaptureConfig, CaptureError, stored_layers
from specfoundry.common.taps import default_aux_layers, dflash_default_layers
from specfoundry.eval.draft import find_draft_files
from specfoundry.eval.speculative import DraftRunner
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.testing import random_eagle3_draft
from specfoundry.train.dflash.options import DFlashOptions
from specfoundry.train.eagle3.config import Eagle3Config, Eagle3Options
from specfoundry.train.eagle3.export import expected_tensors, export_draft, validate
from specfoundry.train.eagle3.model import Eagle3Draft, TTTCache
from specfoundry.train.eagle3.ttt import shift
from specfoundry.train.family import get_family, select_layers

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
    eagle3, dflash = get_family("eagle3"), get_family("dflash")
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
    cfg, tensors = find_draft_files(out)
    assert cfg.fc_norm and cfg.norm_output and set(tensors) == names
    (out / "specfoundry_draft.json").unlink()  # as another tool would write it: config.json alone
    cfg, _ = find_draft_files(out)
    assert cfg.fc_norm and cfg.norm_output
    del tensors["fc_norm.1.weight"]
    with pytest.raises(ValueError, match=r"missing \['fc_norm.1.weight'\]"):
        validate(tensors, draft.cfg)


def tiny_dflash(**over):
    from specfoundry.train.dflash.config import DFlashConfig
    from specfoundry.train.dflash.model import DFlashDraft

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=97, target_hidden_size=32,
                       target_layer_ids=(1, 3, 5), block_size=4, mask_token_id=96, **over)
    torch.manual_seed(0)
    return DFlashDraft(cfg).eval()


def test_dflash_export_is_what_sglangs_loader_reads_and_reads_back(tmp_path):
    """The fields SGLang's DFlash loader reads (spec in train/dflash/export.py), exactly its 11 tensors
    per layer + fc, hidden_norm, norm (no embedding, no lm_head), and the same draft read back."""
    from specfoundry.train.dflash.export import export_draft
    from specfoundry.train.dflash.export import validate as validate_dflash

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
    cfg, tensors = find_draft_files(out)
    assert set(tensors) == want and tuple(tensors["fc.weight"].shape) == (32, 96)
    assert cfg == draft.cfg
    (out / "specfoundry_draft.json").unlink()  # another tool's export: config.json alone
    assert find_draft_files(out)[0] == draft.cfg
    del tensors["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.k_norm.weight'\]"):
        validate_dflash(tensors, draft.cfg)


def test_the_loader_hands_out_the_chosen_layers_of_a_union_set(tmp_path):
    """A set holding 6 layers: each family's batch holds exactly its layers' stored columns, in order,
    and no final state where the family reads none."""
    from dataclasses import replace

    from specfoundry.testing import SMOL_DRAFT, write_random_featureset
    from specfoundry.train.loader import FeatureLoader

    cfg = replace(SMOL_DRAFT, aux_layer_ids=(1, 8, 14, 20, 26, 27))
    fs = write_random_featureset(tmp_path, 2, 16, cfg)
    h = cfg.hidden_size
    manifest = fs.manifest
    for family, options, want in [("eagle3", Eagle3Options(), [1, 14, 26]),
                                  ("dflash", DFlashOptions(num_draft_layers=5), [1, 8, 14, 20, 27])]:
        fam = get_family(family)
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
    from specfoundry.train.dflash.export import export_draft
    from specfoundry.train.dflash.export import load_export as load_dflash
    from specfoundry.train.drafts import DraftLoadError
    from specfoundry.train.eagle3.export import load_export as load_eagle3

    draft = tiny_dflash()
    out = export_draft(draft.state_dict(), draft.cfg, tmp_path / "export")
    with pytest.raises(ValueError, match="is a DFlash draft: pass --family dflash"):
        load_eagle3(out)
    eagle = export_draft_eagle3(tmp_path / "eagle3")
    with pytest.raises(ValueError, match="is not a DFlash draft"):
        load_dflash(eagle)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [5, 3, 1]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError, match=r"config.json: target_layer_ids must be .*ascending"):
        find_draft_files(out)


def export_draft_eagle3(out):
    draft = random_draft()
    return export_draft(draft.state_dict(), draft.cfg, out)
