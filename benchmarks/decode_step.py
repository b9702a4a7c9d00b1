"""The target's decode steps on one GPU: transformers' plain loop, a CUDA-graph reference and the
decoding core (decoding/target.py), side by side in one process.

    python -m benchmarks.decode_step [--shapes smollm2,8b] [--prompt 256] [--iters 40] [--profile]

Shapes (bf16, random weights: a step's time depends on the shapes alone): `smollm2`, SmolLM2-135M's
config (30 layers, width 576, 9 query / 3 KV heads, vocab 49152); `8b`, Llama-3.1-8B's (32 layers,
width 4096, 32 / 8 heads, vocab 128256). After a prompt of --prompt tokens, each row times one
step and the crop that undoes it (so every iteration starts from the same length):
    token         one token
    verify_kK     a chain verify of K+1 tokens (K = 3, 7, 15)
    tree          a tree verify: the pending token and the 8,4,2,1,1,1,1 tree (360 nodes)
    draft_F       family F's draft step, a random draft of the target's shape after the prompt's context:
                  EAGLE-3's greedy chain of 7, a DFlash / Domino / DSpark / DFlash2 block of 16 (DFlash2's
                  with its selector's walk over the top 16 of each slot), P-EAGLE's round
                  of 7 depths after one committed row; draft_eagle3_tree: EAGLE-3's expansion of the
                  8,4,2,1,1,1,1 tree (360 nodes: 6 draft forwards read the 296 above the deepest);
                  draft_eagle3_commit / draft_dflash_commit: a round's commit of COMMIT_TOKENS accepted
                  tokens (EAGLE-3's extend, DFlash's context append), the host's length set back after
                  each (the body sets the device's own counter from its inputs, so no device op
                  is timed that a round does not run)
Columns:
    plain         transformers as a user writes it: model(input_ids, past_key_values=DynamicCache),
                  then cache.crop (no tree: a plain loop has no tree mask)
    graph         the reference written here: one torch.cuda.graph around the model's forward over a
                  static cache (index_copy_ at fixed columns), static ids / positions / a precomputed
                  4D mask, transformers' own sdpa attention; one replay
    core          TargetRunner with graphs (what sf-eval and the gate run): inputs copied in, mask
                  built in the graph, aux layers tapped, fp32 logits
    core_fold1    core with the fold for one query a row (decoding/target.py FOLD_QUERIES=1): a verify
                  or tree step attends through transformers' sdpa path (repeat_kv), as the reference does
    core_eager    the same body without graphs (the CPU path)
    core_compiled core with its body through torch.compile (TargetRunner `compiled`), on the rows of
                  --compiled-rows (one compile per row's token count, ~1 min each for the 8B shape)
    core_b2b, graph_b2b  core and graph per call with 10 calls enqueued back to back (the other
                  columns synchronise after each call, so they also hold the part of the host's
                  launch the device waits for; these hold the device's time alone), target rows only
    core_host, graph_host  the host's time in one call (until it returns), in the synchronised timing
The `prefill` row reads a PREFILL_TOKENS prompt into an empty cache (core: the captured prefill,
padded to its bucket; graph: the reference captured at the prompt's own length; plain: a new
DynamicCache). The `alone` row is the target alone as sf-eval times it (decoding/rounds.py target_generate: a
--prompt-token prompt, then ALONE_TOKENS greedy tokens, no eos), wall ms per generated token with
the prefill included, core and core_compiled (summary.alone_tokens_per_s).
For a draft row, `plain` is the family's step eager (its runner without graphs), `graph` the same body
under one bare torch.cuda.graph written here, `core` the runner's own captured step.
--device cpu --shapes tiny checks the script on a CPU (no graph columns).
CUDA events around each (after warm-up, the columns interleaved in every iteration), median ms.
--profile adds torch.profiler tables of 10 steps each: the token step (core, plain) and the verify of 8
tokens (core, core_fold1, graph). JSON: results/decode_step.json (`summary.ms`: shape -> row ->
{plain, graph, core, core_fold1, core_eager, core_compiled}; `summary.ms_back_to_back`: shape -> row ->
{core_b2b, graph_b2b, core_host, graph_host}).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from benchmarks.common import (
    cuda_time_ms_back_to_back,
    cuda_time_ms_interleaved,
    print_profile_summary,
    print_table,
    profile_summary,
    write_result,
)
from specfoundry.common.target import Target
from specfoundry.decoding.target import TargetRunner
from specfoundry.decoding.tree import DraftTree, verify_mask

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, max_position_embeddings=8192),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096),
}
TREE = (8, 4, 2, 1, 1, 1, 1)
AUX = {"smollm2": [1, 14, 26], "8b": [1, 15, 28], "tiny": [1, 3, 4]}
DFLASH_LAYERS = {"smollm2": [1, 8, 14, 20, 27], "8b": [1, 8, 15, 22, 29], "tiny": [1, 2, 3, 4, 5]}
CHAIN, BLOCK = 7, 16
COLUMNS = ("plain", "graph", "core", "core_fold1", "core_eager", "core_compiled")
B2B_COLUMNS = ("core_b2b", "graph_b2b", "core_host", "graph_host")
ALONE_TOKENS = 96  # sf-eval's default --max-new-tokens
PREFILL_TOKENS = 100  # the `prefill` row's prompt: a short chat turn, padded to a bucket of 128
COMMIT_TOKENS = 2  # the commit rows: a round that accepted one proposal (and the target's own token)
PROFILED_VERIFY = 8  # tokens of the verify step --profile records (verify_k7)


def tree_of(branching: tuple[int, ...], vocab: int) -> DraftTree:
    """A tree of that branching, breadth first, random tokens."""
    g = torch.Generator().manual_seed(0)
    tree, frontier = DraftTree([], [], []), [-1]
    for depth, width in enumerate(branching, start=1):
        new = []
        for parent in frontier:
            for _ in range(width):
                new.append(len(tree))
                tree.tokens.append(int(torch.randint(vocab, (1,), generator=g)))
                tree.parents.append(parent)
                tree.depths.append(depth)
        frontier = new
    return tree


class RefCache:
    """The reference's static cache: keys / values [1, kv, C, hd] per layer, written at `columns`."""

    def __init__(self, capacity: int):
        self.capacity, self.keys, self.values, self.columns = capacity, {}, {}, None

    def update(self, key, value, layer_idx, *args, **kwargs):
        if layer_idx not in self.keys:
            self.keys[layer_idx] = key.new_zeros(key.shape[:2] + (self.capacity, key.shape[3]))
            self.values[layer_idx] = value.new_zeros(value.shape[:2] + (self.capacity, value.shape[3]))
        self.keys[layer_idx].index_copy_(2, self.columns, key)
        self.values[layer_idx].index_copy_(2, self.columns, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def cache_arg(model) -> str:
    """The forward's name for the cache: `cache` in newer transformers (which warn on the old name)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def reference_step(model, cache: RefCache, start: int, ids: list[int], positions: list[int], pattern: torch.Tensor):
    """A captured forward of `ids` at columns start.., the committed columns and `pattern` visible."""
    dev = next(model.parameters()).device
    t = len(ids)
    allowed = torch.zeros(t, cache.capacity, dtype=torch.bool)
    allowed[:, :start] = True
    allowed[:, start: start + t] = pattern
    static = {"ids": torch.tensor([ids], device=dev), "pos": torch.tensor([positions], device=dev),
              "mask": allowed[None, None].to(dev), "cols": torch.arange(start, start + t, device=dev)}

    def forward():
        cache.columns = static["cols"]
        return model(input_ids=static["ids"], position_ids=static["pos"], attention_mask=static["mask"],
                     **{cache_arg(model): cache}, use_cache=True).logits

    return bare_graph(forward)


def bare_graph(fn):
    """fn under one torch.cuda.graph (two warm-up calls on a side stream first): its replay. The
    replay holds fn, and so the static inputs fn closes over: a graph reads its inputs' addresses,
    and freed inputs would be reused by later allocations (read as garbage ids)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        fn()

    def replay():
        graph.replay()

    replay.inputs = fn  # (kept alive with the replay)
    return replay


def build(shape: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    return model.eval().requires_grad_(False)


def rows_of(shape: str, model, prompt_len: int, iters: int, compiled_rows: tuple[str, ...] = ()) -> list[dict]:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = tree_of(TREE, vocab)
    target = Target.wrap(model)
    core, eager = TargetRunner(target, AUX[shape], graphs=True), TargetRunner(target, AUX[shape], graphs=False)
    fold1 = TargetRunner(target, AUX[shape], graphs=True, fold_queries=1)
    compiled = TargetRunner(target, AUX[shape], graphs=True, compiled=True)
    for runner in (core, eager, fold1, compiled):
        runner.reset(prompt_len + len(tree) + 64)
        runner.forward(prompt)
    plain_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt], device=model.device), **{cache_arg(model): plain_cache}, use_cache=True)
    ref_cache = RefCache(core.cache.capacity)
    reference_step(model, ref_cache, 0, prompt, list(range(prompt_len)),
                   torch.ones(prompt_len, prompt_len, dtype=torch.bool).tril())()  # its prefill
    steps = [("token", 1), ("verify_k3", 4), ("verify_k7", 8), ("verify_k15", 16), ("tree", 1 + len(tree))]
    rows = []
    for name, t in steps:
        if name == "tree":
            ids = [prompt[-1]] + tree.tokens
            positions = [prompt_len] + [prompt_len + d for d in tree.depths]
            mask = verify_mask(tree, prompt_len, 1)
        else:
            ids = torch.randint(vocab, (t,), generator=torch.Generator().manual_seed(t)).tolist()
            positions, mask = list(range(prompt_len, prompt_len + t)), None

        def core_step(runner, ids=ids, positions=positions, mask=mask):
            def step():
                runner.forward(ids, positions=positions, mask=mask)
                runner.crop(prompt_len)
            return step

        def plain_step(ids=ids):
            with torch.inference_mode():
                model(input_ids=torch.tensor([ids], device=model.device), **{cache_arg(model): plain_cache}, use_cache=True)
            plain_cache.crop(-len(ids))  # (a negative count: every transformers version takes it)

        pattern = (mask[:, prompt_len:] if mask is not None else torch.ones(t, t, dtype=torch.bool).tril())
        fns, errors = {"core": core_step(core), "core_eager": core_step(eager)}, {}
        if t > 1:  # (one token a row folds either way)
            fns["core_fold1"] = core_step(fold1)
        if name in compiled_rows:
            fns["core_compiled"] = core_step(compiled)
        if name != "tree":
            fns["plain"] = plain_step
        try:
            fns["graph"] = reference_step(model, ref_cache, prompt_len, ids, positions, pattern)
        except Exception as e:  # noqa: BLE001 - reported in the row, the other columns still measured
            errors["graph"] = f"{type(e).__name__}: {e}"[:300]
        rows.append({"shape": shape, "row": name, "tokens": t, **timed(fns, iters), **errors})
    rows.append(prefill_row(shape, model, core, eager, iters))
    runners = {"core": core} | ({"core_compiled": compiled} if "token" in compiled_rows else {})
    rows.append({"shape": shape, "row": "alone", "tokens": ALONE_TOKENS,
                 **{name: alone_ms_per_token(r, prompt, iters=5) for name, r in runners.items()}})
    return rows


def prefill_row(shape: str, model, core: TargetRunner, eager: TargetRunner, iters: int) -> dict:
    """The `prefill` row: a PREFILL_TOKENS prompt read into an empty cache. core: the captured
    prefill, padded to its bucket (decoding/steps.py prompt_bucket); core_eager: the eager body
    (the path before padded prefills); plain: the model's forward into a new DynamicCache; graph: the
    reference captured at the prompt's own length. Leaves the runners' caches holding that prompt."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (PREFILL_TOKENS,), generator=torch.Generator().manual_seed(2)).tolist()

    def core_prefill(runner):
        def run():
            runner.reset(PREFILL_TOKENS)
            runner.forward(ids)
        return run

    def plain():
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=model.device),
                  **{cache_arg(model): DynamicCache(config=model.config)}, use_cache=True)

    fns, errors = {"core": core_prefill(core), "core_eager": core_prefill(eager), "plain": plain}, {}
    try:
        fns["graph"] = reference_step(model, RefCache(core.cache.capacity), 0, ids, list(range(PREFILL_TOKENS)),
                                      torch.ones(PREFILL_TOKENS, PREFILL_TOKENS, dtype=torch.bool).tril())
    except Exception as e:  # noqa: BLE001 - reported in the row, the other columns still measured
        errors["graph"] = f"{type(e).__name__}: {e}"[:300]
    return {"shape": shape, "row": "prefill", "tokens": PREFILL_TOKENS, **timed(fns, iters), **errors}


def timed(fns: dict, iters: int) -> dict:
    """A target row's columns (COLUMNS and B2B_COLUMNS, the module docstring's) and ratios to graph."""
    host = {}
    ms = cuda_time_ms_interleaved(fns, warmup=3, iters=iters, host_ms=host)
    out = {k: ms.get(k) for k in COLUMNS}
    for k in ("core", "graph"):
        if k in fns:
            out[f"{k}_b2b"], out[f"{k}_host"] = cuda_time_ms_back_to_back(fns[k]), host[k]
    for k in ("core", "core_fold1", "core_compiled"):
        out[f"{k}/graph"] = ms[k] / ms["graph"] if k in ms and "graph" in ms else None
    out["core_b2b/graph_b2b"] = out["core_b2b"] / out["graph_b2b"] if "graph_b2b" in out else None
    return out


def alone_ms_per_token(runner: TargetRunner, prompt: list[int], iters: int) -> float:
    """Median wall ms per generated token of the target alone as sf-eval runs it (prefill included)."""
    from specfoundry.decoding.rounds import target_generate
    from specfoundry.decoding.sampler import Sampler

    def run() -> None:
        out = target_generate(runner, prompt, max_new_tokens=ALONE_TOKENS, eos=set(),
                              sampler=Sampler(0.0, torch.Generator(device=runner.device)))
        torch.cuda.synchronize()
        assert len(out.tokens) == ALONE_TOKENS

    return wall_ms(run, iters) / ALONE_TOKENS  # (wall_ms runs it once first: the warm-up)


def draft_steps(shape: str, model, prompt_len: int, graphs: bool) -> dict:
    """family -> (its step as sf-eval runs it, its step's body for a bare graph), a random draft of
    the target's shape (bf16 on a GPU) whose runner has read a context of prompt_len positions."""
    from specfoundry.families.dflash.block import BlockDraftRunner
    from specfoundry.families.dflash.config import dflash_config_from_target
    from specfoundry.families.dflash.model import DFlashDraft
    from specfoundry.families.dflash2.config import dflash2_config_from_target
    from specfoundry.families.dflash2.decode import DFlash2Runner
    from specfoundry.families.dflash2.model import DFlash2Draft
    from specfoundry.families.dflash2.options import DFlash2Options
    from specfoundry.families.domino.config import domino_config_from_target
    from specfoundry.families.domino.decode import DominoRunner
    from specfoundry.families.domino.model import DominoDraft
    from specfoundry.families.domino.options import DominoOptions
    from specfoundry.families.dspark.config import dspark_config_from_target
    from specfoundry.families.dspark.decode import DSparkRunner
    from specfoundry.families.dspark.model import DSparkDraft
    from specfoundry.families.dspark.options import DSparkOptions
    from specfoundry.families.eagle3.chain import DraftRunner
    from specfoundry.families.eagle3.config import draft_config_from_target
    from specfoundry.families.eagle3.expansion import TreeShape, expand_body
    from specfoundry.families.eagle3.model import Eagle3Draft
    from specfoundry.families.eagle3.tree import expand_tree
    from specfoundry.families.peagle.config import peagle_config_from_target
    from specfoundry.families.peagle.decode import PEagleRunner
    from specfoundry.families.peagle.model import PEagleDraft

    cfg = model.config.to_dict()
    vocab, device, dtype = cfg["vocab_size"], model.device, model.dtype
    head = model.lm_head.weight  # [V, H] the target's
    tokens = list(range(1, prompt_len + 1))
    torch.manual_seed(2)

    def placed(draft):
        return draft.to(device, dtype).eval().requires_grad_(False)

    def aux(layers: int, rows: int = prompt_len) -> torch.Tensor:
        return torch.randn(rows, layers * cfg["hidden_size"], device=device, dtype=dtype)

    steps = {}
    eagle = DraftRunner(placed(Eagle3Draft(draft_config_from_target(cfg, min(32000, vocab), AUX[shape]))),
                        graphs=graphs)
    shape_of_tree = TreeShape.of(TREE)
    eagle.reset(prompt_len + 64 + len(shape_of_tree))  # room for the tree's entries: no regrowth while timed
    eagle.extend(tokens, aux(3))
    steps["eagle3"] = (lambda: eagle.propose(CHAIN, None, greedy=True), lambda: eagle.greedy_chain(CHAIN))
    steps["eagle3_tree"] = (lambda: expand_tree(eagle, shape_of_tree), expand_body(eagle, shape_of_tree))
    committed, new_rows = len(eagle), aux(3, COMMIT_TOKENS)
    new_tokens = list(range(5, 5 + COMMIT_TOKENS))
    bare_extend = eagle.extend_step(COMMIT_TOKENS)  # its body over inputs filled once, for the bare graph
    extend_inputs = SimpleNamespace(ids=torch.tensor(new_tokens, device=device), start=torch.tensor(committed, device=device),
                                    rows=torch.tensor(COMMIT_TOKENS, device=device), aux=new_rows.clone())

    def eagle_commit():  # the commit, then the host's counters back to the same committed length
        eagle.extend(new_tokens, new_rows)
        # not eagle.crop: its device fill is no part of a round, and the body sets `base` from its inputs
        eagle.length = eagle.written = committed

    steps["eagle3_commit"] = (eagle_commit, lambda: bare_extend.body(extend_inputs))
    layers, mask_id = DFLASH_LAYERS[shape], vocab - 1
    blocks = {
        "dflash": (BlockDraftRunner, DFlashDraft(dflash_config_from_target(cfg, layers, 5, BLOCK, mask_id))),
        "domino": (DominoRunner, DominoDraft(domino_config_from_target(cfg, layers, 5, BLOCK, mask_id,
                                                                        DominoOptions().gru_hidden_dim,
                                                                        DominoOptions().correction_dim))),
        "dspark": (DSparkRunner, DSparkDraft(dspark_config_from_target(cfg, layers, 5, BLOCK, mask_id,
                                                                        DSparkOptions().markov_rank))),
        "dflash2": (DFlash2Runner, DFlash2Draft(dflash2_config_from_target(cfg, layers, 5, BLOCK, mask_id,
                                                                          DFlash2Options()))),
    }
    for name, (runner_class, draft) in blocks.items():
        runner = runner_class(placed(draft), head, graphs=graphs)
        runner.reset(prompt_len + 64)
        runner.extend(aux(len(layers)))
        bonus = torch.tensor(11, device=device)
        steps[name] = (lambda r=runner: r.propose(11), lambda r=runner, b=bonus: r.propose_body(b))
        if name == "dflash":  # the context append of a round's commit, then back to the same length
            context_rows = aux(len(layers), COMMIT_TOKENS)
            bare_append = runner.append_step(COMMIT_TOKENS)
            append_inputs = SimpleNamespace(start=torch.tensor(prompt_len, device=device),
                                            rows=torch.tensor(COMMIT_TOKENS, device=device), aux=context_rows.clone())

            def dflash_commit(r=runner, rows=context_rows):
                r.extend(rows)
                r.cache.length = prompt_len  # (not crop's device fill: the body sets `start` from its inputs)

            steps["dflash_commit"] = (dflash_commit, lambda b=bare_append, x=append_inputs: b.body(x))
    peagle = PEagleRunner(placed(PEagleDraft(peagle_config_from_target(cfg, min(32000, vocab), AUX[shape],
                                                                        num_hidden_layers=2, num_depths=CHAIN,
                                                                        mask_token_id=mask_id))), graphs=graphs)
    peagle.reset(prompt_len + 4096)  # every timed step commits one row
    peagle.read(tokens, aux(3))
    peagle.forward(CHAIN)
    row = aux(3, 1)
    inputs = SimpleNamespace(ids=torch.tensor([5] + [mask_id] * (CHAIN - 1), device=device), aux=row,
                             start=torch.tensor(peagle.length, device=device))

    def peagle_step():
        peagle.read([5], row)
        return peagle.propose(CHAIN, None, greedy=True)

    steps["peagle"] = (peagle_step, lambda: peagle.body(inputs, 1, CHAIN))
    return steps


def draft_rows(shape: str, model, prompt_len: int, iters: int) -> list[dict]:
    cuda = model.device.type == "cuda"
    eager = draft_steps(shape, model, prompt_len, graphs=False)
    core = draft_steps(shape, model, prompt_len, graphs=True) if cuda else {}
    rows = []
    for name, (plain_step, body) in eager.items():
        fns = {"plain": plain_step}
        if cuda:
            fns["graph"] = bare_graph(body)
            fns["core"] = core[name][0]
        ms = cuda_time_ms_interleaved(fns, warmup=3, iters=iters) if cuda else {"plain": wall_ms(plain_step, iters)}
        rows.append({"shape": shape, "row": f"draft_{name}", "tokens": None, **{k: ms.get(k) for k in
                                                                             ("plain", "graph", "core")},
                     "core/graph": ms["core"] / ms["graph"] if cuda else None})
    return rows


def wall_ms(fn, iters: int) -> float:
    """Median host time of fn() (a CPU run: no events)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def profile(model, shape: str, prompt_len: int) -> dict:
    """torch.profiler tables (device kernels and host ops) of 10 steps each: the token step (core,
    plain) and the verify of PROFILED_VERIFY tokens (core, core_fold1, the graph reference)."""
    from transformers import DynamicCache

    prompt = list(range(1, prompt_len + 1))
    target = Target.wrap(model)
    runner = TargetRunner(target, AUX[shape], graphs=True)
    fold1 = TargetRunner(target, AUX[shape], graphs=True, fold_queries=1)
    for r in (runner, fold1):
        r.reset(prompt_len + 64)
        r.forward(prompt)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt], device=model.device), **{cache_arg(model): cache}, use_cache=True)
    t = PROFILED_VERIFY
    chain = list(range(7, 7 + t))
    ref_cache = RefCache(runner.cache.capacity)
    reference_step(model, ref_cache, 0, prompt, list(range(prompt_len)),
                   torch.ones(prompt_len, prompt_len, dtype=torch.bool).tril())()  # its prefill
    reference = reference_step(model, ref_cache, prompt_len, chain, list(range(prompt_len, prompt_len + t)),
                               torch.ones(t, t, dtype=torch.bool).tril())
    out = {}
    for name, fn in (("core token", lambda: (runner.forward([5]), runner.crop(prompt_len))),
                     ("plain token", lambda: (model(input_ids=torch.tensor([[5]], device=model.device),
                                                    **{cache_arg(model): cache}, use_cache=True), cache.crop(-1))),
                     (f"core verify_k{t - 1}", lambda: (runner.forward(chain), runner.crop(prompt_len))),
                     (f"core_fold1 verify_k{t - 1}", lambda: (fold1.forward(chain), fold1.crop(prompt_len))),
                     (f"graph verify_k{t - 1}", reference)):
        with torch.inference_mode():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
        out[name] = {"device": profile_summary(prof), "host": profile_summary(prof, device=False)}
        print_profile_summary(f"{shape} {name}: device, 10 steps", out[name]["device"])
        print_profile_summary(f"{shape} {name}: host, 10 steps", out[name]["host"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="smollm2,8b", help=f"Comma-separated, of: {', '.join(SHAPES)}.")
    p.add_argument("--prompt", type=int, default=256, help="Tokens of the prompt every step follows.")
    p.add_argument("--iters", type=int, default=40, help="Timed iterations of each row (after 3 of warm-up).")
    p.add_argument("--profile", action="store_true", help="Add torch.profiler tables: the token step (core, "
                   "plain) and a verify of 8 tokens (core, core_fold1, graph).")
    p.add_argument("--compiled-rows", default="token,verify_k7",
                   help="Rows that get the core_compiled column (comma-separated; empty: none). 'token' "
                        "also adds core_compiled to the `alone` row.")
    p.add_argument("--out", default="decode_step", help="The result's name under benchmarks/results/ (or a path).")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (draft rows only, eager)")
    args = p.parse_args()
    rows, profiles = [], {}
    for shape in args.shapes.split(","):
        model = build(shape, args.device)
        if args.device == "cuda":
            rows += rows_of(shape, model, args.prompt, args.iters, tuple(filter(None, args.compiled_rows.split(","))))
        rows += draft_rows(shape, model, args.prompt, args.iters)
        if args.profile and args.device == "cuda":
            profiles[shape] = profile(model, shape, args.prompt)
        del model
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "row", "tokens", *COLUMNS, "core/graph", "core_fold1/graph", "core_compiled/graph",
                       *B2B_COLUMNS, "core_b2b/graph_b2b"])
    summary = {"ms": {}, "ms_back_to_back": {}, "alone_tokens_per_s": {}}
    for r in rows:
        if r["row"] == "alone":
            summary["alone_tokens_per_s"][r["shape"]] = {k: 1e3 / r[k] for k in COLUMNS if r.get(k)}
        else:
            summary["ms"].setdefault(r["shape"], {})[r["row"]] = {k: r.get(k) for k in COLUMNS}
            if r.get("core_b2b") is not None:
                summary["ms_back_to_back"].setdefault(r["shape"], {})[r["row"]] = {k: r.get(k) for k in B2B_COLUMNS}
    print("target alone, tokens/s (prefill of --prompt tokens included):", summary["alone_tokens_per_s"])
    if args.device != "cuda":
        return  # a check of the script: no result file
    path = write_result(args.out, rows, {"summary": summary, "profile": profiles, "tree": list(TREE),
                                         "prompt_tokens": args.prompt})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
