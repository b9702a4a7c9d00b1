"""The generation backend interface and the sampling settings every backend honours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How each assistant turn is sampled."""

    temperature: float = 0.8
    """0.8 as in the SpecForge paper; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 512
    """Cap on generated tokens per turn; an answer that hits it is 'truncated'."""
    seed: int = 0
    """Base seed; each generation call derives its own from it, so reruns reproduce."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Generation:
    text: str
    finish_reason: str  # "stop" (end of turn), "length" (hit max_new_tokens) or "error"
    token_ids: tuple[int, ...] | None  # None where the backend does not return ids
    num_tokens: int
    error: str | None = None


class Backend(Protocol):
    name: str
    tokenizer: object | None  # a transformers tokenizer where the backend has one

    def chat(self, prompts: list[list[dict]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        """Generate the next assistant turn for each message list."""

    def complete(self, prefixes: list[str], sampling: SamplingConfig, seed: int) -> list[Generation]:
        """Sample one raw continuation of each text prefix (used to synthesise user prompts)."""

    def identity(self) -> dict:
        """What to record in the manifest about the model behind this backend."""


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integer parts; stable across processes (unlike hash())."""
    value = 0x9E3779B1
    for p in parts:
        value = (value * 1_000_003 ^ (p & 0xFFFFFFFF)) & 0x7FFFFFFF
    return value


def make_backend(name: str, *, target: str, device: str | None, openai_url: str | None,
                 openai_model: str | None, concurrency: int, retries: int, batch_size: int) -> Backend:
    if name == "hf":
        from specfoundry.generate.hf_backend import HFBackend

        return HFBackend(target, device=device, batch_size=batch_size)
    if name == "openai":
        from specfoundry.generate.openai_backend import OpenAIBackend

        if not openai_url:
            raise ValueError("--backend openai needs --openai-url (e.g. http://127.0.0.1:30000/v1)")
        return OpenAIBackend(openai_url, model=openai_model, target=target,
                             concurrency=concurrency, retries=retries)
    if name == "sglang":
        from specfoundry.generate.sglang_backend import SGLangBackend

        return SGLangBackend(target, batch_size=batch_size)
    raise ValueError(f"unknown backend {name!r}: choose hf, openai or sglang")
