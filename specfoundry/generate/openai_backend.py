"""Generation against an OpenAI-compatible HTTP server (SGLang, vLLM, llama.cpp servers).

Requests run concurrently (at most ``concurrency`` in flight) with retries and exponential
backoff on connection errors, timeouts, 429 and 5xx. A request that still fails becomes a
Generation with finish_reason "error": the caller counts it, the run goes on.
"""

from __future__ import annotations

import asyncio

import httpx

from specfoundry.generate.backend import Generation, SamplingConfig

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str, model: str | None, target: str | None,
                 concurrency: int = 16, retries: int = 4, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.concurrency = concurrency
        self.retries = retries
        self.timeout_s = timeout_s
        self.tokenizer = None
        if target:  # a local tokenizer, only for prompt-length checks; never fetched from a hub
            try:
                from specfoundry.common.target import load_tokenizer, resolve_target

                self.tokenizer = load_tokenizer(resolve_target(target))
            except ValueError:
                self.tokenizer = None

    def identity(self) -> dict:
        return {"backend": self.name, "base_url": self.base_url, "model": self.model}

    def payload(self, sampling: SamplingConfig, seed: int) -> dict:
        body = {
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # an extension SGLang, vLLM and llama.cpp accept
        if self.model:
            body["model"] = self.model
        return body

    async def post(self, client: httpx.AsyncClient, gate: asyncio.Semaphore, path: str, body: dict) -> dict:
        delay = 0.5
        for attempt in range(self.retries + 1):
            async with gate:
                try:
                    r = await client.post(self.base_url + path, json=body)
                    if r.status_code not in RETRYABLE_STATUS:
                        r.raise_for_status()
                        return r.json()
                    problem = f"HTTP {r.status_code}"
                except (httpx.TransportError, httpx.TimeoutException) as e:
                    problem = f"{type(e).__name__}: {e}"
            if attempt == self.retries:
                raise RuntimeError(f"{path} failed after {self.retries + 1} tries: {problem}")
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    @staticmethod
    def to_generation(choice: dict, text: str, usage: dict | None) -> Generation:
        reason = choice.get("finish_reason") or "stop"
        reason = "length" if reason == "length" else "stop"
        tokens = (usage or {}).get("completion_tokens", 0)
        return Generation(text, reason, None, int(tokens))

    async def run_all(self, path: str, bodies: list[dict], text_of) -> list[Generation]:
        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:

            async def one(body: dict) -> Generation:
                try:
                    data = await self.post(client, gate, path, body)
                    choice = data["choices"][0]
                    return self.to_generation(choice, text_of(choice), data.get("usage"))
                except Exception as e:  # noqa: BLE001 - any failure is recorded per request
                    return Generation("", "error", None, 0, error=str(e))

            return list(await asyncio.gather(*(one(b) for b in bodies)))

    def chat(self, prompts: list[list[dict]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        bodies = [{**self.payload(sampling, seed + i), "messages": m} for i, m in enumerate(prompts)]
        return asyncio.run(self.run_all("/chat/completions", bodies, lambda c: c["message"]["content"] or ""))

    def complete(self, prefixes: list[str], sampling: SamplingConfig, seed: int) -> list[Generation]:
        bodies = [{**self.payload(sampling, seed + i), "prompt": p} for i, p in enumerate(prefixes)]
        return asyncio.run(self.run_all("/completions", bodies, lambda c: c.get("text") or ""))
