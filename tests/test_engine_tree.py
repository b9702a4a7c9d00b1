"""The engines' draft tree (families/eagle3/engine_tree.py) against SGLang's algorithm: the worked
examples of its EAGLE worker (python/sglang/srt/speculative: draft_forward, select_top_k_tokens,
organize_draft_results, build_tree_kernel_efficient) on hand-made probability tables, and a plain
enumeration of every candidate node on random ones.

The tables are dyadic where they tie (0.5, 0.25, ...: products exact in float32), so a tie is a tie;
SGLang serves by CUDA's torch.topk, which takes the lowest index among tied values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfoundry.decoding.tree import EngineTree
from specfoundry.families.eagle3.engine_tree import tree_from_distributions

A, B, C, D, E, F, G, H, I_, J, K, L = range(1, 13)  # (I_: ruff reads a lone I as an l)
VOCAB = 16


def table(rows: dict) -> callable:
    """dist(path) for a table {path: {token: probability}}; the rest of each row's mass spread over
    the other tokens, each below the row's listed ones (so never among its top 2)."""

    def dist(path):
        listed = rows.get(path, {})
        rest = [t for t in range(VOCAB) if t not in listed]
        mass = 1.0 - sum(listed.values())
        p = torch.full((VOCAB,), mass / len(rest))
        for t, q in listed.items():
            p[t] = q
        assert all(mass / len(rest) < q for q in listed.values())
        return p

    return dist


EXAMPLE_1 = {(): {A: 0.6, B: 0.2}, (A,): {C: 0.7, D: 0.2}, (B,): {E: 0.9, F: 0.05},
             (A, C): {G: 0.8, H: 0.1}, (B, E): {I_: 0.5, J: 0.3}}
EXAMPLE_2 = {(): {A: 0.5, B: 0.125}, (A,): {C: 0.5, D: 0.25}, (B,): {E: 0.5, F: 0.25},
             (A, C): {G: 0.5, H: 0.25}, (A, D): {K: 0.5, L: 0.25}}
EXAMPLE_3 = {**EXAMPLE_2, (): {A: 0.5, B: 0.25}}


@pytest.mark.parametrize("rows, s, k, n, tokens, parents", [
    # Example 1: the pool A .6, B .2, AC .42, AD .12, BE .18, BF .01, ACG .336, ...: the 5 best in pool order
    (EXAMPLE_1, 3, 2, 6, [A, B, C, E, G], [0, 0, 1, 2, 3]),
    # the 3 best: B (.2) loses to the deeper ACG (.336): depths compete by cumulative score
    (EXAMPLE_1, 3, 2, 4, [A, C, G], [0, 1, 2]),
    # Example 2: B, AD and ACG tie at .125 for the last place: the lowest pool index (B) wins
    (EXAMPLE_2, 3, 2, 4, [A, B, C], [0, 0, 1]),
    (EXAMPLE_2, 3, 2, 5, [A, B, C, D], [0, 0, 1, 1]),
    # Example 3: AD and BE tie at .125 for the frontier: AD (lower index) is expanded, BE stays a leaf
    (EXAMPLE_3, 3, 2, 5, [A, B, C, D], [0, 0, 1, 1]),
    (EXAMPLE_3, 3, 2, 6, [A, B, C, D, E], [0, 0, 1, 1, 2]),
    # Example 4: K = 1 is the chain of S tokens (N = S + 1)
    (EXAMPLE_1, 3, 1, 4, [A, C, G], [0, 1, 2]),
    # Example 5: S = 1: the root's K best only
    (EXAMPLE_1, 1, 2, 3, [A, B], [0, 0]),
])
def test_sglangs_worked_examples(rows, s, k, n, tokens, parents):
    assert tree_from_distributions(table(rows), EngineTree(s, k, n)) == (tokens, parents)


def enumerated(dist, s: int, k: int, n: int) -> tuple[list[int], list[int]]:
    """SGLang's policy written as a plain enumeration: every scored node as (score, pool index, path,
    parent's pool index), the K best children of each expanded node, the K best of each step's
    nodes expanded, the N-1 best of all (score descending, pool index ascending) in pool order."""
    def top(pairs, m):
        return sorted(pairs, key=lambda x: (-x[0], x[1]))[:m]

    pool = []  # (score, path, parent pool index)
    frontier = []
    for score, t in top([(np.float32(p), t) for t, p in enumerate(dist(()).tolist())], k):
        pool.append((score, (t,), -1))
        frontier.append(len(pool) - 1)
    for _ in range(1, s):
        base = len(pool)
        for f in frontier:
            f_score, f_path, _ = pool[f]
            for score, t in top([(np.float32(p), t) for t, p in enumerate(dist(f_path).tolist())], k):
                pool.append((np.float32(f_score * score), f_path + (t,), f))
        frontier = [base + j for _, j in top([(pool[base + j][0], j) for j in range(k * k)], k)]
    chosen = sorted(j for _, j in top([(pool[j][0], j) for j in range(len(pool))], n - 1))
    node = {j: i + 1 for i, j in enumerate(chosen)}
    return [pool[j][1][-1] for j in chosen], [0 if pool[j][2] < 0 else node[pool[j][2]] for j in chosen]


@pytest.mark.parametrize("s, k, n", [(3, 2, 6), (4, 3, 9), (5, 4, 8), (2, 4, 20), (3, 1, 4), (6, 2, 12)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_tree_is_the_enumerations_on_random_tables(s, k, n, seed):
    """Random draft distributions (a fresh one per path, from the path's hash): the tensor functions'
    tree is the enumeration's, token for token and parent for parent, and every parent comes first."""
    def dist(path):
        g = torch.Generator().manual_seed(hash((seed, path)) % (2 ** 31))
        return torch.softmax(torch.randn(VOCAB, generator=g) * 3, dim=-1)

    tokens, parents = tree_from_distributions(dist, EngineTree(s, k, n))
    assert (tokens, parents) == enumerated(dist, s, k, n)
    assert all(p < i + 1 for i, p in enumerate(parents))  # a parent is the root or an earlier node
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    assert max(depth) <= s


@pytest.mark.parametrize("s, k, n, words", [
    (3, 1, 5, "--topk 1 drafts a chain of --num-steps tokens: --num-draft-tokens is 4"),
    (2, 2, 8, "--num-draft-tokens 8 verifies more drafted tokens than the 6 that 2 steps of top 2 draft"),
    (0, 2, 3, "at least 1"),
])
def test_settings_sglang_would_refuse_are_one_line(s, k, n, words):
    with pytest.raises(ValueError, match=words):
        EngineTree(s, k, n)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("s, k, n", [(3, 2, 6), (4, 3, 10), (3, 1, 4), (1, 4, 5)])
def test_the_drafts_device_step_drafts_the_tree_of_its_own_distributions(s, k, n, graphs, device):
    """The draft's expansion (engine_tree.py expand_body: K rows a forward, each seeing its ancestors)
    against tree_from_distributions fed the draft's own next-token probabilities after each path,
    each read by the eager chain step from the committed state (DraftRunner.run, as `propose` reads
    a sampled chain). graphs=True runs the step as a capture's CPU stand-in (host reads forbidden), and
    as a CUDA graph on a GPU."""
    from specfoundry.common.target import Target
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.families.eagle3.chain import DraftRunner
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    model, draft = model.to(device), draft.to(device)
    target = TargetRunner(Target.wrap(model), [0, 1, 2])
    runner = DraftRunner(draft, graphs=graphs)
    runner.reset(128)
    target.reset(128)
    logits, aux, _ = target.forward(list(range(1, 17)))
    runner.extend(list(range(2, 17)) + [int(logits[-1].argmax())], aux)

    def dist(path):
        logits, pre = runner.logits, runner.pre
        for j, d in enumerate(path):
            pre, out = runner.run([runner.target_ids[d]], pre, [runner.length + j])
            logits = out[-1]
        runner.forget_proposals()
        return torch.softmax(logits.float(), dim=-1)

    shape = EngineTree(s, k, n)
    want_ids, want_parents = tree_from_distributions(dist, shape)
    for _ in range(2):  # (graphs: the stand-in's first call, then its replay)
        tokens, parents = runner.engine_trees(shape)
        assert tokens.tolist() == [runner.target_ids[d] for d in want_ids] and parents.tolist() == want_parents
    assert len(runner) == 16  # the committed entries are as they were


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s, k, n", [(3, 2, 6), (5, 4, 8), (4, 1, 5), (2, 3, 12)])
def test_decoding_with_the_engines_tree_is_the_targets_greedy_decoding(s, k, n, device):
    """tree_generate with an EngineTree: the target verifies the N tokens SGLang would (the root and
    the N-1 selected), under the mask of their parents read that round; the output is the target's
    own greedy text, and no round accepts more than the tree's S depths."""
    from specfoundry.common.target import Target
    from specfoundry.decoding.rounds import target_generate
    from specfoundry.decoding.sampler import Sampler
    from specfoundry.decoding.target import TargetRunner
    from specfoundry.families.eagle3.chain import DraftRunner
    from specfoundry.families.eagle3.tree import tree_generate
    from tests.test_eval import tiny_pair

    model, draft = tiny_pair(vocab=64)
    model, draft = model.to(device), draft.to(device)
    target = TargetRunner(Target.wrap(model), [0, 1, 2])
    prompt = list(range(1, 12))
    own = target_generate(target, prompt, max_new_tokens=30, eos=set(), sampler=Sampler()).tokens
    out = tree_generate(target, DraftRunner(draft), prompt, branching=EngineTree(s, k, n), max_new_tokens=30,
                        eos=set())
    assert out.tokens == own
    assert max(out.accepted) <= s and len(out.accepted) >= 30 // (s + 1)
