"""The openai backend over a fleet of fake in-process servers: requests spread over them, a server
that dies or stalls is taken out and its requests retried on the others, nothing lost or written
twice; the run stops in one line only when no server is left or a request used all its tries."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specfoundry.generate.backends.fleet import FleetConfig, FleetError, server_urls
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.backends.openai import OpenAIBackend
from specfoundry.generate.cli import main as regen_cli
from specfoundry.generate.regen import RegenConfig, run_regen
from tests.conftest import CHAT, write_jsonl

FAST = FleetConfig(concurrency=2, retries=3, request_timeout_s=1.0, connect_timeout_s=1.0, backoff_s=0.01,
                   cooldown_s=0.05, max_failures=2)


class FakeServer:
    """An OpenAI-compatible server whose answer is a function of the request alone (as greedy
    decoding is). `mode`: 'ok'; 'die' (after `after` answers it cuts every connection, as a killed
    server would); 'stall' (after `after` answers it never answers); 'busy' (503 always);
    'refuse' (400 to prompts containing `refuse`)."""

    def __init__(self, mode: str = "ok", after: int = 0, refuse: str | None = None):
        self.mode, self.after, self.refuse = mode, after, refuse
        self.answered = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.reply(200, {"data": [{"id": "fake"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, answer = server.answer(body)
                if code is None:  # the server is gone: no answer, the connection cut
                    self.close_connection = True
                    self.connection.close()
                    return
                self.reply(code, answer)

            def reply(self, code, data):
                raw = json.dumps(data).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, body: dict):
        with self.lock:
            gone = self.mode in ("die", "stall") and self.answered >= self.after
            if not gone:
                self.answered += 1
        if gone and self.mode == "stall":
            self.stop.wait(30)
            return None, None
        if gone:
            return None, None
        if self.mode == "busy":
            return 503, {"error": "busy"}
        prompt = json.dumps(body.get("messages", body.get("prompt")))
        if self.refuse and self.refuse in prompt:
            return 400, {"error": "prompt refused"}
        text = f"reply {len(body['messages'])} to {body['messages'][-1]['content']}"
        return 200, {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 4}}

    def close(self):
        self.stop.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers():
    made = []

    def make(*args, **kwargs):
        made.append(FakeServer(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def regen(tmp_path, name, urls, source, fleet=FAST):
    backend = OpenAIBackend([s.url for s in urls], model=None, target=None, fleet=fleet)
    cfg = RegenConfig(output=str(tmp_path / name), source=str(source), backend="openai", shard_size=4,
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=8))
    manifest = run_regen(cfg, backend, silent=True)
    rows = [r for p in sorted((tmp_path / name / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    return manifest, rows, backend


def test_a_dying_and_a_stalling_server_lose_nothing(tmp_path, servers):
    """The healthy server must never be given up: its requests get 2.5 s (FAST's 1 s could pass on a
    loaded runner, GC or another worker holding the process) and it is given up only after 3 such
    failures in a row, so only the stalled server's requests time out. The reference run, on one
    healthy server, keeps FleetConfig's default timeouts."""
    chats = [{**c, "id": f"{c['id']}-{k}"} for k in range(4) for c in CHAT]  # 24 conversations, 28 turns
    src = write_jsonl(tmp_path / "chat.jsonl", chats)
    _, reference, _ = regen(tmp_path, "one", [servers()], src, fleet=FleetConfig(concurrency=2, backoff_s=0.01))
    fleet = [servers(), servers("die", after=3), servers("stall", after=2)]
    manifest, written, backend = regen(tmp_path, "fleet", fleet, src,
                                       fleet=dataclasses.replace(FAST, request_timeout_s=2.5, max_failures=3))
    assert written == reference  # every conversation once, in order, with the same answers
    assert [r["id"] for r in written] == [c["id"] for c in chats]
    assert manifest["totals"]["turns_ok"] == 28 and manifest["totals"]["turns_failed"] == 0
    assert fleet[0].answered > 0 and fleet[1].answered == 3 and fleet[2].answered == 2  # the work was spread
    # whether the dead and the stalled server have failed often enough to be given up by the end
    # depends on timing; test_no_server_left_stops_the_run_in_one_line checks giving up
    assert re.fullmatch(r"servers [1-3]/3", backend.status()), backend.status()


def test_no_server_left_stops_the_run_in_one_line(tmp_path, servers):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    dead = [servers("die"), servers("die")]
    with pytest.raises(FleetError, match=r"^no server left: http://127\.0\.0\.1:\d+/v1 \(RemoteProtocolError"):
        regen(tmp_path, "dead", dead, src)
    unreachable = "http://127.0.0.1:9/v1"
    result = CliRunner().invoke(regen_cli, ["run", str(src), "-o", str(tmp_path / "cli"), "--backend", "openai",
                                            "--openai-url", unreachable, "--retries", "0", "--silent"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith(f"Error: a request failed with no retries left (--retries 0); its last try, on "
                                f"{unreachable}: ConnectError")


def test_a_request_that_fails_every_try_stops_the_run(tmp_path, servers):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    patient = FleetConfig(retries=2, backoff_s=0.01, cooldown_s=0.01, max_failures=100)
    with pytest.raises(FleetError, match=r"^a request failed with no retries left \(--retries 2\); its last try, on "
                                         r"http://.*: HTTP 503$"):
        regen(tmp_path, "busy", [servers("busy")], src, fleet=patient)


def test_a_refused_request_is_counted_and_the_run_goes_on(tmp_path, servers):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    manifest, written, _ = regen(tmp_path, "refuse", [servers(refuse="capital of France")], src)
    assert manifest["totals"]["turns_failed"] == 1 and manifest["totals"]["dropped_failed"] == 1
    assert [r["id"] for r in written] == ["c0", "c1", "c2", "c3", "c4"]


def test_server_urls_from_options_and_a_file(tmp_path):
    f = tmp_path / "servers.txt"
    f.write_text("# the fleet\nhttp://a:1/v1/\n\nhttp://b:2/v1  # second\nhttp://a:1/v1\n")
    assert server_urls(("http://c:3/v1",), str(f)) == ["http://c:3/v1", "http://a:1/v1", "http://b:2/v1"]
    f.write_text("http://a:1/v1\nb:2/v1\n")
    with pytest.raises(ValueError, match=rf"^{f}:2: 'b:2/v1' is not an http:// or https:// URL$"):
        server_urls((), str(f))
    source = tmp_path / "x.jsonl"  # (a source with a conversation: a missing or empty one is named first)
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    result = CliRunner().invoke(regen_cli, ["run", str(source), "-o", str(tmp_path / "o"), "--backend", "openai",
                                            "--openai-urls-file", str(f)])
    assert result.exit_code == 2 and f"Error: {f}:2: 'b:2/v1' is not an http" in result.output


def test_the_progress_line_shows_the_servers_up(servers):
    backend = OpenAIBackend([servers().url, servers().url], model=None, target=None, fleet=FAST)
    assert backend.status() == "servers 2/2"
    backend.fleet.servers[1].down_until = time.monotonic() + 60
    assert backend.status() == "servers 1/2"
