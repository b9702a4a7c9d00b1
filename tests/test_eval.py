"""sf-eval: speculative decoding reproduces the target exactly (greedy) and in distribution
(sampling); the report has what users need."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specfoundry.common.target import Target
from specfoundry.decoding.rounds import DecodeResult
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.eval.evaluate import EvalConfig, run_eval
from specfoundry.eval.prompts import BUILTIN_SETS, EvalError, load_prompts
from specfoundry.eval.report import format_table, summarise_set
from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
from specfoundry.families.eagle3.config import draft_config_from_target
from specfoundry.families.eagle3.model import Eagle3Draft
from specfoundry.families.eagle3.tree import propose_tree, tree_generate
from specfoundry.families.folders import load_draft, locate_draft, untrained_like
from specfoundry.families.vocab import vocab_maps
from specfoundry.featureset.store import FeatureSet
from tests.conftest import chi2_critical, sharp_tiny_target


class Decoding:
    """SmolLM2, the gate-trained draft, and memoised decodings: transformers' greedy generate
    (the reference) and ours, per (prompt, length, tree), so the tests below share them.
    gate_ids: the conversation the draft was fitted to (prompt and answer); gate_answer: where
    its answer starts."""

    def __init__(self, target: Target, export, smollm2_dir, gate_features: Path):
        self.model, self.tokenizer = target.model, target.tokenizer
        self.target = TargetRunner(target, [1, 14, 26])
        self.draft = DraftRunner(load_draft(locate_draft(export), smollm2_dir, torch.device("cpu"), torch.float32))
        sample = FeatureSet(gate_features)[0]
        self.gate_ids = sample.input_ids.tolist()
        self.gate_answer = int(sample.loss_mask.nonzero()[0])
        self.memo: dict = {}

    def reference(self, pid, ids, n):
        """transformers' own greedy generate, independent of our runners (the first n tokens of a
        longer one already made: greedy decoding of n tokens is a prefix of that of more)."""
        key = ("ref", pid, n)
        longer = [k for k in self.memo if k[:2] == ("ref", pid) and k[2] > n]
        if key not in self.memo and longer:
            self.memo[key] = self.memo[longer[0]][:n]
        if key not in self.memo:
            self.memo[key] = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                                 max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        return self.memo[key]

    def ours(self, pid, ids, n, tree=None):
        """Chain k=4, or the tree with this branching."""
        key = ("ours", pid, n, tree)
        if key not in self.memo:
            eos = {self.tokenizer.eos_token_id}
            if tree:
                self.memo[key] = tree_generate(self.target, self.draft, ids, branching=tree, max_new_tokens=n, eos=eos)
            else:
                self.memo[key] = speculative_generate(self.target, self.draft, ids, k=4, max_new_tokens=n, eos=eos,
                                                      sampler=Sampler())
        return self.memo[key]


@pytest.fixture(scope="module")
def decoding(gate_run, smollm2_dir, smollm2_target):
    return Decoding(smollm2_target, gate_run[1], smollm2_dir, Path(gate_run[0].output) / "features")


def greedy_equality(decoding, limit, max_new_tokens, tree=None):
    """Speculative (chain k=4, or the tree) output == transformers' greedy generate, on the
    built-in prompts (where the gate's one-conversation draft is mostly rejected) and the gate's
    own prompt (where it is mostly accepted), so both paths of verification are exercised."""
    prompts = [p for name in BUILTIN_SETS for p in load_prompts(name, decoding.tokenizer, limit)]
    prompts.append(("gate", decoding.gate_ids[: decoding.gate_answer]))
    accepted = []
    for pid, ids in prompts:
        out = decoding.ours(pid, ids, max_new_tokens, tree)
        assert out.tokens == decoding.reference(pid, ids, max_new_tokens), (
            f"{pid}: speculative output differs from the target's greedy output")
        accepted += out.accepted
    # the draft must really have been accepted sometimes (and rejected), or the test shows little
    assert 0 < sum(accepted) < 4 * len(accepted), accepted
    return len(prompts), accepted


def test_greedy_speculative_equals_target_generate(decoding):
    assert greedy_equality(decoding, limit=1, max_new_tokens=16)[0] == len(BUILTIN_SETS) + 1


def test_tree_decoding_equals_target_generate_and_accepts_at_least_the_chain(decoding):
    """The tree's output is the target's greedy output on the built-in prompts. And from the same
    context its first target forward accepts at least the chain's tokens, since the tree holds the
    chain as its top-1 branch: checked on prefixes of the gate's conversation, the one the draft
    was fitted to, where the chain accepts tokens (on the built-in prompts this draft accepts
    almost none, so the comparison there would be empty). That the tree accepts more in total is
    shown on the tiny pair (test_tree_decoding_on_a_tiny_target_is_exact)."""
    branching = (2, 2, 1, 1)  # 14 nodes a verify (3,2,2,1's 33 made this the file's longest test)
    assert greedy_equality(decoding, limit=1, max_new_tokens=12, tree=branching)[0] == len(BUILTIN_SETS) + 1
    ids, answer = decoding.gate_ids, decoding.gate_answer
    eos = {decoding.tokenizer.eos_token_id}
    chain, tree = [], []
    for end in range(answer, len(ids) - len(branching), 8):
        context = ids[:end]
        chain.append(speculative_generate(decoding.target, decoding.draft, context, k=len(branching),
                                          max_new_tokens=len(branching) + 1, eos=eos, sampler=Sampler()).accepted[0])
        tree.append(tree_generate(decoding.target, decoding.draft, context, branching=branching,
                                  max_new_tokens=len(branching) + 1, eos=eos).accepted[0])
    print("accepted per context: chain", chain, "tree", tree)
    assert sum(chain) > 0, chain
    assert all(t >= c for t, c in zip(tree, chain, strict=True)), (tree, chain)


@pytest.mark.slow
def test_greedy_speculative_equals_target_generate_all_held_out_prompts(decoding):
    assert greedy_equality(decoding, limit=None, max_new_tokens=64)[0] == 60 + 1


def true_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("branching", [(1, 1, 1), (2,), (3, 2), (5, 1, 1, 1), (3, 3, 3), (8, 1), (2, 8)])
def test_tree_decoding_on_a_tiny_target_is_exact(branching):
    """A random 6-token target, where a random draft is often right: the tree's output is the
    target's greedy output, branches beyond the top-1 get accepted, and a tree of branching 1
    is exactly the chain of the same depth. A width over the draft's vocabulary takes all of it."""
    model, draft_model = tiny_pair()
    target, draft = TargetRunner(Target.wrap(model), [0, 1, 2]), DraftRunner(draft_model)
    tree_total, chain_total = 0, 0
    for prompt in ([1, 2, 3], [4, 0, 5, 2, 2], [3]):
        out = tree_generate(target, draft, prompt, branching=branching, max_new_tokens=30, eos=set())
        chain = speculative_generate(target, draft, prompt, k=len(branching), max_new_tokens=30, eos=set(),
                                     sampler=Sampler())
        assert out.tokens == true_greedy(model, prompt, 30) == chain.tokens
        if max(branching) == 1:
            assert out.accepted == chain.accepted
        tree_total += sum(out.accepted)
        chain_total += sum(chain.accepted)
    assert tree_total >= chain_total
    if max(branching) > 1:
        assert tree_total > chain_total


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_decodes_phases_are_measured_and_fit_in_its_wall_time(device):
    """The parts sf-eval reports (the prompt's prefill, the draft's read of it, the rounds' draft and
    target time) are each measured, for the chain and the tree, and lie inside the decode's wall time.
    On the host clock (CPU) they are disjoint intervals within it, with Python's work between them (a
    microsecond or more, far above float64's rounding of second-sized sums), so their sum stays below.
    On a GPU they are CUDA event spans in stream order, recorded after the decode's clock starts and
    run before its last synchronisation: their sum is at most the wall time, up to elapsed_time's
    resolution (about 0.5 us a reading; 1 us a span allowed)."""
    model, draft_model = tiny_pair()
    model, draft_model = model.to(device), draft_model.to(device)
    target, draft = TargetRunner(Target.wrap(model), [0, 1, 2]), DraftRunner(draft_model)
    chain = speculative_generate(target, draft, [1, 2, 3], k=3, max_new_tokens=12, eos=set(), sampler=Sampler())
    tree = tree_generate(target, draft, [1, 2, 3], branching=(2, 1), max_new_tokens=12, eos=set())
    for out in (chain, tree):
        phases = [out.prefill_s, out.start_s, out.draft_s, out.target_s]
        assert min(phases) > 0
        if device == "cpu":
            assert sum(phases) < out.total_s
        else:
            assert sum(phases) <= out.total_s + (2 + 3 * out.rounds) * 1e-6


def test_a_sets_time_parts_add_up_to_its_decodes_wall_time():
    """summarise_set's parts (draft, target and other a round; prefill and start a prompt) times their
    counts give back the decodes' total time, and tokens/s is tokens over it."""
    results = [DecodeResult([5] * 6, accepted=[2, 1, 0], draft_s=0.003, target_s=0.006, prefill_s=0.002,
                            start_s=0.001, total_s=0.015),
               DecodeResult([5] * 2, accepted=[1], draft_s=0.001, target_s=0.002, prefill_s=0.002, start_s=0.003,
                            total_s=0.009)]
    s = summarise_set(results, k=3)
    assert (s["rounds"], s["tokens"]) == (4, 8)
    assert s["other_ms_per_round"] == pytest.approx(1.0)  # (0.003 + 0.001) s over 4 rounds
    parts = 4 * (s["draft_ms_per_round"] + s["target_ms_per_round"] + s["other_ms_per_round"]) \
        + 2 * (s["prefill_ms_per_prompt"] + s["start_ms_per_prompt"])
    assert parts == pytest.approx(24.0)  # ms; float64 sums of six terms: rounding near 1e-14 of pytest's 1e-6
    assert s["tokens_per_s"] == pytest.approx(8 / 0.024)


@pytest.mark.gpu
def test_tree_decoding_on_a_tiny_target_is_exact_on_gpu():
    """The tree path on CUDA (batched top-k per depth, masks moved to the device): output equal to
    the target's own greedy decoding, on the same tiny pair as above."""
    model, draft_model = tiny_pair()
    model, draft_model = model.cuda(), draft_model.cuda()
    target, draft = TargetRunner(Target.wrap(model), [0, 1, 2]), DraftRunner(draft_model)
    for prompt in ([1, 2, 3], [4, 0, 5, 2, 2], [3]):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(30):
                ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        out = tree_generate(target, draft, prompt, branching=(3, 2, 1), max_new_tokens=30, eos=set())
        assert out.tokens == ids[len(prompt):]


def test_draft_tree_nodes_are_the_chain_along_their_branch():
    """Each node's children are the top-k of the draft run as a chain along the node's branch:
    siblings and cousins are invisible, positions and hidden inputs are the chain's."""
    model, draft_model = tiny_pair()
    target, draft = TargetRunner(Target.wrap(model), [0, 1, 2]), DraftRunner(draft_model)
    prompt = [1, 2, 3, 4]
    target.reset()
    draft.reset()
    logits, aux, _ = target.forward(prompt)
    draft.extend(prompt[1:] + [int(logits[-1].argmax())], aux)
    branching = (3, 2, 2)
    tree = propose_tree(draft, branching)
    assert len(tree) == 3 + 6 + 12 and len(draft) == len(prompt) and draft.written == len(draft)
    target_to_draft = {int(t): d for d, t in enumerate(draft.draft_to_target)}
    children = tree.children()
    for node in range(len(tree)):
        if tree.depths[node] == len(branching):
            continue
        branch = [node]
        while tree.parents[branch[0]] >= 0:
            branch.insert(0, tree.parents[branch[0]])
        base, pre = len(draft), draft.pre
        for depth, n in enumerate(branch, start=1):
            pre, out = draft.run([tree.tokens[n]], pre, [base - 1 + depth])
        draft.forget_proposals()
        want = out[-1].topk(branching[len(branch)]).indices.tolist()
        assert [target_to_draft[tree.tokens[c]] for c in children[node]] == want, node


def tiny_pair(vocab=6, seed=0):
    """A random 4-layer target over a 6-token vocabulary and a random draft, both sharp enough
    that the draft often disagrees with the target (so rejections happen)."""
    target = sharp_tiny_target(vocab, seed)
    dcfg = draft_config_from_target(target.config.to_dict(), vocab - 1, [0, 1, 2])
    draft = Eagle3Draft(dcfg)
    d2t, t2d = vocab_maps(torch.arange(1, vocab), vocab)  # token 0 is outside the draft's vocabulary
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    with torch.no_grad():
        draft.lm_head.weight.mul_(40)
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    return target, draft.eval()


def exact_two_token_distribution(model, prompt, temperature):
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        rows = []
        for t in range(len(p1)):
            p2 = torch.softmax(model(torch.tensor([prompt + [t]])).logits[0, -1] / temperature, -1)
            rows.append(p1[t] * p2)
    return torch.stack(rows).flatten().double()  # [V*V], index t1*V + t2


def test_sampling_output_is_distributed_as_the_target():
    # 1000 draws: each is a whole eager speculative_generate (Python-bound); the chi-square test
    # keeps its 0.001 false-alarm level at any n, and against the draft's own distribution (q1
    # has near-zero cells) its statistic is many orders of magnitude over the bar at this n
    vocab, prompt, temperature, n = 6, [1, 2, 3], 1.0, 1000
    model, draft_model = tiny_pair(vocab)
    target, draft = TargetRunner(Target.wrap(model), [0, 1, 2]), DraftRunner(draft_model)
    sampler = Sampler(temperature, torch.Generator().manual_seed(0))
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    rejected = 0
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, k=3, max_new_tokens=2, eos=set(), sampler=sampler)
        counts[out.tokens[0] * vocab + out.tokens[1]] += 1
        rejected += out.accepted[0] < 3
    assert rejected > n // 10, "the draft should disagree with the target often enough to test rejection"
    p = exact_two_token_distribution(model, prompt, temperature)
    keep = p * n >= 5  # chi-square needs expected counts >= 5; pool the rest into one cell
    expected = torch.cat([p[keep] * n, (p[~keep] * n).sum()[None]])
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    stat = (((observed - expected) ** 2) / expected.clamp(min=1e-9)).sum().item()
    df = int(keep.sum())  # cells - 1, with the pooled cell
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    # power: the same samples are clearly not distributed as the draft's own proposals would be
    q1 = torch.zeros(vocab)
    with torch.no_grad():
        draft.reset()
        _, aux, _ = target.reset() or target.forward(prompt)
        q1[draft.draft_to_target] = torch.softmax(draft.extend(prompt[1:] + [0], aux)[-1] / temperature, -1)
    p1_obs = counts.view(vocab, vocab).sum(1)
    stat_draft = ((p1_obs - q1.double() * n) ** 2 / (q1.double() * n).clamp(min=1e-9)).sum().item()
    assert stat_draft > chi2_critical(vocab - 1)


def test_eval_report_and_untrained_floor(gate_run, tmp_path, smollm2_target):
    cfg, export = gate_run
    out = tmp_path / "eval"
    # the gate's regen output as a dataset file: its prompt is the one the draft has overfitted
    own = str(Path(cfg.output) / "regen")
    report = run_eval(EvalConfig(draft=str(export), prompt_sets=(own, "chat"), limit=1, k=4, max_new_tokens=20,
                                 compare_untrained=True, device="cpu", output=str(out)), target=smollm2_target)
    for entry in report["sets"].values():
        for label in ("trained", "untrained"):
            s = entry[label]
            assert 1.0 <= s["accept_length"] <= 5.0 and len(s["accept_rate_by_position"]) == 4
            assert s["identical_to_target"] == "1/1"
    seen = report["sets"][own]
    assert seen["trained"]["accept_length"] >= 4.0 > 1.5 > seen["untrained"]["accept_length"]
    assert json.loads((out / "eval.json").read_text())["sets"]["chat"]["trained"]["rounds"] > 0
    assert (out / "acceptance.png").stat().st_size > 1000 and "accept len" in (out / "eval.txt").read_text()
    # the time the run took: each set's decodes, and the whole run around them
    assert 0 < sum(e["wall_s"] for e in report["sets"].values()) <= report["wall_s"]
    assert "the whole run" in (out / "eval.txt").read_text()
    # and the time outside the rounds, which with them accounts for tokens/s
    chat = report["sets"]["chat"]["trained"]
    assert chat["prefill_ms_per_prompt"] > 0 and chat["start_ms_per_prompt"] > 0 and chat["other_ms_per_round"] > 0
    assert "outside the rounds" in (out / "eval.txt").read_text()
    k = report["config"]["k"]  # the per-position columns are named and explained under the table
    assert f"{'p' + str(k):>5}" in (out / "eval.txt").read_text() and f"p1..p{k}: " in (out / "eval.txt").read_text()


def test_the_gpu_warm_up_leaves_every_decoded_figure_but_time_unchanged(gate_run, smollm2_target, monkeypatch):
    """The untimed warm-up decode that a GPU gets (warm_up) changes no token or round: forced on a
    CPU, the report's counts equal a run without it, greedy and sampled."""
    import specfoundry.eval.evaluate as evaluate

    _, export = gate_run
    calls, original = [], evaluate.warm_up
    monkeypatch.setattr(evaluate, "warm_up", lambda *a: calls.append(1) or original(*a))
    for temperature in (0.0, 0.8):
        cfg = EvalConfig(draft=str(export), prompt_sets=("chat",), limit=1, k=3, max_new_tokens=8, device="cpu",
                         temperature=temperature, baseline=temperature == 0.0)
        reports = []
        for forced in (False, True):
            monkeypatch.setattr(evaluate, "warms_up", lambda device, forced=forced: forced)
            report = run_eval(cfg, target=smollm2_target)
            assert (report["warm_up_s"] is not None) == forced  # its time, apart from the sets'
            assert ("; warm-up " in format_table(report)) == forced
            if forced:
                assert 0 < report["warm_up_s"] < report["wall_s"]
            reports.append(report["sets"]["chat"]["trained"])
        keys = ("prompts", "rounds", "tokens", "accept_length")
        assert {k: reports[0][k] for k in keys} == {k: reports[1][k] for k in keys}
    assert len(calls) == 2


def test_untrained_draft_keeps_the_vocabulary(gate_run, smollm2_dir):
    _, export = gate_run
    draft = load_draft(locate_draft(export), smollm2_dir, torch.device("cpu"), torch.float32)
    fresh = untrained_like(draft)
    assert torch.equal(fresh.d2t, draft.d2t) and not torch.equal(fresh.fc.weight, draft.fc.weight)


def test_a_missing_draft_or_source_is_named_before_the_target_loads(tmp_path, monkeypatch):
    """sf-eval run and sf-capture run check their input before loading the target, which takes
    minutes on a large one."""
    from click.testing import CliRunner

    from specfoundry.capture.cli import main as capture_main
    from specfoundry.cli import sf_eval as eval_main
    from specfoundry.common.target import Target

    def load(*a, **k):
        raise AssertionError("the target was loaded before the input was checked")

    monkeypatch.setattr(Target, "load", load)
    for main, argv, said in ((eval_main, ["run", str(tmp_path), "-o", str(tmp_path / "e")], "is not an exported draft"),
                             (capture_main, ["run", str(tmp_path / "none"), "-o", str(tmp_path / "c")],
                              "no such file or folder")):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code != 0 and said in result.output, (result.output, result.exception)


def test_sf_eval_run_says_where_the_report_went_or_that_it_went_nowhere(tmp_path, monkeypatch):
    """Without -o sf-eval run prints its table and writes nothing: said in its last line, so that
    a missing -o is not found out only after a long run."""
    from click.testing import CliRunner

    import specfoundry.eval.cli as eval_cli
    from specfoundry.cli import sf_eval

    monkeypatch.setattr(eval_cli, "run_eval", lambda cfg, silent=False: {})  # the decoding is not what is checked
    monkeypatch.setattr(eval_cli, "format_table", lambda report: "the table")
    said = {}
    for name, extra in (("without", []), ("with", ["-o", str(tmp_path / "e")])):
        result = CliRunner().invoke(sf_eval, ["run", str(tmp_path), *extra])
        assert result.exit_code == 0, (result.output, result.exception)
        said[name] = result.output.splitlines()
    assert said["without"] == ["the table", "wrote nothing: -o DIR keeps the report (eval.json, eval.txt, acceptance.png)"]
    assert said["with"] == ["the table", f"wrote {tmp_path / 'e'}/eval.json, eval.txt, acceptance.png"]


def test_bad_prompt_set_and_draft_fail_clearly(tmp_path, smollm2_dir):
    from specfoundry.common.target import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    with pytest.raises(EvalError, match="neither a built-in set"):
        load_prompts("nonexistent-set", tok)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(EvalError, match=r"p.jsonl:2.*no_user_turn"):
        load_prompts(str(bad), tok)
    from click.testing import CliRunner

    from specfoundry.cli import sf_eval as main

    result = CliRunner().invoke(main, ["run", str(tmp_path), "--prompts", "chat"])
    assert result.exit_code != 0 and "is not an exported draft" in str(result.output) + str(result.exception)
    with pytest.raises(EvalError, match="verifies greedily"):
        run_eval(EvalConfig(draft=str(tmp_path), tree=(2, 2), temperature=0.7))
    with pytest.raises(EvalError, match="--compile-target .* CUDA device only"):
        run_eval(EvalConfig(draft=str(tmp_path), compile_target=True, device="cpu"))
    with pytest.raises(EvalError, match="--compile-draft .* CUDA device only"):
        run_eval(EvalConfig(draft=str(tmp_path), compile_draft=True, device="cpu"))
    result = CliRunner().invoke(main, ["run", str(tmp_path), "--tree", "4,x"])
    assert result.exit_code != 0 and "comma-separated integers" in str(result.output) + str(result.exception)


def test_modes_render_the_prompts_and_are_reported_side_by_side(gate_run, smollm2_target, monkeypatch):
    """By default the prompts render in the mode of the draft's feature set (its export records
    it); --modes decodes every set in each. SmolLM2's own template reads no enable_thinking, so a
    mode of it is refused in one line; under a template that reads it (Qwen3's rules) both modes
    decode, reported side by side: what is checked is the routing and the report's shape."""
    from specfoundry.testing import QWEN3_THINKING_TEMPLATE

    _, export = gate_run
    base = dict(draft=str(export), prompt_sets=("chat",), limit=1, k=3, max_new_tokens=8, device="cpu",
                baseline=False)
    report = run_eval(EvalConfig(**base), target=smollm2_target)
    assert report["modes_from"] == "the draft's feature set" and report["modes"] == {"default": {}}
    assert set(report["sets"]) == {"chat"}
    modes = ({}, {"enable_thinking": False})
    with pytest.raises(EvalError, match="--modes: the chat template reads no 'enable_thinking'"):
        run_eval(EvalConfig(**base, modes=modes), target=smollm2_target)
    monkeypatch.setattr(smollm2_target.tokenizer, "chat_template", QWEN3_THINKING_TEMPLATE)
    both = run_eval(EvalConfig(**base, modes=modes), target=smollm2_target)
    assert set(both["sets"]) == {"chat [default]", "chat [enable_thinking=false]"}
    assert both["modes_from"] == "--modes"


def test_the_default_dtype_is_the_exact_one_where_the_target_fits_its_gpu(tiny_llama_dir, monkeypatch):
    """Without --dtype: float32 on CPU; on one GPU float32 (greedy output exactly the target's own)
    while the target's float32 weights take at most half of the device, bfloat16 beyond, and over
    several devices, each said in one line. (The device is a name here and its memory a number:
    nothing runs on a GPU.)"""
    from types import SimpleNamespace

    import specfoundry.eval.evaluate as evaluate
    from specfoundry.common.placement import Placement
    from specfoundry.common.target import parameter_count

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    count = parameter_count(tiny_llama_dir)
    assert count == sum(p.numel() for p in model.parameters())  # from the config alone, tied weights once
    assert evaluate.exact_default_dtype(EvalConfig(draft="d", target=str(tiny_llama_dir), device="cpu"))[0] == \
        torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    on_gpu = dict(draft="d", device="cuda")
    monkeypatch.setattr(evaluate, "parameter_count", lambda path: 8 * 10**9)  # 32 GB in float32: fits half of 80 GiB
    dtype, why = evaluate.exact_default_dtype(EvalConfig(**on_gpu))
    assert dtype == torch.float32 and "exactly the target's own" in why
    monkeypatch.setattr(evaluate, "parameter_count", lambda path: 30 * 10**9)  # 120 GB in float32
    dtype, why = evaluate.exact_default_dtype(EvalConfig(**on_gpu))
    assert dtype == torch.bfloat16 and "its float32 weights (112 GiB) would take more than 50% of cuda's 80 GiB" in why
    monkeypatch.setattr(evaluate, "parameter_count", lambda path: 10**6)
    dtype, why = evaluate.exact_default_dtype(EvalConfig(**on_gpu, placement=Placement(tp=2)))
    assert dtype == torch.bfloat16 and "several devices" in why and "--dtype float32" in why


@pytest.mark.parametrize("tree, nodes", [("64,64,64", "266,304"), ("4096,4096", "16,781,312")])
def test_a_tree_past_the_node_bound_is_one_line_before_any_work(tmp_path, tree, nodes):
    """issue 61 item 10: --tree had no bound: 64,64,64 asked for 71 GB and 4096,4096 was killed for
    memory. A tree of more than MAX_TREE_NODES is refused where the option is read, naming its count."""
    from click.testing import CliRunner

    from specfoundry.cli import TOOLS

    result = CliRunner().invoke(TOOLS["sf-eval"], ["run", str(tmp_path), "--tree", tree, "-o", str(tmp_path / "e")])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"tree {tree} has {nodes} nodes, more than the 4,096" in errors[0]


def test_sf_eval_decodes_sglangs_served_tree_as_the_target_does(gate_run, smollm2_target):
    """--num-steps/--topk/--num-draft-tokens (issue 58): sf-eval drafts the tree an SGLang server would
    (families/eagle3/engine_tree.py), the target verifies its N tokens, the output is the target's own
    greedy text, and the report names the shape. Half the knobs, with --tree, or sampling is one line
    (a family that drafts no such tree: test_block_decoding.py, beside the DFlash gate run)."""
    _, export = gate_run
    base = dict(draft=str(export), prompt_sets=("chat",), limit=1, max_new_tokens=12, device="cpu")
    report = run_eval(EvalConfig(**base, num_steps=3, topk=2, num_draft_tokens=6), target=smollm2_target)
    (entry,) = report["sets"].values()
    assert entry["trained"]["identical_to_target"] == "1/1"
    assert report["config"]["num_steps"] == 3 and report["config"]["k"] == 3  # k: the most a round accepts
    with pytest.raises(ValueError, match="give all three"):
        EvalConfig(draft="d", num_steps=3, topk=2)
    with pytest.raises(ValueError, match="two trees"):
        EvalConfig(draft="d", num_steps=3, topk=2, num_draft_tokens=6, tree=(2, 2))
    with pytest.raises(ValueError, match="--topk 1 drafts a chain"):
        EvalConfig(draft="d", num_steps=3, topk=1, num_draft_tokens=6)
    with pytest.raises(EvalError, match="verifies greedily"):
        run_eval(EvalConfig(**base, num_steps=3, topk=2, num_draft_tokens=6, temperature=0.7), target=smollm2_target)


def test_sf_eval_sweep_decodes_each_setting_names_the_best_and_its_flags(gate_run, smollm2_target, tmp_path,
                                                                          monkeypatch):
    """sf-eval sweep (issue 58): one sf-eval run per serving setting into OUTPUT/<setting>, the target
    alone once; sweep.json's rows per setting and set, the best, and the SGLang flags that serve it
    (vLLM's for a chain); a rerun skips the settings done; a setting of another family's form is one
    line (a block drafter's sweep: test_block_decoding.py, beside the DFlash gate run)."""
    from dataclasses import replace

    import specfoundry.eval.sweep as sweep_module
    from specfoundry.eval.sweep import SweepConfig, format_sweep, run_sweep

    _, export = gate_run
    base = dict(prompt_sets=("chat",), limit=1, max_new_tokens=8, device="cpu")
    cfg = SweepConfig(draft=str(export), output=str(tmp_path / "s"), settings=("3,1,4", "3,2,6"), **base)
    summary = run_sweep(cfg, silent=True, target=smollm2_target)
    assert [r["setting"] for r in summary["rows"]] == ["S3_K1_N4", "S3_K2_N6"]
    assert [r["verify_width"] for r in summary["rows"]] == [4, 6]
    assert set(summary["target_alone_tokens_per_s"]) == {"chat"}  # the first setting's run alone
    assert summary["best"] in ("S3_K1_N4", "S3_K2_N6")
    assert set(summary["wall_s"]) == {"S3_K1_N4", "S3_K2_N6"} and all(s > 0 for s in summary["wall_s"].values())
    assert f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {export} " in summary["serve"]["sglang"]
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["best"] == summary["best"]
    assert (tmp_path / "s" / "sweep.png").stat().st_size > 0
    assert "SGLang: --speculative-algorithm EAGLE3" in format_sweep(summary)
    assert summary["measured_earlier"] == []
    monkeypatch.setattr(sweep_module, "run_eval", lambda *a, **k: pytest.fail("a finished setting ran again"))
    assert run_sweep(cfg, silent=True, target=smollm2_target)["rows"] == summary["rows"]
    # a rerun that finishes an interrupted sweep says which settings' speeds come from the earlier run
    second = json.loads((tmp_path / "s" / "S3_K2_N6" / "eval.json").read_text())
    shutil.rmtree(tmp_path / "s" / "S3_K2_N6")
    monkeypatch.setattr(sweep_module, "run_eval", lambda *a, **k: second)
    resumed = run_sweep(cfg, silent=True, target=smollm2_target)
    assert resumed["measured_earlier"] == ["S3_K1_N4"]
    assert "note: S3_K1_N4 measured in an earlier run of this sweep (resumed)" in format_sweep(resumed)
    assert run_sweep(cfg, silent=True, target=smollm2_target)["measured_earlier"] == ["S3_K1_N4"]  # a rerun keeps it
    monkeypatch.undo()
    slower = {**summary, "best_mean_tokens_per_s": 5.0, "target_alone_tokens_per_s": {"chat": 9.0, "code": 11.0}}
    assert ("note: the best setting decodes slower than the target alone (5.0 against 10.0 tokens/s on average)"
            in format_sweep(slower))
    assert "slower than the target alone" not in format_sweep({**slower, "best_mean_tokens_per_s": 10.5})
    with pytest.raises(EvalError, match="an EAGLE-3 setting is S,K,N"):
        run_sweep(replace(cfg, settings=("7",)), silent=True, target=smollm2_target)


def test_a_recipes_eval_k_is_the_sweeps_to_vary_and_its_other_keys_still_apply(tmp_path):
    """sf-eval sweep reads the recipe's eval section, as sf-eval run does: its k (a chain for sf-eval
    run) is a setting the sweep varies, left out rather than refused; the section's other keys apply,
    and one the sweep does not take is still one line."""
    import yaml

    from specfoundry.common.cli import CommandError, read_recipe, resolve_config
    from specfoundry.eval.sweep import NOT_SWEPT, SweepConfig, recipe_refusal

    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: smollm2\neval:\n  k: 7\n  max_new_tokens: 96\n  compare_untrained: true\n")
    options = {"draft": "D", "output": str(tmp_path / "o")}
    cfg = resolve_config(SweepConfig, "eval", str(recipe), options, decided_here=NOT_SWEPT)
    assert (cfg.max_new_tokens, cfg.target) == (96, "smollm2")
    with pytest.raises(CommandError, match="unknown settings compare_untrained, k"):  # what the sweep said before
        resolve_config(SweepConfig, "eval", str(recipe), options)
    recipe.write_text("target: smollm2\neval:\n  k: 7\n  temperature: 0.5\n")
    with pytest.raises(CommandError, match="unknown settings temperature"):
        resolve_config(SweepConfig, "eval", str(recipe), options, decided_here=NOT_SWEPT)
    # every shipped recipe drives a sweep, but one spreading its target over several devices, refused by name
    root = Path(__file__).resolve().parents[1] / "recipes"
    for shipped in sorted(root.glob("*.yaml")):
        if "eval" not in yaml.safe_load(shipped.read_text()):  # (accelerate's config beside them, no recipe)
            continue
        values = read_recipe(str(shipped), "eval")
        why = recipe_refusal(values, str(shipped))
        if values.get("tp", 1) != 1:
            assert why is not None and f"eval: tp {values['tp']}: sf-eval sweep decodes on one device" in why
        else:
            assert why is None
            resolve_config(SweepConfig, "eval", str(shipped), options, decided_here=NOT_SWEPT)


def test_the_sweeps_flags_name_the_folder_an_engine_loads(gate_run):
    """A sweep given an sf-train run folder (as scripts/measure_gpu.sh gives it) prints flags naming the
    run's export/, the folder SGLang and vLLM load; a checkpoint, which no engine loads, a placeholder."""
    from specfoundry.eval.sweep import served_folder

    _, export = gate_run
    run = export.parent
    assert export.name == "export" and served_folder(locate_draft(run)) == str(export)
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert served_folder(locate_draft(checkpoint)) == f"EXPORT_OF_{checkpoint}"


@pytest.mark.parametrize("family, fields, sglang, vllm", [
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=8),
     "--speculative-algorithm EAGLE3 --speculative-draft-model-path D --speculative-num-steps 5 "
     "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8", None),
    ("eagle3", dict(num_steps=3, topk=1, num_draft_tokens=4), None,
     {"method": "eagle3", "model": "D", "num_speculative_tokens": 3}),
    ("dflash2", dict(k=15), "--speculative-algorithm DFLASH --speculative-draft-model-path D "
     "--speculative-num-draft-tokens 16", {"method": "dflash", "model": "D", "num_speculative_tokens": 15}),
    ("domino", dict(k=15), "--speculative-algorithm DFLASH --speculative-draft-model-path D "
     "--speculative-num-draft-tokens 16", None),
    ("dspark", dict(k=7), "--speculative-algorithm DSPARK --speculative-draft-model-path D "
     "--speculative-dspark-block-size 7", {"method": "dspark", "model": "D", "num_speculative_tokens": 7}),
    ("peagle", dict(k=7), None,
     {"method": "eagle3", "model": "D", "num_speculative_tokens": 7, "parallel_drafting": True}),
])
def test_the_serving_flags_are_the_engines_per_family(family, fields, sglang, vllm):
    """serving_flags as docs/serving.md writes them from SGLang's and vLLM's code: SGLang serves the
    DFlash backbone's families as DFLASH with the block, vLLM a DFlash2 draft as dflash and no Domino
    draft, P-EAGLE only in vLLM (eagle3 with parallel drafting), an EAGLE-3 tree in vLLM only as a chain."""
    from specfoundry.eval.sweep import serving_flags

    got = serving_flags(family, "D", fields)
    if sglang is not None:
        assert got["sglang"] == sglang
    if family == "peagle":
        assert got["sglang"] is None
    if vllm is None:
        assert fields.get("topk", 1) != 1 or family == "domino"
        assert got["vllm"] is None
    else:
        assert json.loads(got["vllm"].removeprefix("--speculative-config ")) == vllm


def test_an_explicit_k_equal_to_the_chain_default_counts_as_given(monkeypatch):
    """-k 4 is a setting like any other (a block drafter served at a block of 5), not the default:
    the family hears k_given whenever -k was passed, and the chain's 4 where it was not."""
    from types import SimpleNamespace

    import specfoundry.eval.evaluate as evaluate
    from specfoundry.eval.evaluate import CHAIN_K, EvalConfig, check_config

    heard = []

    def decode_settings(dcfg, *, k, tree, temperature, k_given, source):
        heard.append((k, k_given))
        return k, None, None

    provider = SimpleNamespace(decode_settings=decode_settings, compiles_draft=False, serves_engine_tree=False,
                               name="dflash")
    monkeypatch.setattr(evaluate, "locate_draft", lambda draft: SimpleNamespace(config=None, provider=provider))
    assert check_config(EvalConfig(draft="d", k=4))[0].k == 4
    assert check_config(EvalConfig(draft="d"))[0].k == CHAIN_K
    assert heard == [(4, True), (CHAIN_K, False)]
