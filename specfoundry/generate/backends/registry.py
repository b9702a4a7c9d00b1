"""The generation backends by name: what sf-regen's --backend picks, loaded with its target.
Each backend module is imported here on first use, so interface.py, which every backend imports,
imports none of them."""

from __future__ import annotations

from specfoundry.generate.backends.interface import Backend

BACKENDS = ("hf", "openai", "sglang")


def make_backend(cfg) -> Backend:
    """The backend a RegenConfig names, loaded (its target too)."""
    if cfg.backend == "hf":
        from specfoundry.common.placement import FUSED_EXPERTS
        from specfoundry.common.settings import resume_settings
        from specfoundry.common.target import Target
        from specfoundry.generate.backends.hf import HFBackend
        from specfoundry.kernels.fused_moe import register_fused_experts

        register_fused_experts(FUSED_EXPERTS)  # so that --experts-implementation can name it
        target = Target.load(cfg.target, device=cfg.device, placement=cfg.placement, chat_template=cfg.chat_template,
                             command="sf-regen run",
                             settings=resume_settings(cfg))
        return HFBackend(target, batch_size=cfg.batch_size, engine=cfg.hf_engine)
    if cfg.placement != type(cfg.placement)():
        if cfg.backend == "openai":
            raise ValueError("--tp, --ep and --device-map place the target of the hf and sglang backends; OpenAI-compatible "
                             "servers place their own (vllm serve --tensor-parallel-size N, sglang --tp N: "
                             "docs/scaling.md)")
        if cfg.placement.device_map:
            raise ValueError("--device-map places the hf backend's target; the sglang backend takes --tp / --ep")
    if cfg.backend == "openai":
        from specfoundry.generate.backends.fleet import FleetConfig, server_urls
        from specfoundry.generate.backends.openai import OpenAIBackend

        if cfg.chat_template is not None:
            raise ValueError("--chat-template renders conversations here (hf and sglang backends); an OpenAI-compatible "
                             "server renders them with its own template: start the server with that template")
        urls = server_urls(cfg.openai_url, cfg.openai_urls_file)
        if not urls:
            raise ValueError("--backend openai needs --openai-url (e.g. http://127.0.0.1:30000/v1) or --openai-urls-file")
        fleet = FleetConfig(concurrency=cfg.concurrency, retries=cfg.retries, request_timeout_s=cfg.request_timeout)
        return OpenAIBackend(urls, model=cfg.openai_model, target=cfg.target, fleet=fleet)
    if cfg.backend == "sglang":
        from specfoundry.generate.backends.sglang import SGLangBackend

        return SGLangBackend(cfg.target, batch_size=cfg.batch_size, chat_template=cfg.chat_template,
                             tp=cfg.placement.tp, ep=cfg.placement.ep)
    raise ValueError(f"unknown backend {cfg.backend!r}: choose {', '.join(BACKENDS)}")
