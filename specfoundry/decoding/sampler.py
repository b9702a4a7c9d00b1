"""How the next token is picked: greedily, or by sampling from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampler:
    """Greedy when temperature == 0, else sampling at that temperature from a seeded generator."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.greedy else self.sample(self.probs(logits))
