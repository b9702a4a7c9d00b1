"""The generation backend interface and the sampling settings every backend honours.

A backend answers `Request`s. `serve(backend, requests, sampling, on_done)` generates every
request and every follow-up that `on_done(request, generation)` returns for it (the next turn of
that conversation): a backend with its own `serve` (hf's slot engine, the openai fleet) streams
them, the others answer in rounds (all pending requests at once, then their follow-ups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from specfoundry.common.settings import MAX_TOKENS, Range, Settings, setting, shared
from specfoundry.conversations.records import ToolCall


@dataclass(frozen=True, kw_only=True)
class SamplingConfig(Settings):
    """How each assistant turn is sampled."""

    temperature: float = setting(0.8, valid=Range(0, zero="greedy"),
                                 help="Sampling temperature (0.8 as in the SpecForge paper).")
    top_p: float = setting(1.0, valid=Range(0, 1, min_open=True), help="Nucleus sampling mass (1 = off).")
    top_k: int = setting(0, valid=Range(0, MAX_TOKENS, zero="off"), help="Sample only from the k most likely tokens.")
    # an answer that reaches the cap is 'truncated'
    max_new_tokens: int = shared("max_new_tokens", 512)
    # each request derives its own seed from this one, so reruns reproduce
    seed: int = shared("seed", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Generation:
    text: str  # the answer's text; where it calls tools, the text outside the calls
    finish_reason: str  # "stop" (end of turn), "length" (hit max_new_tokens) or "error"
    token_ids: tuple[int, ...] | None  # None where the backend does not return ids
    num_tokens: int
    error: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer makes (requests with tools only)
    reasoning: str | None = None  # a server's reasoning parser's part (reasoning_content), apart from text


@dataclass(frozen=True)
class Request:
    """One generation: the next assistant turn after `messages` (rendered with `tools`), or, when
    `text` is set, a raw continuation of that text (prompt synthesis)."""

    tag: object  # the caller's handle, handed back with the generation
    seed: int  # fixes what this request samples, whatever else is generated beside it
    messages: tuple[dict, ...] = ()
    tools: tuple[dict, ...] | None = None
    text: str | None = None
    template_kwargs: dict | None = None  # the chat template's arguments (the conversation's mode)

    def template_arguments(self) -> dict:
        """apply_chat_template's keyword arguments: the mode's, and the tools where there are some."""
        return {**(self.template_kwargs or {}), **({"tools": list(self.tools)} if self.tools else {})}


OnDone = Callable[[Request, Generation], Iterable[Request] | None]


class Backend(Protocol):
    name: str
    tokenizer: object | None  # a transformers tokenizer where the backend has one

    def generate(self, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
        """One generation per request, in order."""

    def identity(self) -> dict:
        """What to record in the manifest about the model behind this backend."""


def serve(backend: Backend, requests: list[Request], sampling: SamplingConfig, on_done: OnDone) -> None:
    """Generate `requests` and the follow-ups `on_done` returns, until none is left."""
    if hasattr(backend, "serve"):
        backend.serve(requests, sampling, on_done)
    else:
        serve_in_rounds(backend.generate, requests, sampling, on_done)


def generate_by_serving(serve_fn, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
    """One generation per request, in order, from a streaming backend's `serve`."""
    results: dict[int, Generation] = {}
    numbered = [replace(r, tag=i) for i, r in enumerate(requests)]
    serve_fn(numbered, sampling, lambda r, g: results.__setitem__(r.tag, g))
    return [results[i] for i in range(len(requests))]


def serve_in_rounds(generate, requests: list[Request], sampling: SamplingConfig, on_done: OnDone) -> None:
    """Every pending request in one `generate` call, then all their follow-ups in the next."""
    pending = list(requests)
    while pending:
        gens = generate(pending, sampling)
        pending = [nxt for r, g in zip(pending, gens, strict=True) for nxt in (on_done(r, g) or ())]


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integer parts; stable across processes (unlike hash())."""
    value = 0x9E3779B1
    for p in parts:
        value = (value * 1_000_003 ^ (p & 0xFFFFFFFF)) & 0x7FFFFFFF
    return value
