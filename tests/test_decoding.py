"""The decoding core's target runner (decoding/target.py) over its static KV cache: every step
sees exactly the committed text and its own tokens, whatever a rejected draft left in the cache,
for full, sliding and mixed attention; a token tree's nodes see only their ancestors; and on a
GPU the graph-replayed steps equal the eager ones."""

from __future__ import annotations

import pytest
import torch

from specfoundry.common.target import Target
from specfoundry.decoding.rounds import target_generate
from specfoundry.decoding.sampler import Sampler
from specfoundry.decoding.target import TargetRunner
from specfoundry.decoding.tree import DraftTree, verify_mask
from specfoundry.testing import assert_close_scaled
from tests.test_slots import GRAPH_DEVICES, gqa_model

# fp32 on the CPU: the cached step and the full forward compute the same dot products in other
# groupings (T keys at a time against the whole row), so they differ by accumulated rounding of
# ~1e-7 per op over two layers of width 96; 1e-5 leaves two orders of magnitude of room and
# still fails on a wrong mask (a stale or missing key moves logits by ~1e-1).
TOL = dict(rtol=1e-5, atol=1e-5)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's own logits over `ids` without a cache: [len(ids), V]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


# fold_queries: every step folds the query heads onto the KV heads (None), or only a token step
# does (1) and a verify goes through transformers' sdpa path (repeat_kv): the same attention
FOLDS = [None, 1]


@pytest.mark.parametrize("fold_queries", FOLDS)
@pytest.mark.parametrize("layout", ["full", "sliding", "mixed"])
def test_a_step_after_a_rejected_draft_sees_the_committed_text_only(layout, fold_queries):
    """Prompt, then a chain of 4 drafts of which 1 is kept, then a new chain: its logits are the
    full forward's over the committed text, though the cache still holds the 3 rejected drafts'
    keys (the windowed layers see only their window: 8 positions)."""
    model = gqa_model(layout)
    runner = TargetRunner(Target.wrap(model), [0], graphs=False, fold_queries=fold_queries)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (11,), generator=g).tolist()
    runner.reset(64)
    first, _, _ = runner.forward(prompt)
    torch.testing.assert_close(first, full_logits(model, prompt), **TOL)
    drafts = torch.randint(0, 96, (5,), generator=g).tolist()  # the newest token and 4 drafts
    runner.forward(drafts)
    runner.crop(len(prompt) + 2)  # the newest token and one accepted draft
    committed = prompt + drafts[:2]
    chain = torch.randint(0, 96, (4,), generator=g).tolist()
    got, aux, _ = runner.forward(chain)
    torch.testing.assert_close(got, full_logits(model, committed + chain)[-4:], **TOL)
    assert aux.shape == (4, 96) and len(runner) == len(committed) + 4


@pytest.mark.parametrize("fold_queries", FOLDS)
def test_a_tree_verify_gives_each_node_its_branch(fold_queries):
    """Every node of a 2,2 tree under verify_mask: its logits are those of the full forward over
    the committed text and its own branch (its ancestors, then itself), at position root + depth."""
    model = gqa_model("full")
    runner = TargetRunner(Target.wrap(model), [1], graphs=False, fold_queries=fold_queries)
    prompt = list(range(3, 12))
    runner.reset(64)
    runner.forward(prompt[:-1])  # the newest token (the tree's root) is pending
    tree = DraftTree(tokens=[20, 21, 30, 31, 32, 33], parents=[-1, -1, 0, 0, 1, 1], depths=[1, 1, 2, 2, 2, 2])
    cached = len(runner)
    positions = [cached] + [cached + d for d in tree.depths]
    logits, _, _ = runner.forward([prompt[-1]] + tree.tokens, positions=positions,
                                  mask=verify_mask(tree, cached, 1))
    for n in range(len(tree)):
        branch, node = [], n
        while node >= 0:
            branch.insert(0, tree.tokens[node])
            node = tree.parents[node]
        torch.testing.assert_close(logits[1 + n], full_logits(model, prompt + branch)[-1], **TOL)


def test_a_step_refuses_a_mask_that_hides_committed_text():
    model = gqa_model("full")
    runner = TargetRunner(Target.wrap(model), [0], graphs=False)
    runner.reset(32)
    runner.forward([1, 2, 3])
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 1] = False
    with pytest.raises(AssertionError, match="sees every committed token"):
        runner.forward([4, 5], positions=[3, 4], mask=mask)


def test_the_cache_grows_keeping_what_it_holds():
    """A sequence longer than its reserve: the cache grows (one copy) and the steps still equal the
    full forward."""
    model = gqa_model("full")
    runner = TargetRunner(Target.wrap(model), [0], graphs=False)
    runner.reset(8)
    ids = [1 + i % 90 for i in range(299)]
    runner.forward(ids[:250])
    got, _, _ = runner.forward(ids[250:])
    assert runner.cache.capacity >= 299
    torch.testing.assert_close(got, full_logits(model, ids)[250:], **TOL)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replayed_steps_equal_eager_ones(dtype, device):
    """The same chain of steps (prefill, one token, a verify of 5 with a crop, a tree) through the
    eager body and through captured graphs: equal logits and aux features (the replay runs the
    kernels the capture recorded, on the same inputs), and the target alone decodes the same tokens.
    The prompt is 32 tokens, a prefill bucket: no pad rows, the same matrix shapes as the eager
    prefill (a padded one is test_a_padded_prefill_hides_its_pad)."""
    model = gqa_model("mixed").to(device, dtype)
    target = Target.wrap(model)
    eager, graphed = TargetRunner(target, [0], graphs=False), TargetRunner(target, [0], graphs=True)
    tree = DraftTree(tokens=[20, 21, 30, 31], parents=[-1, -1, 0, 1], depths=[1, 1, 2, 2])
    outs = {}
    for name, runner in (("eager", eager), ("graphed", graphed)):
        runner.reset(128)

        def kept(step):  # a replayed step's outputs are its graph's buffers, refilled by its next replay
            logits, aux, _ = step
            return logits.clone(), aux.clone()

        got = [kept(runner.forward(list(range(3, 35))))]
        for _ in range(3):  # a step is captured at its first call (after a warm-up), replayed from the second
            got.append(kept(runner.forward([7])))
            got.append(kept(runner.forward([1, 2, 3, 4, 5])))
            runner.crop(len(runner) - 3)
            cached = len(runner)
            got.append(kept(runner.forward([9] + tree.tokens, positions=[cached] + [cached + d for d in tree.depths],
                                           mask=verify_mask(tree, cached, 1))))
            runner.crop(cached + 1)
        outs[name] = got
    assert graphed.steps and graphed.prefills and not eager.steps
    for (a_logits, a_aux), (b_logits, b_aux) in zip(outs["eager"], outs["graphed"], strict=True):
        torch.testing.assert_close(b_logits, a_logits, rtol=0, atol=0)
        torch.testing.assert_close(b_aux, a_aux, rtol=0, atol=0)
    runs = [target_generate(r, list(range(3, 35)), max_new_tokens=24, eos=set(), sampler=Sampler())
            for r in (eager, graphed)]
    assert runs[0].tokens == runs[1].tokens


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("prompt_len", [1, 5, 16, 37, 100])
def test_a_padded_prefill_hides_its_pad(prompt_len, device):
    """A captured prefill pads the prompt to its bucket (decoding/steps.py prompt_bucket): the
    prompt's rows and every later step equal the eager runner's within rounding, so no pad row is
    seen by the prompt (the causal pattern) or by a later step (its columns lie past the committed
    length). Not bit-equal: the padded matrix products have more rows, and a GEMM may block and
    round a row differently by the row count. fp32: each dot product of n <= 128 terms moves by at
    most ~n * 2^-24 relative, over 2 layers and the lm_head well under TOL's 1e-5, while a pad key
    seen by a real row moves its logits by ~1e-1."""
    from specfoundry.decoding.steps import prompt_bucket

    model = gqa_model("mixed").to(device)
    target = Target.wrap(model)
    eager, graphed = TargetRunner(target, [0, 1], graphs=False), TargetRunner(target, [0, 1], graphs=True)
    prompt = [3 + (7 * i) % 90 for i in range(prompt_len)]
    outs = {}
    for name, runner in (("eager", eager), ("graphed", graphed)):
        runner.reset(prompt_len + 64)
        logits, aux, _ = runner.forward(prompt)
        got = [(logits.clone(), aux.clone())]
        for token in (7, 8):
            logits, aux, _ = runner.forward([token])
            got.append((logits.clone(), aux.clone()))
        logits, aux, _ = runner.forward([1, 2, 3, 4])
        got.append((logits.clone(), aux.clone()))
        outs[name] = got
    assert list(graphed.prefills) == [prompt_bucket(prompt_len)] and not eager.prefills
    assert outs["graphed"][0][0].shape[0] == prompt_len  # the pad rows' logits are dropped
    for (a_logits, a_aux), (b_logits, b_aux) in zip(outs["eager"], outs["graphed"], strict=True):
        torch.testing.assert_close(b_logits, a_logits, **TOL)
        torch.testing.assert_close(b_aux, a_aux, **TOL)


def test_prefill_buckets_and_the_eager_prefill_past_them(monkeypatch):
    """Buckets are powers of two from PROMPT_MIN_BUCKET; a prompt longer than PROMPT_GRAPH_MAX, a
    prefill that wants the final states, or one after committed text is not a padded prefill."""
    import specfoundry.decoding.target as target_module
    from specfoundry.decoding.steps import PROMPT_MIN_BUCKET, prompt_bucket

    assert [prompt_bucket(n) for n in (1, PROMPT_MIN_BUCKET, PROMPT_MIN_BUCKET + 1, 100, 128, 129)] == \
        [PROMPT_MIN_BUCKET, PROMPT_MIN_BUCKET, 2 * PROMPT_MIN_BUCKET, 128, 128, 256]
    monkeypatch.setattr(target_module, "PROMPT_GRAPH_MAX", 32)
    runner = TargetRunner(Target.wrap(gqa_model("full")), [0], graphs=True)
    runner.reset(128)
    runner.forward(list(range(3, 36)))  # 33 tokens: eager
    runner.reset(128)
    runner.forward(list(range(3, 20)), want_hidden=True)  # the final states: eager
    assert not runner.prefills
    runner.reset(128)
    runner.forward(list(range(3, 20)))
    assert list(runner.prefills) == [32]


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_graph_replayed_greedy_chain_equals_the_eager_one(device):
    """EAGLE-3's greedy chain of k proposals as one captured graph and as eager steps over the same
    committed state: the same proposals and logits, round after round, and the same decode. The
    prompt holds 16 tokens, a bucket's size: the captured read of it is unpadded, so the two starts
    are the same products (a padded one has more rows, which a GEMM may round differently)."""
    from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    model, draft = model.to(device), draft.to(device)
    target = TargetRunner(Target.wrap(model), [0, 1, 2], graphs=True)
    runs = {}
    for graphs in (False, True):
        runner = DraftRunner(draft, graphs=graphs)
        runner.reset(64)
        target.reset(64)
        logits, aux, _ = target.forward(list(range(1, 17)))
        runner.extend(list(range(2, 17)) + [int(logits[-1].argmax())], aux)
        got = []
        for _ in range(3):  # captured at the first, replayed after
            tokens, rows = runner.propose(4, None, greedy=True)
            got.append((tokens.tolist(), rows.clone()))
        runs[graphs] = got
        out = speculative_generate(target, runner, list(range(1, 12)), k=4, max_new_tokens=20, eos=set(),
                                   sampler=Sampler())
        runs[graphs].append(out.tokens)
    assert runs[True][-1] == runs[False][-1]
    for (a_tokens, a_rows), (b_tokens, b_rows) in zip(runs[False][:-1], runs[True][:-1], strict=True):
        assert a_tokens == b_tokens
        torch.testing.assert_close(b_rows, a_rows, rtol=0, atol=0)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_compiled_greedy_chain_equals_the_eager_one(device):
    """DraftRunner(compiled=True): the captured chain's body through torch.compile proposes the
    eager chain's tokens, round after round, with its logits within fp32 reordering, and the chain
    decode equals the eager one; and which families offer --compile-draft. On a GPU inductor fuses the norms'
    and the MLP's chains: each sum of n <= 128 terms moves by ~n * 2^-24 of its largest terms, over
    one layer and the lm_head far under 1e-5 of each row's largest logit (this draft's heads are
    scaled, its rows reach ~50, so the reordering error of a row is ~50 * that size on every logit
    of the row, the near-zero ones too: the bound is relative to the row, not to each logit).
    Another token or cache column moves the logits by O(1) of the row."""
    from specfoundry.families import FAMILIES
    from specfoundry.families.eagle3.chain import DraftRunner, speculative_generate
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    model, draft = model.to(device), draft.to(device)
    target = TargetRunner(Target.wrap(model), [0, 1, 2], graphs=True)
    runs = {}
    for compiled in (False, True):
        runner = DraftRunner(draft, graphs=True, compiled=compiled)
        runner.reset(64)
        target.reset(64)
        logits, aux, _ = target.forward(list(range(1, 17)))
        runner.extend(list(range(2, 17)) + [int(logits[-1].argmax())], aux)
        got = []
        for token in (7, 9):  # captured at the first, replayed after a commit
            tokens, rows = runner.propose(4, None, greedy=True)
            got.append((tokens.tolist(), rows.clone()))
            runner.extend([token], aux[-1:])
        out = speculative_generate(target, runner, list(range(1, 12)), k=4, max_new_tokens=20, eos=set(),
                                   sampler=Sampler())
        runs[compiled] = (got, out.tokens)
        assert runner.chains.compiled == compiled
    assert runs[True][1] == runs[False][1]
    for (a_tokens, a_rows), (b_tokens, b_rows) in zip(runs[False][0], runs[True][0], strict=True):
        assert a_tokens == b_tokens
        assert_close_scaled(b_rows, a_rows, 1e-5, rows=True)
    assert [name for name in FAMILIES.names() if FAMILIES.provider(name).compiles_draft] == \
        ["eagle3", "dflash", "domino", "dspark", "dflash2"]
    with pytest.raises(ValueError, match="--compile-draft: peagle drafts decode uncompiled"):
        FAMILIES.provider("peagle").decoder(None, None, k=7, tree=None, compiled=True)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("family", ["dflash", "dspark", "domino", "dflash2"])
def test_a_compiled_block_proposal_equals_the_eager_one(family, device):
    """BlockDraftRunner(compiled=True) (DFlash, DSpark's sequential Markov head, Domino's GRU
    correction, one GRU step a proposal, DFlash2's convolutions and its selector's walk): the
    captured block forward through torch.compile proposes the eager runner's tokens round after
    round, its logits (DFlash2: the walk's realised scores) within fp32 reordering (the tolerance of
    the chain's test above, for the same reason)."""
    from specfoundry.families.dflash.block import BlockDraftRunner
    from specfoundry.families.dflash2.decode import DFlash2Runner
    from specfoundry.families.domino.decode import DominoRunner
    from specfoundry.families.dspark.decode import DSparkRunner

    if family == "dflash":
        from tests.test_dflash import random_draft

        draft, runner_class = random_draft(), BlockDraftRunner
    elif family == "dspark":
        from tests.test_dspark import tiny_draft

        draft, runner_class = tiny_draft(), DSparkRunner
    elif family == "dflash2":
        from tests.test_dflash2 import tiny_draft

        draft, runner_class = tiny_draft(), DFlash2Runner
    else:
        from tests.test_domino import tiny_draft

        draft, runner_class = tiny_draft(), DominoRunner
    cfg = draft.cfg
    draft = draft.to(device).eval()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    width = len(cfg.target_layer_ids) * cfg.target_hidden_size  # aux rows [T, K*Ht]
    aux = torch.randn(40, width, generator=torch.Generator().manual_seed(2)).to(device)
    got = {}
    for compiled in (False, True):
        runner = runner_class(draft, head, graphs=True, compiled=compiled)
        runner.reset(64)
        runner.extend(aux[:11])
        rounds = []
        for r in range(3):
            drafts, logits = runner.propose(7 + r)
            logits = logits[2] if isinstance(logits, tuple) else logits  # DFlash2: (candidates, q, scores)
            rounds.append((drafts.tolist(), logits.clone()))
            runner.extend(aux[11 + 2 * r: 13 + 2 * r])
        got[compiled] = rounds
        assert runner.proposals.compiled == compiled
    for (a_drafts, a_logits), (b_drafts, b_logits) in zip(got[False], got[True], strict=True):
        assert a_drafts == b_drafts
        assert_close_scaled(b_logits, a_logits, 1e-5, rows=True)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_graph_replayed_commit_equals_the_eager_one(device):
    """EAGLE-3's commit (DraftRunner.extend after the prompt) as captured steps, one per token count,
    and eagerly: the same logits and the same next-step state, committed length and proposals after
    each, over commits of 1-3 tokens (each count captured at its first use, replayed after on a
    longer text) with a rejected proposal between them. Exact: the same kernels on the same inputs."""
    from specfoundry.families.eagle3.chain import DraftRunner
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    draft = draft.to(device)
    width = 3 * model.config.hidden_size  # aux rows [T, K*H] of three layers
    g = torch.Generator().manual_seed(3)
    commits = [(torch.randint(1, 64, (n,), generator=g).tolist(), torch.randn(n, width, generator=g))
               for n in (1, 3, 2, 1, 3, 2)]
    runs = {}
    for graphs in (False, True):
        runner = DraftRunner(draft, graphs=graphs)
        runner.reset(64)
        # 16 tokens, a bucket's size: the captured read of the prompt is unpadded, the same products
        runner.extend(list(range(2, 18)), torch.randn(16, width, generator=torch.Generator().manual_seed(4)).to(device))
        got = []
        for tokens, aux in commits:
            runner.propose(3, None, greedy=True)  # written past the committed text, then forgotten
            logits = runner.extend(tokens, aux.to(device)).clone()
            proposals, _ = runner.propose(3, None, greedy=True)
            got.append((logits, runner.pre.clone(), runner.logits.clone(), int(runner.base), len(runner),
                        proposals.tolist()))
        runs[graphs] = got
        assert bool(runner.extends.captured) == graphs
    for eager, graphed in zip(runs[False], runs[True], strict=True):
        for a, b in zip(eager, graphed, strict=True):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
            else:
                assert a == b


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_graph_replayed_tree_expansion_equals_the_eager_one(device):
    """EAGLE-3's tree expansion for one branching as one captured graph and as eager code over the
    same committed state: the same trees, round after round (the replay reads the new state), and
    the same tree decode, equal to the target's own greedy tokens."""
    from specfoundry.families.eagle3.chain import DraftRunner
    from specfoundry.families.eagle3.tree import TreeShape, expand_tree, tree_generate
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    model, draft = model.to(device), draft.to(device)
    target = TargetRunner(Target.wrap(model), [0, 1, 2], graphs=True)
    shape, prompt = TreeShape.of((3, 2, 2, 1)), list(range(1, 12))
    runs = {}
    for graphs in (False, True):
        runner = DraftRunner(draft, graphs=graphs)
        runner.reset(64)
        target.reset(64)
        logits, aux, _ = target.forward(prompt)
        runner.extend(prompt[1:] + [int(logits[-1].argmax())], aux)
        trees = []
        for _ in range(3):  # captured at the first, replayed after on a longer committed text
            trees.append(expand_tree(runner, shape).tolist())
            logits, aux, _ = target.forward([trees[-1][0]])
            runner.extend([int(logits[-1].argmax())], aux)
        out = tree_generate(target, runner, prompt, branching=shape.branching, max_new_tokens=20, eos=set())
        runs[graphs] = (trees, out.tokens)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_the_tree_decoders_warm_up_meets_every_verify_width(device):
    """A tree decoder's step_keys, warmed as sf-eval's warm-up does, capture the target's verify at
    every width a round may use (p pending tokens and the nodes, p = 1..depth + 1), so that later
    tree decodes capture (or compile) nothing; and it leaves no trace: their tokens are the
    target's own greedy tokens."""
    from specfoundry.decoding.steps import warm_steps
    from specfoundry.families.eagle3.chain import DraftRunner
    from specfoundry.families.eagle3.decode import Eagle3Decoder
    from specfoundry.families.eagle3.tree import TreeShape, tree_generate, verify_widths
    from tests.test_eval import tiny_pair, true_greedy

    model, draft = tiny_pair()
    prompts = ([1, 2, 3], [4, 0, 5, 2, 2], [3])
    expected = [true_greedy(model, prompt, 30) for prompt in prompts]  # (on the CPU, before the move)
    target = TargetRunner(Target.wrap(model.to(device)), [0, 1, 2], graphs=True)
    runner = DraftRunner(draft.to(device), graphs=True)
    branching = (3, 2, 1)
    widths = verify_widths(TreeShape.of(branching, vocab=5))
    assert widths == [p + 3 + 6 + 6 for p in (1, 2, 3, 4)]  # pending, then the nodes of depths 1-3
    decoder = Eagle3Decoder(runner, k=3, tree=branching)
    decoder.reserve(40)
    target.reset(40 + len(branching) + 1 + len(TreeShape.of(branching, vocab=5)))
    warm_steps(decoder.step_keys(target, [len(p) for p in prompts]))
    assert set(widths) <= set(target.steps)
    met = set(target.steps)
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert tree_generate(target, runner, prompt, branching=branching, max_new_tokens=30, eos=set()).tokens == tokens
    assert set(target.steps) == met


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_graph_replayed_block_proposal_equals_the_eager_one(device):
    """DFlash's block proposal and its context appends (one per count of accepted positions) captured
    as CUDA graphs and run eagerly, over the same context, round after round: the same proposals,
    logits and committed lengths."""
    from specfoundry.families.dflash.block import BlockDraftRunner
    from tests.test_dflash import TINY, random_draft

    draft = random_draft().to(device).eval()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size, device=device)
    aux = torch.randn(40, 72, device=device)
    got = {}
    for graphs in (False, True):
        runner = BlockDraftRunner(draft, head, graphs=graphs)
        runner.reset(64)
        runner.extend(aux[:16])  # a bucket's size: the captured read is unpadded, the same products
        rounds, at = [], 16
        for r, taken in enumerate((2, 1, 3, 2, 1)):  # accepted positions a round: a captured append each count
            drafts, logits = runner.propose(7 + r)
            rounds.append((drafts.tolist(), logits.clone(), len(runner), int(runner.cache.start)))
            runner.extend(aux[at: at + taken])
            at += taken
        got[graphs] = rounds
    assert list(runner.proposals) == [None] and sorted(runner.appends) == [1, 2, 3, 16]  # 16: the prompt's
    for (a_drafts, a_logits, *a_lengths), (b_drafts, b_logits, *b_lengths) in zip(got[False], got[True], strict=True):
        assert a_drafts == b_drafts and a_lengths == b_lengths
        torch.testing.assert_close(b_logits, a_logits, rtol=0, atol=0)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_a_graph_replayed_peagle_round_equals_the_eager_one(device):
    """P-EAGLE's round forward (n pending rows, k proposals) captured per (n, k) and run eagerly: the
    same logits and greedy proposals, rounds of different n interleaved."""
    from specfoundry.families.peagle.config import PEagleConfig
    from specfoundry.families.peagle.decode import PEagleRunner
    from specfoundry.families.peagle.model import PEagleDraft
    from tests.test_families import TINY

    torch.manual_seed(0)
    draft = PEagleDraft(PEagleConfig(**TINY, num_hidden_layers=2, num_depths=4, mask_token_id=3)).to(device).eval()
    aux = torch.randn(40, draft.cfg.num_aux * draft.cfg.target_hidden_size, device=device)
    got = {}
    for graphs in (False, True):
        runner = PEagleRunner(draft, graphs=graphs)
        runner.reset(64)
        runner.read(list(range(5, 16)), aux[:11])
        rows, at = [[t.clone() for t in runner.round(4)]], 11
        for n in (1, 3, 2, 3, 1):
            runner.read(list(range(20, 20 + n)), aux[at: at + n])
            at += n
            rows.append([t.clone() for t in runner.round(4)])
        got[graphs] = rows
    assert len(runner.rounds)
    for (a_logits, a_drafts), (b_logits, b_drafts) in zip(got[False], got[True], strict=True):
        torch.testing.assert_close(b_logits, a_logits, rtol=0, atol=0)
        assert torch.equal(b_drafts, a_drafts) and torch.equal(a_drafts, runner.draft_to_target[a_logits.argmax(-1)])


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("graphs", [False, True])  # True on a CPU: graphs.CapturedCall's checked stand-in
def test_greedy_readback_equals_reading_every_token(graphs, device):
    """target_generate's greedy decode, which feeds each step the previous argmax on the device and
    reads the picks back in chunks of GREEDY_READBACK, a chunk late, gives exactly the tokens of a
    loop that reads every pick before the next step: for caps that do and do not divide by the
    chunk, and for an eos at the first pick, at a chunk's end, at the next one's start and later
    (the decode stops there; the steps run after it are dropped). Exact: the same steps on the same
    inputs. It never runs a step past the cap, and after an eos at most 2 * GREEDY_READBACK - 1
    (the steps counted in `dropped_steps`)."""
    from specfoundry.decoding.rounds import GREEDY_READBACK

    model = gqa_model("full").to(device)
    runner = TargetRunner(Target.wrap(model), [0, 1], graphs=graphs)
    prompt = list(range(3, 30))

    def every_token(max_new: int, eos: set[int]) -> list[int]:
        runner.reset(len(prompt) + max_new)
        tokens = [int(runner.forward(prompt)[0][-1].argmax())]
        while len(tokens) < max_new and tokens[-1] not in eos:
            tokens.append(int(runner.forward([tokens[-1]])[0][-1].argmax()))
        return tokens

    free = every_token(24, set())
    assert len(set(free)) > 3, "a decode of distinct tokens, so the eos cases below differ"
    cases = [(24, set()), (23, set()), (GREEDY_READBACK + 1, set()), (1, set()),
             (24, {free[0]}), (24, {free[5]}), (24, {free[GREEDY_READBACK - 1]}), (24, {free[GREEDY_READBACK]})]
    for max_new, eos in cases:
        want = every_token(max_new, eos)
        result = target_generate(runner, prompt, max_new_tokens=max_new, eos=eos, sampler=Sampler())
        got, steps = result.tokens, len(runner) - len(prompt)  # the prefill gave the first token
        assert got == want, (max_new, eos)
        assert steps <= max_new - 1, (max_new, eos, steps)  # never a step past the cap
        if eos:
            assert got[-1] in eos and not set(got[:-1]) & eos
            assert result.dropped_steps <= 2 * GREEDY_READBACK - 1, (max_new, eos, result.dropped_steps)
        else:
            assert result.dropped_steps == 0 and len(got) == max_new


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_compiled_steps_equal_eager_ones(device):
    """TargetRunner(compiled=True): the captured steps (one token, a verify of 5 with a crop, a tree)
    through torch.compile give the eager body's logits and aux features, and the target alone
    decodes the same tokens. Not bit-equal on a GPU: inductor fuses the norms, the rotary embedding and the
    gated MLP, reordering their fp32 sums. Each such sum of n terms moves by at most ~n * 2^-24
    relative to its largest terms (n <= 128 here: H = 96, I = 128, 6 heads of 16); over 2 layers and
    the lm_head that is below 1e-5 of each row's largest value, the bound (relative to the row: a
    reordering moves every entry by the size of the row's terms, a near-zero one too) that could
    fail only if a step read other inputs or wrote the cache at other columns, which would move the
    logits by O(1)."""
    model = gqa_model("mixed").to(device)
    target = Target.wrap(model)
    eager, compiled = TargetRunner(target, [0], graphs=False), TargetRunner(target, [0], graphs=True, compiled=True)
    tree = DraftTree(tokens=[20, 21, 30, 31], parents=[-1, -1, 0, 1], depths=[1, 1, 2, 2])
    outs = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        runner.reset(128)
        got = [tuple(t.clone() for t in runner.forward(list(range(3, 40)))[:2])]
        for _ in range(2):
            got.append(tuple(t.clone() for t in runner.forward([7])[:2]))
            got.append(tuple(t.clone() for t in runner.forward([1, 2, 3, 4, 5])[:2]))
            runner.crop(len(runner) - 3)
            cached = len(runner)
            step = runner.forward([9] + tree.tokens, positions=[cached] + [cached + d for d in tree.depths],
                                  mask=verify_mask(tree, cached, 1))
            got.append(tuple(t.clone() for t in step[:2]))
            runner.crop(cached + 1)
        outs[name] = got
    assert compiled.steps.compiled and compiled.steps.captured
    for (a_logits, a_aux), (b_logits, b_aux) in zip(outs["eager"], outs["compiled"], strict=True):
        assert_close_scaled(b_logits, a_logits, 1e-5, rows=True)
        assert_close_scaled(b_aux, a_aux, 1e-5, rows=True)
    runs = [target_generate(r, list(range(3, 30)), max_new_tokens=24, eos=set(), sampler=Sampler())
            for r in (eager, compiled)]
    assert runs[0].tokens == runs[1].tokens


def test_a_compiled_runner_takes_more_step_shapes_than_dynamos_default():
    """A tree verify's width varies with the pending tokens (one shape per depth), and every
    compiled runner of a process shares dynamo's recompile count: more than its default of 8
    shapes must still compile (decoding/target.py COMPILED_SHAPES), not fail the decode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         attn_implementation="sdpa")).eval()
    runner = TargetRunner(Target.wrap(model), [0], graphs=True, compiled=True)
    runner.reset(128)
    runner.forward(list(range(3, 20)))
    for width in range(1, 11):  # 10 shapes
        runner.forward(list(range(5, 5 + width)))
        runner.crop(17)
    assert len(runner.steps) == 10


def test_a_dynamic_compiled_runner_compiles_twice_for_every_width_with_the_eager_logits():
    """sf-eval sweep's target (TargetRunner dynamic=True): one compile for a single token and one for
    all wider steps together, however many widths its settings verify at (a compile per width took 2 to 4
    minutes a setting on an H100 host), each giving the eager runner's logits."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         attn_implementation="sdpa")).eval()
    before = counters["stats"]["unique_graphs"]
    runner = TargetRunner(Target.wrap(model), [0], graphs=True, compiled=True, dynamic=True)
    eager = TargetRunner(Target.wrap(model), [0], graphs=False)
    logits = {runner: [], eager: []}
    for r in (runner, eager):
        r.reset(128)
        r.forward(list(range(3, 20)))
        for width in (1, 2, 5, 9, 3, 16):  # each after the same 17 committed tokens
            logits[r].append(r.forward(list(range(5, 5 + width)))[0].clone())
            r.crop(17)
    assert len(runner.steps) == 6 and counters["stats"]["unique_graphs"] - before == 2
    for got, want in zip(logits[runner], logits[eager], strict=True):
        # float32 both ways; inductor (on a GPU) reorders sums of at most 32 terms: a few ulps of the largest logit
        assert_close_scaled(got, want, 1e-5, rows=True)


@pytest.mark.parametrize("branching", [(1,), (4, 2, 2, 1), (8, 4, 2, 1, 1, 1, 1), (3, 1, 5)])
def test_tree_nodes_counts_the_trees_the_decoder_builds(branching):
    """sf-eval reserves a tree verify's width from tree_nodes: it must count the nodes the EAGLE-3
    tree decoder lays out for that branching."""
    from specfoundry.decoding.tree import tree_nodes
    from specfoundry.families.eagle3.tree import TreeShape

    assert tree_nodes(branching) == len(TreeShape.of(branching))
