"""Generation with transformers in this process.

Two engines, chosen by --hf-engine:
- `slots` (generate/backends/slots.py): continuous batching over a per-slot KV cache; requests of
  different conversations stream through it, each follow-up turn joining as soon as it is made;
- `generate`: `model.generate` over length-sorted, left-padded batches, in rounds (every pending
  request of a turn at once). It drives any model transformers can generate with.
`auto` takes `slots` on a GPU wherever the engine can drive the model (slots.supported), else
`generate`: on a CPU the same weight matmuls bound both (measured equal at batch 1, the gate's
one-conversation regen and a SmolLM2 decode step: docs/LOG.md), so the engine that
drives any model is taken.
Greedy output is the same token for token; samples differ (slots draws per request,
generate per batch).
"""

from __future__ import annotations

import torch

from specfoundry.common.target import Target
from specfoundry.generate.backends.interface import (
    Generation,
    OnDone,
    Request,
    SamplingConfig,
    generate_by_serving,
    serve_in_rounds,
)
from specfoundry.generate.backends.slots import SlotEngine, supported
from specfoundry.generate.tools import parse_tool_calls

ENGINES = ("auto", "slots", "generate")


class HFBackend:
    name = "hf"

    def __init__(self, target: Target, batch_size: int = 32, *, engine: str = "auto"):
        """Generate with `target` (loaded and placed: Target.load; its tokenizer renders with the
        chat template it was loaded with)."""
        self.target = target
        self.ranks = target.ranks
        self.model, self.tokenizer = target.model, target.tokenizer
        self.device = target.input_device
        self.batch_size = batch_size
        self.stop_ids = target.end_of_turn_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        if engine not in ENGINES:
            raise ValueError(f"--hf-engine takes one of {', '.join(ENGINES)}, not {engine!r}")
        if engine == "slots" and not supported(self.model):
            raise ValueError("--hf-engine slots cannot drive this model (its attention is neither full nor "
                             "sliding-window over sdpa or eager): use --hf-engine generate")
        fast = self.device.type == "cuda" and supported(self.model)
        self.engine = engine if engine != "auto" else ("slots" if fast else "generate")

    def identity(self) -> dict:
        identity = self.target.identity
        target = identity.to_dict() if identity else {"name": str(self.model.config.name_or_path)}
        return {"backend": self.name, **target, "dtype": str(self.model.dtype), "engine": self.engine}

    def render(self, request: Request) -> list[int]:
        """Token ids of the chat template up to the start of the next assistant turn (with the
        request's tools and template arguments)."""
        text = self.tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True, tokenize=False,
                                                  **request.template_arguments())
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, request: Request) -> list[int]:
        if request.text is not None:
            return self.tokenizer(request.text, add_special_tokens=False)["input_ids"]
        return self.render(request)

    # ---- serving ----------------------------------------------------------------------------

    def serve(self, requests: list[Request], sampling: SamplingConfig, on_done: OnDone) -> None:
        """Generate `requests` and their follow-ups (backend.serve)."""
        if self.engine == "generate":
            serve_in_rounds(self.generate, requests, sampling, on_done)
            return
        engine = SlotEngine(self.target, slots=self.batch_size, stop_ids=self.stop_ids, sampling=sampling)

        def finished(request: Request, tokens: list[int]):
            follow = on_done(request, self.to_generation(tokens, request))
            return [(self.prompt_ids(r), r.seed, r) for r in follow or ()]

        engine.run([(self.prompt_ids(r), r.seed, r) for r in requests], finished)

    def generate(self, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
        if self.engine == "slots":
            return generate_by_serving(self.serve, requests, sampling)
        return self.generate_batches(requests, sampling)

    @torch.inference_mode()
    def generate_batches(self, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
        """`model.generate` on batches of similar length, longest first, so padding stays small.
        The first request's seed seeds the whole call, so the same call gives the same text."""
        prompts = [self.prompt_ids(r) for r in requests]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        torch.manual_seed(requests[0].seed if requests else 0)
        kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if not sampling.greedy:
            kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or None)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T] left-padded
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attention[row, width - len(prompts[i]) :] = 1
            out = self.target.generate(
                input_ids,
                attention_mask=attention,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                **kwargs,
            )
            new = out[:, width:].tolist()  # [B, <= max_new_tokens]
            for row, i in enumerate(batch):
                results[i] = self.to_generation(new[row], requests[i])
        return results  # type: ignore[return-value]

    def to_generation(self, ids: list[int], request: Request) -> Generation:
        """The answer up to its first stop token; its tool calls parsed where the request has tools."""
        reason = "length"
        for pos, tok in enumerate(ids):
            if tok in self.stop_ids:
                ids, reason = ids[:pos], "stop"
                break
        text, calls = self.tokenizer.decode(ids), ()
        if request.tools:
            text, calls = parse_tool_calls(text)
        return Generation(text, reason, tuple(ids), len(ids), tool_calls=calls)
