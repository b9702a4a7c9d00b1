"""sf-regen throughput on one GPU: today's path against the new one against one plain
`model.generate` batch, in the same run.

    python -m benchmarks.regen [--conversations 2048] [--max-new-tokens 256] [--batch-size 2048]
                               [--llama8b-conversations 256] [--llama8b-batch-size 256] [--profile]

For each target, tokens generated per second of:
- `before`: the regen stage as it was: `model.generate` over length-sorted, left-padded batches,
  one shard at a time, turn by turn (--hf-engine generate, shard groups of one);
- `generate_grouped`: --hf-engine generate as the stage runs it now, over groups of shards;
- `after`: the stage with --hf-engine slots (continuous batching over a per-slot KV cache), its decode
  step eager (as before the decoding core's graphs);
- `graph_step`: the same, the decode step replayed as a CUDA graph per attended window (the default on
  a GPU);
- `plain_generate_ceiling`: one `model.generate` batch of `batch-size` prompts of 64 tokens, every
  one generating max-new-tokens (no early stop): the padding-free, finish-free static batch;
- `slots_fixed_length`: the slot engine on that same fixed-length workload (its overhead alone).
The stage figures count every generated token over the stage's wall time (rendering, tokenising,
writing the shards included). The `after` row also splits the slot engine's wall time by phase
(`phases_s`, timers around its methods): `step` (the host queueing one decode step; it blocks
only when the launch queue is full), `collect` (the look every few steps: it waits for the device
to finish what was queued), `on_done` (the stage's host work per finished request: decoding,
recording, rendering and tokenising the next turn; the device idles, nothing being queued) and
`refill` (admitting waiting prompts: host tensors and the prefill forwards).

--profile adds, per target, torch.profiler over 8 decode steps at the full batch (64-token prompts,
after 8 warm-up steps) of the slot engine with its step replayed as a CUDA graph (`slots_graph`), of
its eager step (`slots`), of the slot engine on transformers' own sdpa path
(`slots_repeat_kv`: the query heads not folded, which under transformers 5.17 copies the attended
cache G times per layer; sdpa targets only) and of transformers' own decode step (the model's
forward over a DynamicCache, as model.generate runs it): wall ms per step, the device's kernel
time per step by kind, and the top kernels and host ops (JSON: `profile`, tables in the log).

Targets: SmolLM2-135M-Instruct with its real weights (the embedded GGUF, common/target.py), on
`--conversations` conversations synthesised from the shipped prompt sets (spread prompt lengths,
a quarter of them two-turn), greedy as in the pipeline; and a randomly initialised model of
Llama-3.1-8B's shape (bf16) on fewer conversations (a random model rarely stops, so nearly every
answer runs to the cap). `--second-target tiny` swaps the 8B for a tiny one, to check the script
on a CPU; the JSON goes to results/regen.json only from a GPU run (or to --out).

--synthesize N swaps SmolLM2's workload for the stage as `sf-regen --recipe RECIPE --synthesize N`
runs it (--recipe, default recipes/smollm2-h200.yaml: its batch, answer cap, sampling and the
prompts the target writes itself), the workload of the stage's figure in benchmarks/RESULTS.md
(10,240 prompts). --paths picks the rows (default every
one; `before` alone takes minutes): e.g. `--synthesize 10240 --paths after,graph_step
--llama8b-conversations 0` is the stage eager and graph-replayed, side by side. Its tokens are the
answers' (the manifest's generated_tokens), its seconds the whole stage's, the target's writing of
the prompts included.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

from benchmarks.common import print_profile_summary, print_table, profile_summary, write_result
from specfoundry.common.cli import resolve_config
from specfoundry.common.target import Target
from specfoundry.eval.prompts import prompt_source
from specfoundry.generate.backends.hf import HFBackend
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.backends.slots import COLUMN_ROUND, SlotEngine, Waiting, round_up
from specfoundry.generate.regen import RegenConfig, Regenerator, run_regen

FILLER = ("The report covers the quarter's results across every region. Sales rose in the north and fell "
          "slightly in the south, while costs stayed flat. The team plans to hire two engineers and to move "
          "the launch to the spring. Customers asked for better documentation and a faster checkout. ")


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """n conversations built from the shipped prompt sets: each user turn is a prompt behind 0 to 24
    sentences of context (prompt lengths from about 20 to 800 tokens); every fourth conversation
    has a second turn."""
    rng = random.Random(seed)
    prompts = [json.loads(line)["messages"][-1]["content"]
               for name in ("chat", "code", "math") for line in prompt_source(name).read_text().splitlines()]
    sentences = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
    out = []
    for i in range(n):
        context = " ".join(rng.choice(sentences) for _ in range(min(24, int(rng.expovariate(1 / 6)))))
        user = (f"{context}\n\n" if context else "") + prompts[i % len(prompts)]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "-"}]
        if i % 4 == 3:
            messages += [{"role": "user", "content": "Now say it in fewer words."}, {"role": "assistant", "content": "-"}]
        out.append({"id": f"b{i}", "messages": messages})
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Workload:
    """The stage as `sf-regen --recipe RECIPE --synthesize N` runs it: every regen setting from the
    recipe (batch, answer cap, sampling, prompt temperature), N prompts the target writes."""

    def __init__(self, recipe: str, synthesize: int):
        self.recipe, self.synthesize = recipe, synthesize

    def config(self, output: Path, engine: str) -> RegenConfig:
        return resolve_config(RegenConfig, "regen", self.recipe,
                              {"output": str(output), "synthesize": self.synthesize, "hf_engine": engine})

    @property
    def batch_size(self) -> int:
        """The recipe's batch: the slot engine's slots, as sf-regen --recipe runs it."""
        return resolve_config(RegenConfig, "regen", self.recipe, {"output": "-"}).batch_size


@contextmanager
def slot_phases(acc: dict):
    """Adds to acc the wall seconds (and calls) of every SlotEngine run's phases: step, collect,
    refill, and the caller's on_done per finished request (see the module docstring)."""
    original = {name: getattr(SlotEngine, name) for name in ("step", "collect", "refill", "run")}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
                acc[f"{name}_calls"] = acc.get(f"{name}_calls", 0) + 1
        return wrapper

    def run(self, first, on_done):
        return original["run"](self, first, timed("on_done", on_done))

    with patch.object(SlotEngine, "step", timed("step", original["step"])), \
            patch.object(SlotEngine, "collect", timed("collect", original["collect"])), \
            patch.object(SlotEngine, "refill", timed("refill", original["refill"])), \
            patch.object(SlotEngine, "run", timed("run", run)):
        yield


def stage(backend: HFBackend, source: Path | Workload, work: Path, name: str, max_new: int, batch: int,
          shard_size: int, grouped: bool = True) -> dict:
    """The regen stage's tokens/s with this backend over `source` (conversations, or a Workload
    the target synthesises); not `grouped`: one shard at a time, as the stage generated before it
    grouped shards. With the slot engine, also its phases' seconds."""
    if isinstance(source, Workload):
        cfg = source.config(work / name, backend.engine)
    else:
        cfg = RegenConfig(output=str(work / name), source=str(source), shard_size=shard_size, batch_size=batch,
                          hf_engine=backend.engine, sampling=SamplingConfig(temperature=0.0, max_new_tokens=max_new))
    phases: dict = {}
    sync()
    t = time.perf_counter()
    with patch.object(Regenerator, "group_size", return_value=1) if not grouped else nullcontext(), \
            slot_phases(phases) if backend.engine == "slots" else nullcontext():
        manifest = run_regen(cfg, backend, silent=True)
    sync()
    seconds = time.perf_counter() - t
    tokens = manifest["totals"]["generated_tokens"]
    row = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
           "turns": manifest["totals"]["turns_ok"] + manifest["totals"]["turns_truncated"]}
    if phases:
        row["phases_s"] = phases
    return row


def answers(work: Path, name: str) -> dict[tuple[str, int], list[int]]:
    """(conversation id, turn) -> the generated token ids, of a stage run's output."""
    import pyarrow.parquet as pq

    return {(row["id"], k): ids for p in sorted((work / name / "data").glob("*.parquet"))
            for row in pq.read_table(p).to_pylist() for k, ids in enumerate(row["gen_token_ids"])}


@torch.inference_mode()
def fixed_length(model, stop_ids: list[int], batch: int, max_new: int, prompt_len: int = 64) -> dict:
    """One model.generate batch and the slot engine over `batch` prompts of `prompt_len` tokens,
    each generating exactly max_new tokens."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=g)  # [B, T]
    rows = {}
    for name, run in (
        ("plain_generate_ceiling", lambda: model.generate(
            ids.to(device), attention_mask=torch.ones_like(ids).to(device), do_sample=False, max_new_tokens=max_new,
            min_new_tokens=max_new, eos_token_id=stop_ids, pad_token_id=stop_ids[0])),
        ("slots_fixed_length", lambda: SlotEngine(
            Target.wrap(model), slots=batch, stop_ids=[], sampling=SamplingConfig(temperature=0.0, max_new_tokens=max_new)).run(
            [(r, 0, i) for i, r in enumerate(ids.tolist())], lambda tag, out: ())),
    ):
        sync()
        t = time.perf_counter()
        run()
        sync()
        seconds = time.perf_counter() - t
        rows[name] = {"seconds": seconds, "output_tokens": batch * max_new, "tokens_per_s": batch * max_new / seconds}
        print(f"{name}: {batch * max_new} tokens in {seconds:.1f} s, {batch * max_new / seconds:,.0f} tokens/s", flush=True)
    return rows


def profile_decode(model, batch: int, steps: int = 8, prompt_len: int = 64) -> dict:
    """torch.profiler over `steps` decode steps at `batch` rows (prompts of prompt_len tokens, after
    `steps` warm-up steps) of the slot engine and of the model's forward over a DynamicCache (what
    model.generate runs per step): wall ms per step (timed apart, without the profiler), the
    device's kernel time per step and its top kernels and kinds, the host's top ops."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=g)  # [B, T]
    engine = SlotEngine(Target.wrap(model), slots=batch, stop_ids=[],
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=4 * steps + 2))

    @torch.inference_mode()
    def slot_setup():
        engine.allocate(round_up(prompt_len + engine.max_new, COLUMN_ROUND))
        queue = [Waiting((-prompt_len, i), row, 0, i) for i, row in enumerate(ids.tolist())]
        heapq.heapify(queue)
        engine.refill(queue, list(range(batch)))
        return engine.step

    @torch.inference_mode()
    def cache_setup():
        cache = DynamicCache()
        mask = torch.ones(batch, prompt_len, dtype=torch.long, device=device)
        out = model(input_ids=ids.to(device), attention_mask=mask, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        state = {"token": out.logits[:, -1].argmax(-1, keepdim=True), "mask": mask}

        def step():
            state["mask"] = torch.cat([state["mask"], state["mask"][:, :1]], dim=1)
            o = model(input_ids=state["token"], attention_mask=state["mask"], past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
            state["token"] = o.logits[:, -1].float().argmax(-1, keepdim=True)
        return step

    def eager_setup():  # the engine's step without graphs (as before the decoding core)
        engine.graphs = False
        return slot_setup()

    def unfolded_setup():  # the engine as it was before it folded the query heads (transformers' sdpa path)
        engine.graphs, engine.fold = False, False
        return slot_setup()

    out = {}
    paths = (("slots_graph", slot_setup), ("slots", eager_setup), ("slots_repeat_kv", unfolded_setup),
             ("dynamic_cache", cache_setup))
    for name, setup in (paths if engine.fold else (paths[0], paths[1], paths[3])):
        step = setup()
        with torch.inference_mode():
            for _ in range(steps):
                step()
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall_ms = 1e3 * (time.perf_counter() - t) / steps
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                sync()
        kernels = profile_summary(prof, top=12, device=True) if cuda else None
        host = profile_summary(prof, top=10, device=False)
        out[name] = {"batch": batch, "steps": steps, "wall_ms_per_step": wall_ms,
                     "device_kernel_ms_per_step": kernels["total_ms"] / steps if kernels else None,
                     "kernels": kernels, "host_ops": host}
        print(f"== decode step, {name}, batch {batch}: {wall_ms:.2f} ms per step (wall)")
        if kernels:
            print_profile_summary(f"{name}: device kernels over {steps} steps", kernels)
        print_profile_summary(f"{name}: host ops over {steps} steps (self CPU time)", host)
    return out


STAGE_PATHS = ("before", "generate_grouped", "after", "graph_step")
FIXED_PATHS = ("plain_generate_ceiling", "slots_fixed_length")  # fixed_length() measures both
PATHS = STAGE_PATHS + FIXED_PATHS


def measure(label: str, model, tokenizer, conversations: int, batch: int, max_new: int, shard_size: int,
            work: Path, profile: bool = False, paths: tuple[str, ...] = PATHS,
            workload: Workload | None = None) -> tuple[list[dict], dict | None]:
    """The rows of `paths` for one target, over `conversations` built from the prompt sets or, given,
    the synthesised `workload`."""
    if workload is None:
        source = work / f"{label}.jsonl"
        source.write_text("".join(json.dumps(c) + "\n" for c in synthetic_conversations(conversations)))
        warm = source
    else:
        source, warm, batch = workload, Workload(workload.recipe, 8), workload.batch_size
    before = HFBackend(Target.wrap(model, tokenizer), batch_size=batch, engine="generate")
    after = HFBackend(Target.wrap(model, tokenizer), batch_size=batch, engine="slots")
    stage(after, warm, work, f"{label}-warmup", 8, min(batch, 8), shard_size)  # kernels, allocator warmed up
    rows = {}
    for path, backend, grouped in (("before", before, False), ("generate_grouped", before, True),
                                   ("after", after, True), ("graph_step", after, True)):
        if path not in paths:
            continue
        # `after`: the slot engine's decode step eager, as measured before graphs; `graph_step`: replayed
        eager = (patch("specfoundry.generate.backends.slots.graphs_possible", return_value=False) if path == "after"
                 else nullcontext())
        with eager:
            rows[path] = stage(backend, source, work, f"{label}-{path}", max_new, batch, shard_size, grouped=grouped)
        # each figure in the log as it is measured: a later failure keeps it
        print(f"{label} {path}: {rows[path]['output_tokens']} tokens in {rows[path]['seconds']:.1f} s, "
              f"{rows[path]['tokens_per_s']:,.0f} tokens/s", flush=True)
    if "before" in rows and "after" in rows:
        a, b = answers(work, f"{label}-before"), answers(work, f"{label}-after")
        # bf16 logits differ in the last bit between batch shapes, so greedy answers can part ways
        rows["after"]["same_answers_as_before"] = sum(b.get(k) == ids for k, ids in a.items()) / len(a)
    if any(p in paths for p in FIXED_PATHS):
        rows.update(fixed_length(model, before.stop_ids, batch, max_new))
    n = conversations if workload is None else workload.synthesize
    rows = [{"target": label, "path": k, "conversations": n, "batch": batch, **v} for k, v in rows.items()]
    return rows, (profile_decode(model, batch) if profile else None)


def llama8b(tiny: bool, device: str):
    """A randomly initialised Llama-3.1-8B-shaped model (or a tiny one), bf16 on a GPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if tiny else
             dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8))
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return model.eval().requires_grad_(False)


def profile_only(model, args, device: str) -> None:
    """--profile-only: the decode-step profiles of each target at its batch, one row per path."""
    profiles = {"smollm2": profile_decode(model, args.batch_size)}
    if args.llama8b_conversations:
        del model
        profiles[args.second_target] = profile_decode(llama8b(args.second_target == "tiny", device),
                                                      args.llama8b_batch_size)
    rows = [{"target": t, "path": path, "batch": p["batch"], "wall_ms_per_step": p["wall_ms_per_step"],
             "device_kernel_ms_per_step": p["device_kernel_ms_per_step"]}
            for t, paths in profiles.items() for path, p in paths.items()]
    print_table(rows, ["target", "path", "batch", "wall_ms_per_step", "device_kernel_ms_per_step"])
    out = args.out or ("regen_profile" if device == "cuda" else None)
    if out:
        print(write_result(out, rows, {"settings": vars(args), "profile": profiles}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=2048, help="SmolLM2 conversations.")
    ap.add_argument("--batch-size", type=int, default=2048, help="SmolLM2 sequences at once (both paths; with --synthesize, the recipe's batch_size instead).")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="Tokens per answer, at most.")
    ap.add_argument("--shard-size", type=int, default=128, help="sf-regen's --shard-size (its default, and the "
                    "recipes').")
    ap.add_argument("--llama8b-conversations", type=int, default=256, help="Conversations of the 8B (0: skip it).")
    ap.add_argument("--llama8b-batch-size", type=int, default=256, help="8B sequences at once.")
    ap.add_argument("--second-target", choices=("llama8b", "tiny"), default="llama8b",
                    help="The second target: the 8B shape, or a tiny Llama to check the script on a CPU.")
    ap.add_argument("--out", default=None, help="Result name under benchmarks/results/ (default: regen on a GPU, "
                    "none on a CPU).")
    ap.add_argument("--profile", action="store_true", help="Also profile 8 decode steps of the slot engine and of "
                    "transformers' DynamicCache step at the full batch, per target.")
    ap.add_argument("--profile-only", action="store_true", help="Only the decode-step profiles of --profile (no "
                    "stage runs): results/regen_profile.json on a GPU.")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"The rows to measure, comma-separated, of: "
                    f"{', '.join(PATHS)} (default: every one).")
    ap.add_argument("--synthesize", type=int, default=0, help="SmolLM2's workload: this many prompts the target "
                    "writes, the stage run as `sf-regen --recipe RECIPE --synthesize N` (default 0: --conversations "
                    "from the prompt sets).")
    ap.add_argument("--recipe", default="recipes/smollm2-h200.yaml", help="The recipe of --synthesize's stage (its "
                    "regen section).")
    args = ap.parse_args()
    paths = tuple(args.paths.split(","))
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"--paths: unknown {', '.join(unknown)}; the rows are {', '.join(PATHS)}")
    workload = Workload(args.recipe, args.synthesize) if args.synthesize else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smollm2 = Target.load("smollm2", device=device)
    model, tokenizer = smollm2.model, smollm2.tokenizer
    if args.profile_only:
        return profile_only(model, args, device)
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows, profiles["smollm2"] = measure("smollm2", model, tokenizer, args.conversations, args.batch_size,
                                            args.max_new_tokens, args.shard_size, work, args.profile, paths, workload)
        del model, smollm2
        if args.llama8b_conversations:
            big = llama8b(args.second_target == "tiny", device)
            more, profiles[args.second_target] = measure(args.second_target, big, tokenizer, args.llama8b_conversations,
                                                         args.llama8b_batch_size, args.max_new_tokens, args.shard_size,
                                                         work, args.profile, paths)
            rows += more
    summary = {f"{t}_tokens_per_s": {r["path"]: r["tokens_per_s"] for r in rows if r["target"] == t}
               for t in dict.fromkeys(r["target"] for r in rows)}
    for t in summary.values():
        for ratio, (num, den) in (("after_over_before", ("after", "before")), ("graph_step_over_after", ("graph_step", "after"))):
            if num in t and t.get(den):
                t[ratio] = t[num] / t[den]
    print_table(rows, ["target", "path", "conversations", "batch", "output_tokens", "seconds", "tokens_per_s",
                       "same_answers_as_before"])
    for r in rows:
        if "phases_s" in r:
            print(f"{r['target']} {r['path']} phases (s): "
                  + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["phases_s"].items()))
    print(json.dumps(summary, indent=2))
    out = args.out or ("regen" if device == "cuda" else None)
    extra = {"summary": summary, "settings": vars(args)}
    if args.profile:
        extra["profile"] = profiles
    if out:
        print(write_result(out, rows, extra))


if __name__ == "__main__":
    main()
