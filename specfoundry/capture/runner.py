"""The hf capture runner: target prefill with forward hooks on three decoder layers.

Only the base model runs (`model.model`), so the full-vocabulary logits are never computed;
its output is the final normed hidden state (the lm_head input). Forward hooks copy the three
aux layers' outputs as they are produced, so all layers' hidden states are never held at once.
"""

from __future__ import annotations

import torch


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle, high: the outputs of layers [1, L//2-1, L-4] (SGLang's EAGLE-3 default)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return base, layers


class HFCaptureRunner:
    def __init__(self, model, aux_layers: list[int]):
        self.model = model
        self.base, layers = decoder_layers(model)
        bad = [i for i in aux_layers if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's {len(layers)} layers")
        self.aux_layers = list(aux_layers)
        self.captured: dict[int, torch.Tensor] = {}
        for i in self.aux_layers:
            layers[i].register_forward_hook(self._hook(i))
        self.device = next(model.parameters()).device

    def _hook(self, index: int):
        def keep_output(module, args, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output

        return keep_output

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prefill a batch of token lists (right-padded: causal attention keeps padding out of
        every real token's features). Returns per sample (aux [T, 3H], final [T, H]) on CPU."""
        width = max(len(x) for x in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for r, x in enumerate(batch):
            ids[r, : len(x)] = torch.tensor(x)
            attention[r, : len(x)] = 1
        self.captured.clear()
        out = self.base(input_ids=ids.to(self.device), attention_mask=attention.to(self.device), use_cache=False)
        final = out.last_hidden_state  # [B, T, H]
        aux = torch.cat([self.captured[i] for i in self.aux_layers], dim=-1)  # [B, T, 3H]
        self.captured.clear()
        return [(aux[r, : len(x)].cpu(), final[r, : len(x)].cpu()) for r, x in enumerate(batch)]
