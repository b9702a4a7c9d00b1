"""The gate passes on an honest SmolLM2 run and names the broken stage when one piece is broken."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from specfoundry.gate import run_checks, verdict


def broken_copy(export, tmp_path, tensors=None, config=None):
    out = tmp_path / "broken-export"
    shutil.copytree(export, out)
    if tensors is not None:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    if config is not None:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    return out


def assert_gate_fails_at(cfg, export, tmp_path, where: str, tensors=None, config=None) -> None:
    """The gate's verdict on a copy of `export` broken as broken_copy's `tensors` / `config` say (in its
    own folder under tmp_path) is a failure, first at check `where`."""
    broken = broken_copy(export, tmp_path / where.replace(" ", "-"), tensors=tensors, config=config)
    ok, message = verdict(run_checks(cfg, broken))
    assert not ok and message.startswith(f"gate failed at {where}"), message


def test_gate_passes_on_smollm2(gate_run, smollm2_target):
    cfg, export = gate_run
    checks = run_checks(cfg, export, smollm2_target)
    ok, message = verdict(checks)
    assert ok, message
    decode = next(c for c in checks if c.name == "decode")
    assert float(decode.detail.split()[2]) >= 0.8 * (cfg.k + 1)


def test_gate_names_a_shuffled_vocab_map(gate_run, tmp_path, smollm2_target):
    cfg, export = gate_run

    def shuffle(t):
        ids = t["d2t"] + torch.arange(len(t["d2t"]))
        perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
        t["d2t"] = ids[perm] - torch.arange(len(ids))

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path, tensors=shuffle), smollm2_target))
    assert not ok and message.startswith("gate failed at vocab map"), message


def test_gate_names_wrong_layer_ids(gate_run, tmp_path, smollm2_target):
    cfg, export = gate_run

    def shift_layers(c):  # in both fields, each in its engine's convention
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]
        c["eagle_aux_hidden_state_layer_ids"] = [3, 16, 28]

    checks = run_checks(cfg, broken_copy(export, tmp_path / "both", config=shift_layers), smollm2_target)
    ok, message = verdict(checks)
    assert not ok and message.startswith("gate failed at features") and "[2, 15, 27]" in message, message

    def shift_nested(c):  # SGLang would read other layers than vLLM
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path / "nested", config=shift_nested), smollm2_target))
    assert not ok and message.startswith("gate failed at export") and "name different layers" in message, message
    # (decoding alone would not catch this one: neighbouring layers' residual streams are close
    # enough that the overfitted draft is still accepted about 4 times in 5; hence the check)


def test_gate_names_a_renamed_export_tensor(gate_run, tmp_path, smollm2_target):
    cfg, export = gate_run

    def swap(t):  # a classic export bug: q and k projections exchanged under SGLang's names
        q, k = "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"
        t[q] = torch.cat([t[k], t[k], t[k]])  # same shape as q (9 heads vs 3 kv heads)

    ok, message = verdict(run_checks(cfg, broken_copy(export, tmp_path, tensors=swap), smollm2_target))
    assert not ok and message.startswith("gate failed at export"), message
