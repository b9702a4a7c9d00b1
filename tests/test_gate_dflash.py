"""The DFlash gate passes on an honest SmolLM2 run and names the broken piece (its own file so
that xdist runs it beside test_block_decoding.py, which shares its gate run)."""

from __future__ import annotations

from specfoundry.gate import run_checks, verdict
from tests.test_gate import broken_copy


def test_dflash_gate_passes_on_smollm2(dflash_gate_run, smollm2_target):
    cfg, export = dflash_gate_run
    checks = run_checks(cfg, export, smollm2_target)
    ok, message = verdict(checks)
    assert ok, message
    assert [c.name for c in checks] == ["export names", "mask token", "layers", "layers", "positions", "fit", "decode"]
    decode = next(c for c in checks if c.name == "decode")
    assert float(decode.detail.split()[2]) >= 0.8 * (cfg.k + 1)


def test_dflash_gate_names_a_broken_mask_token(dflash_gate_run, tmp_path, smollm2_target):
    cfg, export = dflash_gate_run

    def other_mask(c):
        c["dflash_config"]["mask_token_id"] -= 1

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path, config=other_mask), smollm2_target))
    assert not ok and message.startswith("gate failed at mask token"), message


def test_dflash_gate_names_wrong_layer_ids(dflash_gate_run, tmp_path, smollm2_target):
    cfg, export = dflash_gate_run

    def shift_layers(c):
        c["dflash_config"]["target_layer_ids"] = [i + 1 for i in c["dflash_config"]["target_layer_ids"]]

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path, config=shift_layers), smollm2_target))
    assert not ok and message.startswith("gate failed at layers") and "[2, 9, 15, 21, 28]" in message, message


def test_dflash_gate_names_a_misnamed_export_tensor(dflash_gate_run, tmp_path, smollm2_target):
    cfg, export = dflash_gate_run

    def rename(t):  # SGLang would silently ignore it and leave its parameter uninitialised
        t["layers.0.self_attn.qnorm.weight"] = t.pop("layers.0.self_attn.q_norm.weight")

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path, tensors=rename), smollm2_target))
    assert not ok and message.startswith("gate failed at export names") and "q_norm" in message, message
