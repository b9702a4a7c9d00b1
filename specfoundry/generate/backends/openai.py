"""Generation against OpenAI-compatible HTTP servers (SGLang, vLLM, llama.cpp servers): one, or a
fleet that survives servers dying or stalling (generate/backends/fleet.py).

Requests stream: as a turn's answer arrives, the conversation's next request is sent (`serve`),
so turns of different conversations interleave over the servers. A request the server refuses
(a 4xx) becomes a Generation with finish_reason "error", which the caller counts; the run stops
only when the fleet cannot go on (FleetError).
"""

from __future__ import annotations

import asyncio

import httpx

from specfoundry.conversations.records import ToolCall, arguments_value, with_json_arguments
from specfoundry.generate.backends.fleet import Fleet, FleetConfig, RequestFailed
from specfoundry.generate.backends.interface import (
    Generation,
    OnDone,
    Request,
    SamplingConfig,
    generate_by_serving,
)


class OpenAIBackend:
    name = "openai"

    def __init__(self, urls: str | list[str], model: str | None, target: str | None,
                 fleet: FleetConfig = FleetConfig()):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.model = model
        self.fleet = Fleet([u.rstrip("/") for u in self.urls], fleet)
        self.tokenizer = None
        if target:  # a local tokenizer, only for prompt-length checks; never fetched from a hub
            try:
                from specfoundry.common.target import load_tokenizer, resolve_target

                self.tokenizer = load_tokenizer(resolve_target(target))
            except ValueError:
                self.tokenizer = None

    def identity(self) -> dict:
        return {"backend": self.name, "servers": [s.url for s in self.fleet.servers], "model": self.model}

    def status(self) -> str:
        return self.fleet.status()

    def body(self, request: Request, sampling: SamplingConfig) -> tuple[str, dict]:
        """(path, JSON body) of one request."""
        body = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "seed": request.seed}
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # an extension SGLang, vLLM and llama.cpp accept
        if self.model:
            body["model"] = self.model
        if request.text is not None:
            return "/completions", {**body, "prompt": request.text}
        body["messages"] = [with_json_arguments(m) for m in request.messages]  # the API's form
        if request.tools:
            body["tools"] = list(request.tools)
        if request.template_kwargs:  # vLLM's and SGLang's servers pass these to the chat template
            body["chat_template_kwargs"] = dict(request.template_kwargs)
        return "/chat/completions", body

    @staticmethod
    def to_generation(data: dict, completion: bool) -> Generation:
        choice = data["choices"][0]
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
        if completion:
            return Generation(choice.get("text") or "", reason, None, tokens)
        message = choice.get("message") or {}
        calls = tuple(ToolCall(c["function"]["name"], returned_arguments(c["function"].get("arguments")))
                      for c in message.get("tool_calls") or ())
        # a reasoning parser's part: vLLM's and SGLang's `reasoning_content` (newer vLLM: `reasoning`)
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        return Generation(message.get("content") or "", reason, None, tokens, tool_calls=calls,
                          reasoning=reasoning if isinstance(reasoning, str) else None)

    async def answer(self, client: httpx.AsyncClient, request: Request, sampling: SamplingConfig) -> Generation:
        path, body = self.body(request, sampling)
        try:
            data = await self.fleet.post(client, path, body)
            return self.to_generation(data, request.text is not None)
        except (RequestFailed, KeyError, IndexError, TypeError, ValueError) as e:  # this request's own failure
            return Generation("", "error", None, 0, error=str(e) or type(e).__name__)

    async def stream(self, requests: list[Request], sampling: SamplingConfig, on_done: OnDone) -> None:
        self.fleet.changed = asyncio.Condition()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits) as client:

            async def one(request: Request):
                return request, await self.answer(client, request, sampling)

            pending, done = {asyncio.ensure_future(one(r)) for r in requests}, set()
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        request, generation = task.result()  # a FleetError ends the run here
                        pending |= {asyncio.ensure_future(one(r)) for r in on_done(request, generation) or ()}
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                # the same round's other failures: the run already ends with the first one's error;
                # read theirs so asyncio does not log each as "Task exception was never retrieved"
                for task in done:
                    if task.done() and not task.cancelled():
                        task.exception()

    def serve(self, requests: list[Request], sampling: SamplingConfig, on_done: OnDone) -> None:
        asyncio.run(self.stream(requests, sampling, on_done))

    def generate(self, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
        return generate_by_serving(self.serve, requests, sampling)


def returned_arguments(arguments):
    """A returned call's arguments (JSON text, or with some servers the object); text that is not
    JSON is kept as it is: it equals no recorded call's arguments."""
    try:
        return arguments_value(arguments)
    except ValueError:
        return arguments
