"""The aux-layer tap: forward hooks that keep chosen decoder layers' outputs.

Layer id i means "the output of decoder layer i" (0-based; HF's hidden_states[i + 1]), the
number SGLang's eagle_aux_hidden_state_layer_ids takes. Capture stores these outputs; sf-eval's
target hands the same ones to the draft while decoding.
"""

from __future__ import annotations

import torch


def spread_layers(num_layers: int, n: int) -> list[int]:
    """n distinct ids spread evenly over the tappable layers 0..L-2 (the last layer's output is the
    final state before the norm, which no engine taps): the small-target fallback of the defaults."""
    top = num_layers - 2
    if n > top + 1:
        raise ValueError(f"a target of {num_layers} layers has {top + 1} tappable layers (0..{top}), fewer than "
                         f"the {n} a draft reads: give the layers explicitly")
    if n == 1:
        return [top // 2]
    return [int(round(i * top / (n - 1))) for i in range(n)]


def parse_layer_ids(spec) -> tuple[int, ...] | None:
    """A layer list option (sf-capture --aux-layers, sf-train --layers): comma-separated decoder
    layer ids, or a recipe's list."""
    if spec is None:
        return None
    items = spec.split(",") if isinstance(spec, str) else spec
    try:
        ids = tuple(int(x) for x in items)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{spec!r} is not a comma-separated list of layer ids") from e
    if any(i < 0 for i in ids):
        raise ValueError(f"{spec!r}: a layer id is the output of decoder layer i, 0 or more")
    return ids


def decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return base, layers


class AuxLayerTap:
    """Forward hooks on chosen decoder layers that keep each layer's output of the latest
    forward, for the capture runner and for sf-eval's target alike."""

    def __init__(self, model, aux_layers: list[int], device: torch.device | None = None):
        """device: where take() gathers the layers' outputs (under a device map they come from
        several devices); None leaves them where they are."""
        _, layers = decoder_layers(model)
        bad = [i for i in aux_layers if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's {len(layers)} layers")
        self.aux_layers = list(aux_layers)
        self.device = device
        self.captured: dict[int, torch.Tensor] = {}
        self.hooks = [layers[i].register_forward_hook(self._keep(i)) for i in self.aux_layers]

    def _keep(self, index: int):
        def keep_output(module, args, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output

        return keep_output

    def clear(self) -> None:
        self.captured.clear()

    def take(self, *extra: torch.Tensor) -> torch.Tensor:
        """The kept outputs [..., K*H] in aux-layer order (then `extra`), concatenated on the last
        dim; forgets them."""
        kept = [self.captured[i] for i in self.aux_layers] + list(extra)
        if self.device is not None:
            kept = [x.to(self.device) for x in kept]
        out = torch.cat(kept, dim=-1)
        self.captured.clear()
        return out

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
