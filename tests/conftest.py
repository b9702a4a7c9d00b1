"""Shared fixtures: a fixed seed, the embedded SmolLM2 target, small conversation files."""

from __future__ import annotations

import math
import os

import torch

# Triton kernels run on CPU through Triton's interpreter; it is chosen when the kernel module
# is imported, so it must be set before any test imports specfoundry.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the default run, `-n 2` in pyproject.toml) each worker takes one core: torch
# and the processes a test starts use one thread, so the workers do not fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import json  # noqa: E402
import random
from contextlib import contextmanager
from pathlib import Path

import pytest  # noqa: E402

from specfoundry.common.target import EMBEDDED_DEFAULT, resolve_target

CHAT = [
    {"id": "c0", "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
    {"id": "c1", "conversations": [
        {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "And another one?"}, {"from": "gpt", "value": "Red."}]},
    {"id": "c2", "messages": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "Scattering."}]},
    {"id": "c3", "messages": [{"role": "user", "content": "Write a haiku about rain."},
                              {"role": "assistant", "content": "..."}]},
    {"id": "c4", "messages": [{"role": "user", "content": "Give me a Python function that adds two numbers."},
                              {"role": "assistant", "content": "def add(a, b): return a + b"}]},
    {"id": "c5", "messages": [{"role": "user", "content": "What is the capital of France?"},
                              {"role": "assistant", "content": "Paris."}]},
]


GATE_GROUPS = {"test_eval.py": "gate", "test_gate.py": "gate",
               "test_block_decoding.py": "dflash-gate", "test_gate_dflash.py": "dflash-gate"}
"""The files that decode with one of the session's gate runs (gate_run, dflash_gate_run): under
xdist one worker runs each group, so each run is built once."""

HEAVY_FIRST = ("test_block_decoding.py", "test_gate_dflash.py", "test_eval.py", "test_gate.py", "test_parallel.py",
               "test_train.py", "test_faults.py", "test_regen.py", "test_architectures.py", "test_capture.py")
"""The files that take longest (a minute or more on one core), first in the collection. xdist's
--dist loadfile hands the files out by their number of tests, most first (its default
--loadscope-reorder; sorted stably, so this order only breaks ties). Handing these out first
instead (--no-loadscope-reorder) was slower on 2026-12-06, 12:36 against 11:41 for the whole run:
their subprocesses and trainings then run at the same time on both workers."""


def pytest_collection_modifyitems(config, items):
    heavy = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: heavy.get(item.path.name, len(heavy)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The default run (`-n 2 --dist loadfile` in pyproject.toml) sends each file's tests to one
    worker, so a module fixture is built once; this scheduler also keeps each gate group's files
    together. (xdist's own `loadgroup` marks do not reach pytest 9's node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return GATE_GROUPS.get(Path(file).name, file)

    return ByFile(config, log)


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same RNG state."""
    random.seed(0)
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a model directory (converted once per machine)."""
    return resolve_target(EMBEDDED_DEFAULT)


@pytest.fixture(scope="session")
def smollm2_target(smollm2_dir):
    """SmolLM2 loaded once for the session (fp32 on the CPU), for the tests that run it in process."""
    from specfoundry.common.target import Target

    return Target.load(EMBEDDED_DEFAULT, device="cpu")


def parse_python(src: str):
    """ast.parse with the garbage collector held off: on CPython 3.11 (CI's 3.11.7) a finalizer that
    runs in the middle of the parse (an asyncio task another test left behind) shifts the recursion
    depth the AST constructor checks, and the parse fails with "AST constructor recursion depth
    mismatch" (cpython gh-106905)."""
    import ast
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(src)
    finally:
        if enabled:
            gc.enable()


@contextmanager
def torch_threads(n: int):
    """torch on n threads inside the block: a command run in this process computes as the
    processes a test starts with OMP_NUM_THREADS=n do (under xdist, already one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_command(main, args: list, exit_code: int = 0):
    """A specfoundry command (its click group `main`) run in this process as a child process with
    OMP_NUM_THREADS=1 and CUDA_VISIBLE_DEVICES="" runs it, to the byte: one torch thread, no CUDA
    device. No interpreter starts and nothing is imported again (a child's imports are most of a
    small command's time). Returns click's Result (.stdout, .stderr, .output: both); another exit
    status than `exit_code` raises with the command's traceback."""
    import traceback
    from unittest import mock

    from click.testing import CliRunner

    with torch_threads(1), mock.patch("torch.cuda.is_available", return_value=False):
        result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exit_code != exit_code:
        trace = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
        raise AssertionError(f"{' '.join(map(str, args))} exited {result.exit_code}:\n{result.output[-3000:]}\n{trace}")
    return result


def free_port() -> int:
    """A TCP port no one listens on now, for a torchrun launch's --master_port: the OS picks it (a
    bind to port 0), so two launches on the two xdist workers, or a fixed port another program
    holds, never meet (torchrun exits 1 with EADDRINUSE on a taken port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def copies(records: list[dict], n: int) -> list[dict]:
    """n copies of `records`, each under its own id (a source's ids are unique: a repeated one is
    reported as bad input)."""
    return [{**r, "id": f"{r.get('id', i)}-{k}"} for k in range(n) for i, r in enumerate(records)]


@pytest.fixture
def chat_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", CHAT)


@pytest.fixture(scope="session")
def gate_run(tmp_path_factory, smollm2_target):
    """The gate's one-conversation run on SmolLM2 (regen, capture, train, export), built once:
    an overfitted draft that the eval and gate tests decode with. 60 steps: it passes every gate
    check from step 40 on (teacher-forced accuracy 98%, acceptance length 5.00 at k=4)."""
    from specfoundry.gate import GateConfig, build

    cfg = GateConfig(output=str(tmp_path_factory.mktemp("gate")), max_steps=60, device="cpu")
    return cfg, build(cfg, smollm2_target)


@pytest.fixture(scope="session")
def dflash_gate_run(tmp_path_factory, smollm2_target):
    """The gate's one-conversation run with a DFlash draft (block 5, 5 layers), its answer cut at 48
    tokens: each step's cost is its loss over the full vocabulary, one [rows, V] chunk per slot,
    compute-bound on a CPU, and the cut answer fits sooner (80% of its block tokens at step 30, all
    at 40; the whole answer of about 55 tokens still 59% at 40), so 45 steps leave a margin."""
    from specfoundry.gate import GateConfig, build

    cfg = GateConfig(output=str(tmp_path_factory.mktemp("gate-dflash")), family="dflash", max_steps=45,
                     max_new_tokens=48, device="cpu")
    return cfg, build(cfg, smollm2_target)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama target (testing.TINY_SHAPE: width 64, 8 layers) with SmolLM2's tokenizer,
    saved once for the session: cheap to load, and every family's build reads it like a real one."""
    from specfoundry.testing import write_tiny_target

    return write_tiny_target("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def edited_export_refusal(out: Path, edit) -> str:
    """The one-line DraftLoadError of reading back the export at `out` once edit(config) has changed
    its config.json (a field an engine would refuse or misread)."""
    from specfoundry.families.folders import DraftLoadError, find_draft_files, locate_draft

    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError) as e:
        find_draft_files(locate_draft(out))
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def sharp_tiny_target(vocab: int = 6, seed: int = 0):
    """A random 4-layer Llama over a `vocab`-token vocabulary (seeded first), its head scaled so that
    its choices are sharp and a random draft often disagrees with it (rejections happen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60)
    return model


def holed_batch(lengths, seed: int, aux_width: int, final_width: int | None = None):
    """A batch of right-padded rows of `lengths` tokens (vocabulary 96) with holes in the loss mask (a
    prompt of 2, a gap at row 0's position 7): random ids, aux features [.., aux_width] and, where
    final_width is given, the target's final states; drawn in that order from one seeded generator."""
    from specfoundry.featureset.batch import Batch

    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    ids = torch.randint(0, 96, (n, width), generator=g)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    mask[:, :2] = False
    mask[0, 7] = False
    aux = torch.randn(n, width, aux_width, generator=g)
    final = torch.randn(n, width, final_width, generator=g) if final_width else None
    return Batch(ids, mask, aux, final, list(lengths), list(range(n)))


def assert_export_refuses_tensors(export_draft, draft, out, missing: str, misshaped: str, shape: tuple) -> None:
    """`export_draft(state, cfg, folder)` refuses the draft's state without tensor `missing`, and with
    `misshaped` of `shape`, each a ValueError naming the tensor, and writes no weights for either."""
    import re

    state = draft.state_dict()
    state.pop(missing)
    with pytest.raises(ValueError, match=rf"missing \['{re.escape(missing)}'\]"):
        export_draft(state, draft.cfg, out / "a")
    state = {**draft.state_dict(), misshaped: torch.zeros(*shape)}
    with pytest.raises(ValueError, match=rf"{re.escape(misshaped)} has shape \({', '.join(map(str, shape))}\)"):
        export_draft(state, draft.cfg, out / "b")
    assert not (out / "a" / "model.safetensors").exists() and not (out / "b" / "model.safetensors").exists()


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-square(df), Wilson-Hilferty approximation (no scipy)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
