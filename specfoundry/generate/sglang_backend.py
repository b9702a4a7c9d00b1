"""Generation with SGLang's offline engine (`sglang.Engine`), an optional extra.

SGLang needs a CUDA torch and CUDA-only kernels, so it is not a dependency: selecting this
backend without it installed fails at once with how to install it.
"""

from __future__ import annotations

from specfoundry.common.target import load_tokenizer, resolve_target, target_identity
from specfoundry.generate.backend import Generation, SamplingConfig

INSTALL_HINT = "the sglang backend needs SGLang: pip install 'specfoundry[sglang]' on a CUDA machine"


class SGLangBackend:
    name = "sglang"

    def __init__(self, target: str, batch_size: int = 256, chat_template: str | None = None):
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(INSTALL_HINT) from e
        path = resolve_target(target)
        self.target = target_identity(target, path)
        self.tokenizer = load_tokenizer(path, chat_template)  # the engine is handed rendered text
        self.engine = sglang.Engine(model_path=str(path), max_running_requests=batch_size)

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

    def generate_text(self, prompts: list[str], sampling: SamplingConfig, seed: int) -> list[Generation]:
        outputs = self.engine.generate(prompts, [self.params(sampling, seed + i) for i in range(len(prompts))])
        gens = []
        for out in outputs:
            meta = out.get("meta_info", {})
            reason = (meta.get("finish_reason") or {}).get("type", "stop")
            ids = meta.get("output_ids")
            gens.append(Generation(out["text"], "length" if reason == "length" else "stop",
                                   tuple(ids) if ids else None, int(meta.get("completion_tokens", 0))))
        return gens

    def chat(self, prompts: list[list[dict]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
        return self.generate_text(texts, sampling, seed)

    def complete(self, prefixes: list[str], sampling: SamplingConfig, seed: int) -> list[Generation]:
        return self.generate_text(prefixes, sampling, seed)
