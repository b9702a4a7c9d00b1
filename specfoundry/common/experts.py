"""How a mixture-of-experts target runs its routed experts: transformers' experts interface.

transformers' MoE models (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, gpt-oss, ...) keep their routed
experts in one `@use_experts_implementation` module per layer, whose forward is looked up by the
name in `config._experts_implementation` at every call:

    eager       transformers' loop over the experts: the reference (CPU's default)
    grouped_mm  tokens sorted by expert, torch's grouped GEMM (a GPU's default)
    batched_mm  a gathered weight copy per token: small batches only (its memory grows with
                tokens x top_k x an expert's weights)
    sf_fused    specfoundry's Triton kernel (kernels/fused_moe.py), registered into the interface
                by the commands that offer it; CUDA, SiLU-gated experts without biases; `auto`'s
                choice on one GPU where it runs (resolve_experts)

transformers' other implementations (sonicmoe, deepgemm) load their kernels from a hub at run
time, which specfoundry never does, so they are not offered. Dense targets have no experts
module and ignore the choice. It changes how fast, not what: features agree within the
tolerance the tests state, so it is a placement setting (resume=False), not one of the output.
"""

from __future__ import annotations

import os

import torch

from specfoundry.common.placement import EXPERTS_IMPLEMENTATIONS, FUSED_EXPERTS, PlacementError

__all__ = ["EXPERTS_IMPLEMENTATIONS", "FUSED_EXPERTS", "experts_modules", "resolve_experts", "set_experts",
           "unsupported_layout"]


def resolve_experts(name: str, device_type: str, experts=None, devices: int = 1) -> str:
    """`auto` -> on a GPU, FUSED_EXPERTS where it can run `experts` (a routed-experts module of the
    model) in one process on one device (`devices`: how many the model is spread over), else
    grouped_mm; eager elsewhere. Any other name as it is (or a PlacementError). FUSED_EXPERTS is the
    fastest measured (docs/LOG.md: capture of the Qwen3-30B-A3B and
    DeepSeek-V3 shapes at 8k and 32k tokens a batch, one GPU); several processes (--tp, --ep) or
    devices (--device-map) keep grouped_mm, which was not measured against it there."""
    if name not in EXPERTS_IMPLEMENTATIONS:
        raise PlacementError(f"--experts-implementation {name!r}: choose one of {', '.join(EXPERTS_IMPLEMENTATIONS)}")
    if name == "auto":
        if device_type != "cuda":
            return "eager"
        fits = experts is not None and devices == 1 and fused_runs(experts, one_process=True) is None
        return FUSED_EXPERTS if fits else "grouped_mm"
    return name


def fused_runs(experts, one_process: bool = False) -> str | None:
    """Why FUSED_EXPERTS cannot run `experts` here, or None: the command must have registered it
    (a command offers it only after registering it), Triton must be installed, the layout must be
    the kernel's (unsupported_layout), and with `one_process` (auto's condition) one process runs."""
    from importlib.util import find_spec

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if FUSED_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        return "this command does not offer it"
    if find_spec("triton") is None:
        return "Triton is not installed"
    dist = torch.distributed
    if one_process and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "several processes"
    return unsupported_layout(experts)


def experts_modules(model) -> list:
    """The model's routed-experts modules (those transformers' experts interface dispatches): what
    its `use_experts_implementation` decorator marks, with the attributes every transformers 5 release
    that has the interface sets (5.17 has no `_is_expert_parallel`; 5.25 sets it too)."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")
            and hasattr(m, "is_transposed")]


def unsupported_layout(experts) -> str | None:
    """Why `experts` cannot run FUSED_EXPERTS (the kernel's layout: gate_up_proj [E, 2I, H] with the
    gate rows first, down_proj [E, H, I], SiLU(gate) * up, no biases), or None."""
    from torch import nn
    from transformers.activations import SiLUActivation

    name = type(experts).__name__
    if getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True) \
            or getattr(experts, "is_transposed", False):
        return f"{name} stores biased, interleaved or transposed expert weights (gpt-oss's layout)"
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        return f"{name} has no gate projection, or a norm after each expert"
    gate = getattr(type(experts), "_apply_gate", None)
    if not isinstance(getattr(experts, "act_fn", None), (SiLUActivation, nn.SiLU)) \
            or getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"{name}'s activation is not SiLU(gate) * up"
    return None


def set_experts(model, name: str, device_type: str) -> str | None:
    """Run `model`'s experts with `name` (resolved; see resolve_experts). Returns the name in use,
    None for a dense model. A PlacementError names what cannot run and the fallback."""
    modules = experts_modules(model)
    if not modules:
        return None
    devices = len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} or {None})
    name = resolve_experts(name, device_type, modules[0], devices)
    if name == FUSED_EXPERTS:
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise PlacementError(f"--experts-implementation {FUSED_EXPERTS} runs on a CUDA device; on "
                                 f"{device_type} use eager (or auto)")
        why = fused_runs(modules[0])
        if why:
            raise PlacementError(f"--experts-implementation {FUSED_EXPERTS}: {why}; use grouped_mm")
    model.set_experts_implementation(name)
    return name
