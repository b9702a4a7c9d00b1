"""Generation with transformers: batched, length-sorted, left-padded `model.generate`."""

from __future__ import annotations

import torch

from specfoundry.common.target import end_of_turn_ids, load_target
from specfoundry.generate.backend import Generation, SamplingConfig


class HFBackend:
    name = "hf"

    def __init__(self, target: str | None, device: str | None = None, batch_size: int = 32, *, model=None,
                 tokenizer=None, chat_template: str | None = None):
        """Load `target` (its tokenizer rendering with `chat_template`), or wrap an already loaded
        (model, tokenizer) when target is None."""
        if target is None:
            self.model, self.tokenizer, self.target = model, tokenizer, None
        else:
            self.model, self.tokenizer, self.target = load_target(target, device=device, chat_template=chat_template)
        self.device = next(self.model.parameters()).device
        self.batch_size = batch_size
        self.stop_ids = end_of_turn_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]

    def identity(self) -> dict:
        target = self.target.to_dict() if self.target else {"name": str(self.model.config.name_or_path)}
        return {"backend": self.name, **target, "dtype": str(self.model.dtype)}

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat template up to the start of the next assistant turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, prompts: list[list[dict]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        return self.generate_ids([self.render(m) for m in prompts], sampling, seed)

    def complete(self, prefixes: list[str], sampling: SamplingConfig, seed: int) -> list[Generation]:
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes],
                                 sampling, seed)

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        """Generate for token-id prompts. Longest first, in batches of similar length, so
        padding stays small; the seed is set per call, so the same call gives the same text."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        torch.manual_seed(seed)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T] left-padded
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attention[row, width - len(prompts[i]) :] = 1
            kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            if not sampling.greedy:
                kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k or None)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                **kwargs,
            )
            new = out[:, width:].tolist()  # [B, <= max_new_tokens]
            for row, i in enumerate(batch):
                results[i] = self.to_generation(new[row])
        return results  # type: ignore[return-value]

    def to_generation(self, ids: list[int]) -> Generation:
        for pos, tok in enumerate(ids):
            if tok in self.stop_ids:
                kept = ids[:pos]
                return Generation(self.tokenizer.decode(kept), "stop", tuple(kept), len(kept))
        return Generation(self.tokenizer.decode(ids), "length", tuple(ids), len(ids))
