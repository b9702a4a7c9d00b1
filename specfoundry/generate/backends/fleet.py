"""A fleet of OpenAI-compatible servers: requests spread over them, a server that dies or stalls
taken out of rotation, and its requests retried on the others.

Each server takes at most `concurrency` requests at once; a request goes to the up server with
the most room (the first in the order given on a tie). A failed attempt (no connection, no answer
within the request timeout, HTTP 408/429/5xx, an answer that is not JSON) takes its server out
for a cooldown that doubles with each failure in a row; then the server gets one request at a
time until one succeeds (a circuit breaker's half-open state). A server that fails `max_failures`
times in a row is given up. Failures of requests that were already in flight when the server
went out do not count again. The failed request waits a backoff and goes to another server where
one is up, at most `retries` more times.

The run stops with a one-line FleetError when every server is given up, or when one request has
used all its tries. An answer that is the request's own fault (another 4xx) is no reason to stop:
it becomes that request's error (RequestFailed). A request is answered by one attempt only: the
caller receives exactly one result per request, so nothing is lost or written twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    concurrency: int = 16
    """Requests in flight at once per server."""
    retries: int = 4
    """Further tries of a request after its first fails."""
    request_timeout_s: float = 600.0
    """Seconds one server may take for one request."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection."""
    backoff_s: float = 0.5
    """Wait before a request's first retry; doubles for each further one."""
    max_backoff_s: float = 30.0
    cooldown_s: float = 2.0
    """Time out of rotation after a server's first failure; doubles for each failure in a row."""
    max_failures: int = 5
    """Failures in a row after which a server is given up."""


class FleetError(RuntimeError):
    """No server is left, or a request failed on every try: the run cannot go on."""


class RequestFailed(Exception):
    """The server refused the request itself (a 4xx other than 408/429): retrying will not help."""


@dataclass
class Server:
    url: str
    inflight: int = 0
    failures: int = 0  # in a row
    down_until: float = 0.0  # time.monotonic() at which its cooldown ends
    dead: bool = False
    last_error: str = ""

    def room(self, now: float, concurrency: int) -> int:
        if self.dead or now < self.down_until:
            return 0
        return (1 if self.failures else concurrency) - self.inflight

    def up(self, now: float) -> bool:
        """Healthy: answering (not given up, not cooling down, not on trial after a failure)."""
        return not self.dead and not self.failures and now >= self.down_until


def server_urls(urls: tuple[str, ...] | list[str], urls_file: str | None) -> list[str]:
    """--openai-url values then the lines of --openai-urls-file, each checked, duplicates removed."""
    found = [(u, f"--openai-url {u}") for u in urls]
    if urls_file:
        path = Path(urls_file)
        if not path.is_file():
            raise ValueError(f"--openai-urls-file {urls_file}: no such file")
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if line:
                found.append((line, f"{urls_file}:{n}"))
    out = []
    for url, where in found:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: {url!r} is not an http:// or https:// URL")
        url = url.rstrip("/")
        if url not in out:
            out.append(url)
    return out


class Fleet:
    """The servers' health (kept across runs) and the dispatch of one run's requests."""

    def __init__(self, urls: list[str], config: FleetConfig):
        self.servers = [Server(u) for u in urls]
        self.config = config
        self.changed: asyncio.Condition | None = None  # made inside each run's event loop

    def status(self) -> str:
        now = time.monotonic()
        return f"servers {sum(s.up(now) for s in self.servers)}/{len(self.servers)}"

    def no_server_left(self) -> FleetError:
        return FleetError("no server left: " + ", ".join(f"{s.url} ({s.last_error})" for s in self.servers))

    async def acquire(self, avoid: Server | None) -> Server:
        """A server with room (not `avoid` where another has room), its slot taken; waits while
        none has room."""
        async with self.changed:
            while True:
                if all(s.dead for s in self.servers):
                    raise self.no_server_left()
                now = time.monotonic()
                open_ = [s for s in self.servers if s.room(now, self.config.concurrency) > 0]
                if open_:
                    others = [s for s in open_ if s is not avoid] or open_
                    server = max(others, key=lambda s: s.room(now, self.config.concurrency))
                    server.inflight += 1
                    return server
                cooldowns = [s.down_until - now for s in self.servers if not s.dead and s.down_until > now]
                try:
                    await asyncio.wait_for(self.changed.wait(), min(cooldowns) if cooldowns else None)
                except TimeoutError:
                    pass

    async def release(self, server: Server, error: str | None) -> None:
        async with self.changed:
            server.inflight -= 1
            now = time.monotonic()
            if error is None:
                server.failures = 0
            elif now >= server.down_until:  # not out already: this failure is news
                server.failures += 1
                server.last_error = error
                if server.failures >= self.config.max_failures:
                    server.dead = True
                else:
                    server.down_until = now + self.config.cooldown_s * 2 ** (server.failures - 1)
            self.changed.notify_all()

    async def post(self, client: httpx.AsyncClient, path: str, body: dict) -> dict:
        """POST `body` to `path` on some server and return the JSON answer, retrying as the module
        docstring says."""
        cfg = self.config
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        server, problem = None, ""
        for attempt in range(cfg.retries + 1):
            server = await self.acquire(avoid=server)
            try:
                r = await client.post(server.url + path, json=body, timeout=timeout)
                if r.status_code not in RETRYABLE_STATUS:
                    data = r.json() if r.is_success else None
                    await self.release(server, None)
                    if data is None:
                        raise RequestFailed(f"HTTP {r.status_code} from {server.url}: {r.text[:200]}")
                    return data
                problem = f"HTTP {r.status_code}"
            except httpx.TimeoutException:
                problem = f"no answer within {cfg.request_timeout_s:g} s"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except ValueError:  # the body is not JSON: a server cut off mid-answer
                problem = "an answer that is not JSON"
            await self.release(server, problem)
            if all(s.dead for s in self.servers):
                raise self.no_server_left()
            if attempt < cfg.retries:
                await asyncio.sleep(min(cfg.backoff_s * 2**attempt, cfg.max_backoff_s))
        raise FleetError(f"a request failed with no retries left (--retries {cfg.retries}); its last try, on "
                         f"{server.url}: {problem}")
