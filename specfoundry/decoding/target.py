"""The target over a KV cache of one sequence, as every family's decoder verifies with it."""

from __future__ import annotations

import torch

from specfoundry.common.target import Target


class TargetRunner:
    """The target (common/target.Target) with a KV cache for one sequence; its tap keeps the aux
    layers' outputs of each call."""

    def __init__(self, target: Target, aux_layers: list[int]):
        from transformers import DynamicCache

        self.target = target
        self.model = target.model
        self.tap = target.tap(aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.device = target.input_device
        self.cache_cls = DynamicCache
        self.cache = None

    def remove_hooks(self) -> None:
        self.tap.remove()

    def reset(self) -> None:
        # A cache of full length in every layer, also the sliding-window ones (Gemma-3, Mistral):
        # the model still masks each sliding layer to its window, and a rejected draft can be
        # cropped away anywhere (transformers' windowed layers cannot roll back past the window).
        self.cache = self.cache_cls()

    def __len__(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], want_hidden: bool = False, positions: list[int] | None = None,
                mask: torch.Tensor | None = None):
        """Read `ids` after the cache. Returns logits [T, V] (fp32), aux [T, 3H] and, if asked,
        the final normed hidden state [T, H]. By default the tokens follow the cache causally;
        a token tree passes its own `positions` and `mask` ([T, cache + T] bool, True = may
        attend), which goes to the model as a ready 4D additive mask (Target.attention_masks)."""
        if self.cache is None:
            self.reset()
        start = len(self)
        x = torch.tensor([ids], device=self.device)
        if positions is None:
            positions = list(range(start, start + len(ids)))
        custom = None
        if mask is not None:
            keys = torch.cat([torch.arange(start), torch.tensor(positions)])  # [start + T] key positions
            custom = self.target.attention_masks(mask[None].to(self.device), torch.tensor([positions], device=self.device),
                                                 keys[None].to(self.device), additive=True)
        step = self.target.forward(x, positions=torch.tensor([positions], device=self.device), mask=custom,
                                   cache=self.cache, hidden=want_hidden)
        self.cache = step.cache
        aux = self.tap.take()[0]  # [T, 3H]
        final = step.final[0] if want_hidden else None
        return step.logits[0], aux, final

    def crop(self, length: int) -> None:
        # A negative argument removes that many tokens in every transformers version we support
        # (a positive one means an absolute length in some and is refused in others).
        remove = len(self) - length
        if remove:
            self.cache.crop(-remove)
