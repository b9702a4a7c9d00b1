"""Generation with SGLang's offline engine (`sglang.Engine`), an optional extra.

SGLang needs a CUDA torch and CUDA-only kernels, so it is not a dependency: selecting this
backend without it installed fails at once with how to install it.
"""

from __future__ import annotations

from specfoundry.common.target import load_tokenizer, resolve_target, target_identity
from specfoundry.generate.backends.interface import Generation, Request, SamplingConfig
from specfoundry.generate.tools import parse_tool_calls

INSTALL_HINT = "the sglang backend needs SGLang: pip install 'specfoundry[sglang]' on a CUDA machine"


class SGLangBackend:
    name = "sglang"

    def __init__(self, target: str, batch_size: int = 256, chat_template: str | None = None, tp: int = 1,
                 ep: int = 1):
        """tp / ep: the engine's own tensor / expert parallelism (SGLang starts a worker per GPU
        itself: sf-regen runs as one process, not under torchrun)."""
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(INSTALL_HINT) from e
        path = resolve_target(target)
        self.target = target_identity(target, path)
        self.tokenizer = load_tokenizer(path, chat_template)  # the engine is handed rendered text
        parallel = {"tp_size": max(tp, ep), **({"ep_size": ep} if ep > 1 else {})}
        self.engine = sglang.Engine(model_path=str(path), max_running_requests=batch_size, **parallel)

    def identity(self) -> dict:
        return {"backend": self.name, **self.target.to_dict()}

    def params(self, sampling: SamplingConfig, seed: int) -> dict:
        return {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "max_new_tokens": sampling.max_new_tokens,
            "sampling_seed": seed,
        }

    def text(self, request: Request) -> str:
        if request.text is not None:
            return request.text
        return self.tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True,
                                                  tokenize=False, **request.template_arguments())

    def generate(self, requests: list[Request], sampling: SamplingConfig) -> list[Generation]:
        outputs = self.engine.generate([self.text(r) for r in requests],
                                       [self.params(sampling, r.seed) for r in requests])
        gens = []
        for request, out in zip(requests, outputs, strict=True):
            meta = out.get("meta_info", {})
            reason = (meta.get("finish_reason") or {}).get("type", "stop")
            ids = meta.get("output_ids")
            text, calls = parse_tool_calls(out["text"]) if request.tools else (out["text"], ())
            gens.append(Generation(text, "length" if reason == "length" else "stop", tuple(ids) if ids else None,
                                   int(meta.get("completion_tokens", 0)), tool_calls=calls))
        return gens
