"""sf-eval's block decoding with a DFlash draft: greedy output equal to the target's own, the
sampling rule distributed as the target, and the report through the public sf-eval run."""

from __future__ import annotations

import pytest
import torch

from specfoundry.decoding.accept import accept_point_mass
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.eval.evaluate import EvalConfig, run_eval
from specfoundry.eval.prompts import BUILTIN_SETS, EvalError, load_prompts
from specfoundry.families.dflash.block import BlockDraftRunner, block_generate
from specfoundry.families.folders import load_draft, locate_draft
from specfoundry.featureset.store import FeatureSet


def test_greedy_block_decoding_equals_the_targets_generate(dflash_gate_run, smollm2_dir, smollm2_target):
    """On a prompt of every held-out set (where the one-conversation draft is mostly rejected) and
    on the gate's own prompt (where it is mostly accepted): both paths of verification."""
    cfg, export = dflash_gate_run
    model, tokenizer = smollm2_target.model, smollm2_target.tokenizer
    draft = load_draft(locate_draft(export), smollm2_dir, torch.device("cpu"), torch.float32)
    target = TargetRunner(smollm2_target, list(draft.cfg.target_layer_ids))
    runner = BlockDraftRunner(draft, smollm2_target.lm_head())
    sample = FeatureSet(f"{cfg.output}/features")[0]
    prompts = [p for name in BUILTIN_SETS for p in load_prompts(name, tokenizer, 1)]
    prompts.append(("gate", sample.input_ids[: int(sample.loss_mask.nonzero()[0])].tolist()))
    eos = set(smollm2_target.end_of_turn_ids())
    accepted = []
    for pid, ids in prompts:
        n = 40 if pid == "gate" else 12
        out = block_generate(target, runner, ids, max_new_tokens=n, eos=eos, sampler=Sampler())
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.tokens == ref[:cut], f"{pid}: block decoding differs from the target's greedy output"
        accepted += out.accepted
    assert 0 < sum(accepted) < (draft.cfg.block_size - 1) * len(accepted), accepted
    target.remove_hooks()


def test_the_block_rule_samples_as_the_target():
    """A point-mass proposal d kept with probability p(d), else a sample of p without d: the first
    token is distributed as p, whatever d is."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, generator=g) * 2
    p = torch.softmax(logits[0], -1)
    sampler = Sampler(1.0, torch.Generator().manual_seed(1))
    draws = 20000
    counts = torch.zeros(6)
    for i in range(draws):
        d = i % 6  # every proposal in turn, likely and unlikely
        a, bonus = accept_point_mass([d], torch.cat([logits, logits]), sampler)
        counts[d if a == 1 else bonus] += 1
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts, expected)  # the 0.999 quantile of chi-square(5)


def test_sf_eval_run_decodes_a_dflash_draft_in_blocks(dflash_gate_run, tmp_path, smollm2_target):
    cfg, export = dflash_gate_run
    report = run_eval(EvalConfig(draft=str(export), output=str(tmp_path / "eval"), prompt_sets=("chat",), limit=2,
                                 max_new_tokens=12, device="cpu", dtype="float32"), silent=True, target=smollm2_target)
    assert report["family"] == "dflash" and report["config"]["k"] == cfg.k  # block k+1: k proposals per round
    assert report["draft_training_steps"] == cfg.max_steps  # from the export's training record
    chat = report["sets"]["chat"]["trained"]
    assert chat["identical_to_target"] == "2/2" and len(chat["accept_rate_by_position"]) == cfg.k
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_sf_eval_sweeps_a_block_drafter_by_its_proposals_and_refuses_the_engines_tree(dflash_gate_run, smollm2_target,
                                                                                     tmp_path):
    """sf-eval sweep of a DFlash draft (issue 58): a setting is k, the proposals a round, served at a
    block of k + 1 up to its trained one, with SGLang's block flag; k past it is one line; and SGLang's
    EAGLE tree (--num-steps/--topk/--num-draft-tokens) asked of it is one line. (Here, beside the DFlash
    gate run, which conftest's scheduler builds once: test_eval.py holds the EAGLE-3 side.)"""
    from specfoundry.eval.sweep import SweepConfig, run_sweep

    _, dflash = dflash_gate_run  # a draft of blocks of 5: 4 proposals a round
    base = dict(prompt_sets=("chat",), limit=1, max_new_tokens=8, device="cpu")
    blocks = run_sweep(SweepConfig(draft=str(dflash), output=str(tmp_path / "d"), settings=("2", "4"), **base),
                       silent=True, target=smollm2_target)
    assert [r["verify_width"] for r in blocks["rows"]] == [3, 5]  # served at a block of 3, and its own
    assert "--speculative-num-draft-tokens" in blocks["serve"]["sglang"]
    with pytest.raises(EvalError, match="a dflash setting is k, the proposals a round, from 1 to 4"):
        run_sweep(SweepConfig(draft=str(dflash), output=str(tmp_path / "e"), settings=("5",), **base),
                  silent=True, target=smollm2_target)
    with pytest.raises(EvalError, match="pick SGLang's EAGLE tree; .* is a dflash draft"):
        run_eval(EvalConfig(draft=str(dflash), num_steps=3, topk=2, num_draft_tokens=6, **base), target=smollm2_target)
