"""The generation backend interface and the sampling settings every backend honours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specfoundry.common.cli import setting, shared


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How each assistant turn is sampled."""

    temperature: float = setting(0.8, help="Sampling temperature (0.8 as in the SpecForge paper; 0 is greedy).")
    top_p: float = setting(1.0, help="Nucleus sampling mass (1 = off).")
    top_k: int = setting(0, help="Sample only from the k most likely tokens (0 = off).")
    # an answer that reaches the cap is 'truncated'
    max_new_tokens: int = shared("max_new_tokens", 512)
    # each generation call derives its own seed from this one, so reruns reproduce
    seed: int = shared("seed", 0)

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


BACKENDS = ("hf", "openai", "sglang")


def make_backend(cfg) -> Backend:
    """The backend a RegenConfig names, loaded (its target too)."""
    if cfg.backend == "hf":
        from specfoundry.generate.hf_backend import HFBackend

        return HFBackend(cfg.target, device=cfg.device, batch_size=cfg.batch_size, chat_template=cfg.chat_template)
    if cfg.backend == "openai":
        from specfoundry.generate.openai_backend import OpenAIBackend

        if cfg.chat_template is not None:
            raise ValueError("--chat-template renders conversations here (hf and sglang backends); an OpenAI-compatible "
                             "server renders them with its own template: start the server with that template")
        if not cfg.openai_url:
            raise ValueError("--backend openai needs --openai-url (e.g. http://127.0.0.1:30000/v1)")
        return OpenAIBackend(cfg.openai_url, model=cfg.openai_model, target=cfg.target,
                             concurrency=cfg.concurrency, retries=cfg.retries)
    if cfg.backend == "sglang":
        from specfoundry.generate.sglang_backend import SGLangBackend

        return SGLangBackend(cfg.target, batch_size=cfg.batch_size, chat_template=cfg.chat_template)
    raise ValueError(f"unknown backend {cfg.backend!r}: choose {', '.join(BACKENDS)}")
