"""The target: what it is (resolution, identity, chat template) and the one object that runs it.

`Target` is the only place that calls `from_pretrained` on the target. It places the model
(common/placement.py: one device, accelerate's device map, or tensor / expert parallel groups),
owns the process groups and the rank roles, taps the aux layers (gathered on one device), and
runs it two ways: `prefill` (the base model without a cache or logits: capture) and `forward`
(the causal LM over a KV cache: a decode step, a verify, a slot engine's step). Every stage that
runs the target goes through it; lm_head and embeddings come from the weight files
(common/weights.py), never from a live module, which is only a shard under tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from specfoundry.common.embedded import EMBEDDED, EMBEDDED_DEFAULT, TargetError, convert_embedded
from specfoundry.common.experts import set_experts
from specfoundry.common.placement import Placement, PlacementError, Ranks, join_launch, launch_env
from specfoundry.common.taps import AuxLayerTap, decoder_layers

__all__ = ["EMBEDDED", "EMBEDDED_DEFAULT", "Placement", "PlacementError", "Target", "TargetError"]


def resolve_target(target: str | os.PathLike) -> Path:
    """Turn the user's target (a local model directory, or the name of an embedded target:
    smollm2, gemma3-270m) into a directory."""
    if str(target) in EMBEDDED:
        return convert_embedded(str(target))
    path = Path(target)
    if not (path / "config.json").is_file():
        raise TargetError(
            f"target {str(target)!r} is neither a local model directory (no config.json there) "
            f"nor an embedded target ({', '.join(EMBEDDED)}); specfoundry never downloads from a hub"
        )
    return path


def announce_target(command: str, target: str, path: Path) -> None:
    """The one line every command prints before it loads its target: which one runs, and from where."""
    shown = str(target) if str(target) == str(path) else f"{target} ({path})"
    print(f"{command}: target {shown}", file=sys.stderr)


@dataclass(frozen=True)
class TargetIdentity:
    """What identifies a target for the on-disk contracts (recorded in every manifest)."""

    name: str
    path: str
    config_sha256: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def text_config(config: dict) -> dict:
    """The language model's part of an HF config dict (multimodal configs nest it under
    `text_config`)."""
    return config.get("text_config", config)


def rope_settings(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for a draft of the text config `c`: v4 style (top-level keys),
    v5 (`rope_parameters`, whose non-default types become rope_scaling), or v5 per layer type
    (Gemma-3: `{"full_attention": {...}, "sliding_attention": {...}}`), where a draft, which
    attends over the whole context, takes the full-attention layers' RoPE."""
    rope = c.get("rope_parameters") or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return float(theta), scaling


def draft_shape_of(target_config: dict | Path | str) -> dict:
    """The fields every draft family copies from its target: width, attention shape (head_dim as
    the target states it), MLP width, RoPE (rope_settings), norm eps, positions and vocabulary.
    target_config: the config dict, or a model directory holding config.json."""
    if isinstance(target_config, Path | str):
        target_config = json.loads((Path(target_config) / "config.json").read_text())
    c = text_config(target_config)
    heads = c["num_attention_heads"]
    rope_theta, rope_scaling = rope_settings(c)
    return dict(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=c.get("max_position_embeddings", 8192),
        vocab_size=c["vocab_size"],
        target_hidden_size=c["hidden_size"],
    )


def config_hash(config_dict: dict) -> str:
    """Hash of the architecture-relevant config, stable across transformers' bookkeeping keys."""
    skip = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "architectures"}
    kept = {k: v for k, v in sorted(config_dict.items()) if k not in skip}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def target_identity(target: str, path: Path) -> TargetIdentity:
    config = json.loads((path / "config.json").read_text())
    text = text_config(config)
    return TargetIdentity(
        name=str(target),
        path=str(path),
        config_sha256=config_hash(config),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
    )


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parameter_count(path: Path) -> int:
    """The parameters of the model at `path` (tied ones once), from its config alone: built on the
    meta device, nothing read or allocated."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (the serving precision), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


COMPLETION = "completion"
COMPLETION_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
                       "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
"""Plain-text completion, for a base model without a chat template: the messages' texts back to back
after BOS, each assistant text (a continuation the target wrote) followed by EOS. A prompt is BOS
plus the texts so far (there is no generation prompt), so the assistant texts and their EOS are the
loss region, and generation stops at EOS."""


TEMPLATE_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> where with_chat_template took its template from (kept beside the tokenizer, not on it)."""


def chat_template_source(tokenizer) -> str:
    """How the tokenizer renders conversations: 'target' (its own template), 'completion', or the
    file given with --chat-template."""
    return TEMPLATE_SOURCES.get(tokenizer, "target")


def check_jinja(text: str, what: str) -> None:
    """A chat template's source that Jinja cannot parse is one TargetError naming its line (it raised
    Jinja's traceback at the first rendering)."""
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise TargetError(f"{what}: not a valid Jinja template at line {e.lineno}: {e.message}") from None


def with_chat_template(tokenizer, chat_template: str | None):
    """The tokenizer rendering with `chat_template`: None keeps the target's own template (a target
    without one renders as plain-text completion), 'completion' forces completion, anything else
    is a Jinja template file that replaces the target's (or gives one to a base model)."""
    if chat_template is None and tokenizer.chat_template:
        return tokenizer
    if chat_template in (None, COMPLETION):
        tokenizer.chat_template, source = COMPLETION_TEMPLATE, COMPLETION
    else:
        path = Path(chat_template)
        if not path.is_file():
            raise TargetError(f"--chat-template {chat_template}: no such file (a Jinja chat template, or "
                              f"'{COMPLETION}')")
        text = path.read_text()
        check_jinja(text, f"--chat-template {chat_template}")
        tokenizer.chat_template, source = text, str(path)
    TEMPLATE_SOURCES[tokenizer] = source
    return tokenizer


def load_tokenizer(path: Path, chat_template: str | None = None):
    """The target's tokenizer, rendering conversations as `chat_template` says (with_chat_template)."""
    from transformers import AutoTokenizer

    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise TargetError(f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)}): a target folder holds the model's "
                          "tokenizer files; copy them from its repository")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError) as e:  # files there that transformers cannot build a tokenizer from
        raise TargetError(f"{path}: its tokenizer does not load: {str(e).strip().splitlines()[0]}") from None
    return with_chat_template(tokenizer, chat_template)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""A tokenizer's files, one of which a target folder holds (a fast tokenizer's, SentencePiece's, BPE's
vocabulary, or the config naming one)."""


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every token id that ends an assistant turn (generation config's eos plus the tokenizer's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def input_device(model, fallback: str | torch.device | None = None) -> torch.device:
    """Where a model's inputs go: under a device map the first GPU it uses (accelerate's hooks move
    each layer's inputs to that layer's execution device), else the device of its weights (or
    `fallback`, where its weights are shards or on no device)."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        gpus = [d for d in placed.values() if d not in ("cpu", "disk", "meta")]
        if not gpus:
            return torch.device("cpu")
        return torch.device("cuda", gpus[0]) if isinstance(gpus[0], int) else torch.device(gpus[0])
    if fallback is not None:
        return torch.device(fallback)
    return next(model.parameters()).device


def mask_layout(config) -> str | None:
    """How the layers of a (text) config attend: 'full', 'sliding' (every layer, one window),
    'mixed' (per config.layer_types: the model takes a dict of masks, one per layer type), or None
    for attention no ready causal mask describes (bidirectional, encoder-decoder, other layer kinds)."""
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_encoder_decoder", False):
        return None
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds:
        if kinds == {"full_attention"}:
            return "full"
        return "mixed" if kinds == {"full_attention", "sliding_attention"} or kinds == {"sliding_attention"} else None
    return "sliding" if getattr(config, "sliding_window", None) else "full"


@dataclass
class Step:
    """What `Target.forward` returns: logits [B, T or kept, V] (fp32, on the input device), the KV
    cache after the call, and with `hidden` the final normed state [B, T, H]."""

    logits: torch.Tensor
    cache: object | None
    final: torch.Tensor | None = None


class Target:
    """The target model, placed (common/placement.py) and frozen, with its tokenizer and identity.

    One device: the stages' behaviour of old, bit for bit. Device map: inputs go to the first GPU,
    every output (taps, final state, logits) comes back there. Tensor / expert parallel: every rank
    of a group holds its shard of the model and runs the same calls; outputs are full tensors on
    every rank (the hooks and the lm_head's gathered output see the whole residual stream)."""

    def __init__(self, model, tokenizer, identity: TargetIdentity | None = None, *, ranks: Ranks | None = None,
                 placement: Placement | None = None, device: str | torch.device | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.identity = identity
        self.ranks = ranks or Ranks()
        self.placement = placement or Placement()
        self.input_device = input_device(model, device if self.placement.copy_size > 1 else None)
        self.base, self.layers = decoder_layers(model)
        params = inspect.signature(model.forward).parameters
        # newer transformers name the cache argument `cache` (and warn on the old name)
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        self._lm_head: torch.Tensor | None = None

    @property
    def path(self) -> Path | None:
        """The model directory (None for a model built in this process)."""
        return Path(self.identity.path) if self.identity is not None else None

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, target: str, *, device: str | None = None, dtype: torch.dtype | None = None,
             placement: Placement | None = None, chat_template: str | None = None,
             command: str = "the command", settings: dict | None = None) -> Target:
        """Resolve `target`, join the launch's process groups (placement), load the model frozen
        and in eval mode, the tokenizer rendering with `chat_template` (with_chat_template).
        Under a launch of several processes the ranks first compare `settings` (what the command's
        output depends on), their placement and the target's identity (config hash, weight
        fingerprint): any difference is one line on every rank (placement.check_one_launch)."""
        from transformers import AutoModelForCausalLM

        placement = placement or Placement()
        path = resolve_target(target)
        record = None
        if launch_env()[1] > 1:
            from specfoundry.common.weights import weight_fingerprint

            record = {"settings": settings or {}, "target": {
                "config_sha256": target_identity(target, path).config_sha256,
                "weight_fingerprint": weight_fingerprint(path)}}
        ranks, device = join_launch(placement, device, command, record)
        if ranks.rank == 0:
            announce_target(command, target, path)
        # the tokenizer (and its chat template) first: a folder without one, or a template that does
        # not parse, is one line before the weights' load, which takes minutes at 70B
        tokenizer = load_tokenizer(path, chat_template)
        dev = pick_device(device)
        kwargs = placement_kwargs(path, placement, dev)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype(dev), **kwargs)
        if not placement.device_map and placement.copy_size == 1:
            model.to(dev)
        model.eval().requires_grad_(False)
        experts = set_experts(model, placement.experts_implementation, dev.type)
        if experts is not None:  # an MoE target: the implementation in use, resolved from auto
            placement = dataclasses.replace(placement, experts_implementation=experts)
            if ranks.rank == 0:
                print(f"{command}: experts run {experts}", file=sys.stderr)
        return cls(model, tokenizer, target_identity(target, path), ranks=ranks,
                   placement=placement, device=dev)

    @classmethod
    def wrap(cls, model, tokenizer=None) -> Target:
        """A model already built in this process (tests, benchmarks), on one device."""
        return cls(model, tokenizer)

    # ---- what it is -----------------------------------------------------------------------------

    @property
    def config(self):
        c = self.model.config
        return c.get_text_config() if hasattr(c, "get_text_config") else c

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def is_writer(self) -> bool:
        return self.ranks.is_writer

    @property
    def distributed(self) -> bool:
        return self.placement.copy_size > 1

    def end_of_turn_ids(self) -> list[int]:
        return end_of_turn_ids(self.model, self.tokenizer)

    def lm_head(self) -> torch.Tensor:
        """[V, H] in the model's dtype on the input device, read from the weight files (a live
        lm_head is a shard under tensor parallelism, and offloaded under a device map)."""
        if self._lm_head is None:
            if self.path is not None:
                from specfoundry.common.weights import target_lm_head

                head = target_lm_head(self.path)
            else:
                assert not self.distributed, "a sharded target reads its lm_head from its files"
                head = self.model.get_output_embeddings().weight
            self._lm_head = head.to(self.input_device, self.dtype)
        return self._lm_head

    @property
    def mask_layout(self) -> str | None:
        """mask_layout of the text config: what attention_masks builds."""
        return mask_layout(self.config)

    def attention_masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, additive: bool):
        """The ready mask(s) [B, 1, q, kv] the model takes for allowed [B, q, kv] (True: query may
        attend to key), queries at positions q_pos [B, q] and keys at kv_pos [B, kv]: one tensor, or
        where sliding-window layers exist that mask cut to each query's window too (a key at most
        window - 1 positions back, transformers' rule): the windowed tensor where every layer slides,
        a dict per layer type where the model mixes types (Gemma-3). `additive`: 0 / the dtype's
        minimum (what eager attention adds to its scores), else boolean. Every caller that hands the
        model a ready mask builds it here (sf-eval's trees, sf-regen's slot engine)."""
        layout = self.mask_layout
        assert layout is not None, "the target's attention takes no ready causal mask"

        def as_mask(m: torch.Tensor) -> torch.Tensor:
            if not additive:
                return m[:, None]
            zero = torch.zeros((), dtype=self.dtype, device=m.device)
            return torch.where(m, zero, torch.finfo(self.dtype).min)[:, None]

        full = as_mask(allowed)
        if layout == "full":
            return full
        recent = as_mask(allowed & (kv_pos[:, None, :] > q_pos[:, :, None] - self.config.sliding_window))
        return recent if layout == "sliding" else {"full_attention": full, "sliding_attention": recent}

    # ---- running ------------------------------------------------------------------------------

    def tap(self, layers: list[int]) -> AuxLayerTap:
        """Forward hooks on `layers` whose outputs `take()` concatenates on the input device."""
        return AuxLayerTap(self.model, layers, device=self.input_device)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, tap: AuxLayerTap | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The base model over ids [B, T], without a cache and without logits. Returns (the tap's
        layers [B, T, K*H] or None, the final normed state [B, T, H]), on the input device."""
        if tap is not None:
            tap.clear()
        out = self.base(input_ids=ids.to(self.input_device, non_blocking=True), use_cache=False)
        final = out.last_hidden_state.to(self.input_device)  # [B, T, H]
        return (tap.take() if tap is not None else None), final

    @torch.no_grad()  # not inference_mode: torch.compile cannot trace into it (TargetRunner `compiled`)
    def forward(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None, mask=None, cache=None,
                logits_to_keep: int | None = None, hidden: bool = False) -> Step:
        """The causal LM over ids [B, T] after `cache` (None: no cache kept). `mask`: a ready 4D
        mask (or a dict per layer type) that transformers passes through untouched."""
        kwargs = {"use_cache": cache is not None}
        if cache is not None:
            kwargs[self.cache_arg] = cache
        if positions is not None:
            kwargs["position_ids"] = positions.to(self.input_device)
        if mask is not None:
            kwargs["attention_mask"] = mask
        if logits_to_keep is not None and self.keeps_logits:
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.model(input_ids=ids.to(self.input_device), output_hidden_states=hidden, **kwargs)
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        final = out.hidden_states[-1].to(self.input_device) if hidden else None
        return Step(out.logits.to(self.input_device).float(), new_cache, final)


    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        """transformers' `generate` over [B, T] (the hf regen backend's `generate` engine)."""
        return self.model.generate(input_ids=input_ids.to(self.input_device),
                                   attention_mask=attention_mask.to(self.input_device), **kwargs)


def placement_kwargs(path: Path, placement: Placement, device: torch.device) -> dict:
    """from_pretrained's arguments for `placement`, after checking that the architecture can be
    placed so (a one-line PlacementError naming what to do instead)."""
    if placement.device_map:
        offload = Path(tempfile.gettempdir()) / f"specfoundry-offload-{os.getpid()}"
        return {"device_map": placement.device_map, "max_memory": placement.max_memory, "offload_folder": str(offload)}
    if placement.copy_size == 1:
        return {}
    from transformers import AutoConfig

    from specfoundry.common.placement import distributed_config

    return {"distributed_config": distributed_config(AutoConfig.from_pretrained(path), placement)}
