"""Decoder layers through torch.compile for prefill-only work (sf-capture `--compile-layers`).

A prefill of a large batch spends much of its time in elementwise work between the matmuls: the
RMSNorms in fp32 and their casts, Qwen3's per-head q/k norms, the rotary embedding, the residual
adds. Each is its own kernel, a full pass over [T, H] in HBM. Inductor fuses those chains. What
is compiled, per decoder layer:

    attention   the attention block (projections, q/k norms, rotary, attention) and the layer's two
                RMSNorms, each its own compiled module. The experts and the residual adds stay
                eager. benchmarks/capture_moe.py measured this one (benchmarks/RESULTS.md, "Regen and capture").
    layer       the decoder layer's whole forward but its routed experts, which dynamo leaves to their
                implementation (torch.compiler.disable: a graph break on each side; dynamo would
                otherwise trace into the fused kernel's launcher or transformers' loop). So the
                residual adds, the router and the shared experts fuse with the rest. Not measured
                on a GPU yet.

Both compile with dynamic shapes, once at the first call, shared by every layer of the model
(they run the same code on other weights). A compile replaces a module's `_compiled_call_impl`
(`attention`), or sets an instance `forward` (`layer`). Forward hooks on the decoder layers,
such as the aux-layer tap, stay outside the compiled code either way. It changes how fast, not
what: the features differ from eager ones by rounding only (tests/test_capture.py says by how
much), so it is a `resume=False` setting.
"""

from __future__ import annotations

import torch

from specfoundry.common.taps import decoder_layers

COMPILE_LAYERS = ("off", "attention", "layer")

BACKEND = "inductor"
"""torch.compile's backend. The tests run `aot_eager` on a CPU: it traces exactly what inductor
would compile, and its compile time fits the suite."""


def attention_parts(layer) -> list[torch.nn.Module]:
    """A decoder layer's attention block and its two norms (the `attention` choice)."""
    names = ("self_attn", "input_layernorm", "post_attention_layernorm")
    missing = [n for n in names if not isinstance(getattr(layer, n, None), torch.nn.Module)]
    if missing:
        raise ValueError(f"--compile-layers attention: {type(layer).__name__} has no {', '.join(missing)}; "
                         "use --compile-layers layer or off")
    return [getattr(layer, n) for n in names]


def compile_layers(model, how: str) -> None:
    """Run `model`'s decoder layers as `how` says (COMPILE_LAYERS); `off` undoes an earlier choice."""
    if how not in COMPILE_LAYERS:
        raise ValueError(f"--compile-layers {how!r}: choose one of {', '.join(COMPILE_LAYERS)}")
    from specfoundry.common.experts import experts_modules

    _, layers = decoder_layers(model)
    # every layer's parts first: a layer that lacks them is refused before any layer changes
    chosen = [attention_parts(layer) if how == "attention" else [] for layer in layers]
    for layer, parts in zip(layers, chosen, strict=True):
        for module in [layer] + list(layer.modules()):
            _use_call(module, compiled=module in parts)
        for experts in experts_modules(layer):
            _left_out(experts, how == "layer")
        _use_forward(layer, compiled=how == "layer")


def _left_out(experts, on: bool) -> None:
    """A routed-experts module whose forward dynamo does not trace (`on`), or traces again."""
    if on:
        experts.forward = torch.compiler.disable(type(experts).forward.__get__(experts))
    else:
        experts.__dict__.pop("forward", None)


def _use_call(module, compiled: bool) -> None:
    """`module` called through its compiled _call_impl (made once, kept on it), or eagerly again."""
    made = getattr(module, "_sf_compiled_call", None)
    if compiled and made is None:
        module.compile(dynamic=True, backend=BACKEND)
        made = module._sf_compiled_call = module._compiled_call_impl
    if compiled or made is not None:
        module._compiled_call_impl = made if compiled else None


def _use_forward(layer, compiled: bool) -> None:
    """The layer's forward compiled (an instance attribute made once, kept on it: its hooks run
    outside), or its class's forward again."""
    made = getattr(layer, "_sf_compiled_forward", None)
    if compiled:
        if made is None:
            made = layer._sf_compiled_forward = torch.compile(type(layer).forward.__get__(layer), dynamic=True,
                                                              backend=BACKEND)
        layer.forward = made
    else:
        layer.__dict__.pop("forward", None)
