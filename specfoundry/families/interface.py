"""The family interface: what one draft family supplies to the shared stages.

The Trainer, the loader, checkpoints, Accelerate/ZeRO-2, resume, recipes, sf-export, sf-eval's
decoding loop and the gate's driver are the same for every family; the catalogue
(specfoundry/families/__init__.py) names the families and their providers. A provider supplies:
    layers        the captured target layers it reads (the set's, or its default for the target),
                  and whether it reads the final state (the teacher's input)
    build         its draft config, derived from the target's config and the feature set, and its
                  model (fresh, or from an export given with --init-from)
    module        the nn.Module whose forward(batch) returns (loss, per-position metrics)
    export        the directories an engine serves, and the reading back of them (the catalogue
                  recognises a folder by its config.json's architectures; the family reads it)
    decoding      its decoder for sf-eval (decoding/rounds.py decode_rounds' callables, or a
                  loop of its own), its decode settings, and the check that the decoder's first
                  round equals the training forward at the same positions
    gate          the options of the gate's overfit and the gate's checks of its draft
This module imports no family: each family's provider (families/<name>/family.py) subclasses
DraftFamily. A draft's config names its family (`family`, recorded in every checkpoint's
draft_config.json and every export's specfoundry_draft.json) and the target layers it reads
(`target_layers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specfoundry.common.embedded import EMBEDDED_DEFAULT
from specfoundry.families import FAMILIES, DraftLoadError
from specfoundry.featureset.manifest import FeatureSetError
from specfoundry.featureset.store import decode_state
from specfoundry.kernels.lk_loss import TokenLoss

__all__ = ["DRAFT_FILE", "TARGET_FILE", "TRAINING_FILE", "Decoder", "DraftFamily", "DraftLoadError", "check_tensors", "expect_family", "load_tensors",
           "read_config_json", "read_json", "select_layers"]

TRAINING_FILE = "specfoundry_training.json"
"""Beside an export sf-train writes: how it was trained (token loss, the step kept and why)."""
TARGET_FILE = "specfoundry_target.json"
"""Beside every export: the identity of the target it was trained for (from the feature set)."""
DRAFT_FILE = "specfoundry_draft.json"
"""Beside every export: our own config of the draft, with its family."""


@dataclass
class Batch:
    """One micro-batch as the loader yields it: right-padded rows of whole samples. Float8 states
    stay float8, beside their scales, until `to` puts them on the training device and decodes them
    there: the host-to-device copy carries one byte per value."""

    input_ids: torch.Tensor  # [B, T] int64, right-padded
    loss_mask: torch.Tensor  # [B, T] bool
    aux_hidden: torch.Tensor  # [B, T, K*H]: the K layers the family reads, in its order
    final_hidden: torch.Tensor | None  # [B, T, H]; None when the family reads no final state
    lengths: list[int]
    indices: list[int] = field(default_factory=list)  # the rows' sample indices in the feature set
    epoch: int = 0  # the loader's epoch (a family's per-sample randomness is seeded by it and the index)
    aux_scale: torch.Tensor | None = None  # [B, T, K] float32 where aux_hidden is float8 (padding: 0)
    final_scale: torch.Tensor | None = None  # [B, T, 1] float32 where final_hidden is float8

    def to(self, device, dtype=None) -> Batch:
        """On `device` with the hidden states in `dtype` (None: as stored, float8 as bfloat16);
        asynchronous when the batch is in pinned memory (see pin_memory). Float8 states cross as
        float8 and are dequantised on `device`: the trainer gets the tensors a bf16 set gives."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        def state(values, scale):
            if values is None or scale is None:  # a float dtype: moved and cast in one step, as always
                return None if values is None else values.to(device, dtype, non_blocking=True)
            return decode_state(move(values), move(scale), dtype)

        return Batch(move(self.input_ids), move(self.loss_mask), state(self.aux_hidden, self.aux_scale),
                     state(self.final_hidden, self.final_scale), self.lengths, self.indices, self.epoch)

    def pin_memory(self) -> Batch:
        """The DataLoader's pin_memory hook: a copy to the GPU from pinned memory is asynchronous
        and runs at full bus speed; from pageable memory it is a synchronous staged copy."""
        def pin(t):
            return None if t is None else t.pin_memory()

        return Batch(pin(self.input_ids), pin(self.loss_mask), pin(self.aux_hidden), pin(self.final_hidden),
                     self.lengths, self.indices, self.epoch, pin(self.aux_scale), pin(self.final_scale))


MASK64 = (1 << 64) - 1


class Decoder:
    """What DraftFamily.decoder returns: `generate`, one sequence's speculative decode, and what sf-eval's
    untimed preparation needs of it: `reserve`, room for the longest decode, and `step_keys`, every
    step a decode meets (the decoding core captures each before the first timed decode)."""

    def generate(self, target, prompt: list[int], *, max_new_tokens: int, eos: set[int], sampler):
        """(decoding/target.TargetRunner, prompt ids, ..., decoding/sampler.Sampler) -> decoding/rounds.DecodeResult."""
        raise NotImplementedError

    def reserve(self, tokens: int) -> None:
        """Room in the draft's cache for any decode of at most `tokens` tokens (prompt and new ones),
        so that no later decode of such a length grows it."""
        raise NotImplementedError

    def step_keys(self, target, prompts: list[int]) -> list:
        """[(decoding/steps.CapturedSteps, key)]: every step the decodes of prompts of these lengths
        may meet, the draft's and the target's verify (`target`: the decoding/target.TargetRunner),
        including those one decode need not reach (the commit of every count of accepted drafts)."""
        raise NotImplementedError


def _splitmix64(z: int) -> int:
    """One splitmix64 step: a bijective 64-bit mix whose outputs of nearby inputs look unrelated."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """The anchor-sampling seed of one sample in one epoch: a function of the three numbers only,
    so a sample's anchors do not depend on its batch, its row, the rank or a resume."""
    z = 0
    for v in (seed, epoch, sample_index):
        z = _splitmix64(z ^ (int(v) & MASK64))
    return z >> 1  # 63 bits: any torch.Generator seed


class DraftFamily:
    """The interface; each family subclasses it (families/eagle3/family.py, families/dflash/family.py).
    `options` below is what the catalogue's options_for gives: the family's own options group,
    or an Extended(parent's, own) for a family that extends another."""

    name: str
    config_class: type
    """The draft's config: frozen, with to_dict/from_dict, `family` and `target_layers`."""

    # ---- layers ------------------------------------------------------------------------------

    def default_layers(self, num_target_layers: int, options) -> list[int]:
        raise NotImplementedError

    def layer_count(self, options) -> int | None:
        """How many layers the family reads by default; None: any number."""
        raise NotImplementedError

    any_layer_count = False
    """Whether --layers may name another number of layers than layer_count (DFlash: its fc reads K
    layers whatever the number of draft layers)."""

    def needs_final_state(self, options) -> bool:
        raise NotImplementedError

    # ---- training ----------------------------------------------------------------------------

    def build(self, options, fs, target_dir: Path, layers: list[int], init_from: str | None):
        """(draft nn.Module with the target's embeddings copied in, its config)."""
        raise NotImplementedError

    def module(self, draft, target_dir: Path, dtype: torch.dtype, options, seed: int,
               token_loss: TokenLoss = TokenLoss()) -> torch.nn.Module:
        """The training module: forward(batch, attention=, loss_kernel=, loss_scale=) returns (total loss,
        [{loss, hits, valid}] per predicted position); `seed` seeds the family's own sampling;
        `token_loss` is one of the catalogue entry's token_losses (sf-train refuses the others)."""
        raise NotImplementedError

    def vocab_coverage(self, draft, counts: torch.Tensor) -> float | None:
        """The share of the feature set's supervised tokens (counts [V], token_counts.safetensors) the
        draft's vocabulary holds: what it can learn to propose. None: it proposes over the target's
        whole vocabulary."""
        return None

    def set_progress(self, module: torch.nn.Module, step: int, total_steps: int) -> None:
        """Before each optimizer step: where the run is (step of total_steps), for a loss scheduled over
        the run (Domino's base-anchored curriculum); `module` is what `module()` built. Most families
        schedule nothing."""

    def draft_module(self, cfg) -> torch.nn.Module:
        """A freshly initialised draft of config `cfg` (its embeddings not yet the target's)."""
        raise NotImplementedError

    def config_from_dict(self, d: dict):
        return self.config_class.from_dict(d)

    # ---- export and reading back -------------------------------------------------------------

    @property
    def layouts(self) -> tuple[str, ...]:
        """The directory layouts its export writes (sf-export --format), from its catalogue entry; the
        first is sf-train's."""
        return FAMILIES.get(self.name).layouts

    def export(self, state: dict[str, torch.Tensor], draft_config, out: Path, target: dict | None,
               layout: str = "sglang", verifier: dict | None = None, speculative_tokens: int | None = None) -> Path:
        """Write `layout`; a speculators export names its verifier (serving_verifier) and its
        speculative tokens (None: the family's default)."""
        raise NotImplementedError

    def read_config(self, path: Path, num_target_layers: int | None = None):
        """The config of an export folder of this family (ours or another tool's), from its config.json
        alone, as an engine reads it; DraftLoadError (one line) for what cannot be read."""
        raise NotImplementedError

    def read_export(self, ref) -> tuple[object, dict[str, torch.Tensor]]:
        """(config, tensors under the draft module's names, checked) of an export of this family, located
        once (folders.DraftRef: its folder `where`, its config as read, the target's layer count)."""
        raise NotImplementedError

    def for_serving(self, cfg, target_config: dict):
        """cfg as sf-export writes it for a target of config.json `target_config` (unchanged by default)."""
        return cfg

    # ---- sf-eval -----------------------------------------------------------------------------

    def decode_settings(self, cfg, *, k: int, tree: tuple[int, ...] | None, temperature: float, k_given: bool,
                        source: str) -> tuple[int, tuple[int, ...] | None, str | None]:
        """(k, tree, a warning or None) sf-eval decodes draft `cfg` with, from the settings given
        (k_given: -k was set); ValueError (one line) for settings it cannot decode with."""
        raise NotImplementedError

    compiles_draft = False
    """Whether decoder(compiled=True) is offered (sf-eval --compile-draft): EAGLE-3's chain, the DFlash,
    DSpark and Domino block proposals (P-EAGLE's round is not compiled: one shape per pending-row count)."""

    def decoder(self, draft, target, *, k: int, tree: tuple[int, ...] | None, compiled: bool = False):
        """The draft's Decoder for sf-eval (generate, reserve, step_keys). `target`: common/target.Target. `compiled`:
        its captured proposal through torch.compile (sf-eval --compile-draft); a family that does
        not offer it raises ValueError (one line)."""
        raise NotImplementedError

    def decode_matches_training(self, draft, lm_head: torch.Tensor, ids: torch.Tensor,
                                aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the decoder's first round, logits of the training forward at the same positions)
        for one sequence: token ids [T], the target's features aux [T, K*Ht] at the draft's layers;
        `lm_head` the target's [V, H]. The gate and the family contract test compare them."""
        raise NotImplementedError

    # ---- the gate ----------------------------------------------------------------------------

    def gate_options(self, gate) -> dict:
        """{options group: options} of the gate's overfit (gate.GateConfig `gate`), for TrainConfig."""
        raise NotImplementedError

    def gate_checks(self, gate, ref, fs, sample, target) -> list:
        """The gate's checks of the exported draft `ref` (folders.DraftRef, located once, of this family), in
        order (gatekit.Check each)."""
        raise NotImplementedError


EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hugging Face id of the embedded default target: what a vLLM machine loads for it."""


def serving_verifier(target: str, target_dir: Path, given: str | None = None) -> dict:
    """A speculators export's verifier {name_or_path, architectures}: `given`, else the target as a
    serving machine names it: the embedded default's Hugging Face id (not this machine's converted
    copy), a local folder's absolute path, or the id as given. sf-train's export and sf-export's
    write the same one."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    name = given or (EMBEDDED_HF_ID if target == EMBEDDED_DEFAULT else
                     str(Path(target).resolve()) if Path(target).is_dir() else target)
    return {"name_or_path": name, "architectures": config.get("architectures") or []}


def exported_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                     skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors an export writes: on the CPU, contiguous, floating ones in `dtype`, without the
    names starting with `skip` (the target's embeddings, which the engines use; RoPE buffers)."""
    out = {}
    for name, t in state_dict.items():
        if not name.startswith(skip):
            t = t.detach().cpu()
            out[name] = t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
    return out


def check_tensors(tensors: dict[str, torch.Tensor], spec: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
                  engine: str, family: str) -> None:
    """Exactly the names of `spec` (an engine's loader, which ignores unknown names silently), each of
    its shape and, where the spec gives one, its dtype; ValueError naming the first that differs."""
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if missing or extra:
        raise ValueError(f"export tensors do not match {engine}'s {family} names: missing {missing}, "
                         f"unexpected {extra}")
    for name, (shape, dtype) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"export tensor {name} has shape {tuple(t.shape)}, {engine} expects {shape}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"export tensor {name} has dtype {t.dtype}, expected {dtype}")


# ---- reading a draft folder's files: each failure one line naming the file (and the field) --------

INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
              "block_size", "mask_token_id", "sliding_window")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
ID_LISTS = ("eagle_aux_hidden_state_layer_ids", "target_layer_ids", "aux_layer_ids")


def expect_family(path: Path, name: str) -> None:
    """Refuse a draft folder whose config.json names another family than `name`, or none (one line)."""
    found = FAMILIES.family_of_config(read_config_json(path), str(Path(path) / "config.json"))
    if found != name:
        raise DraftLoadError(f"{path} is a draft of family {found}, not {name}: pass --family {found}")


def read_json(file: Path):
    try:
        return json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise DraftLoadError(f"{Path(file).parent} has no {Path(file).name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftLoadError(f"{file}: not JSON ({e})") from None


def read_config_json(path: Path, name: str = "config.json") -> dict:
    """A draft folder's config.json (or draft_config.json) as a mapping whose numeric settings are
    numbers: an engine, and every reader here, would fail on anything else further on."""
    file = Path(path) / name
    config = read_json(file)
    if not isinstance(config, dict):
        raise DraftLoadError(f"{file}: not a JSON object of settings, but a {type(config).__name__}")
    check_numbers(config, file)
    return config


def check_numbers(config: dict, file: Path, where: str = "") -> None:
    """Refuse a numeric setting that is no number, naming the file and the field ('a.b' nested)."""
    for key, value in config.items():
        if isinstance(value, dict):
            check_numbers(value, file, f"{where}{key}.")
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if key in INT_FIELDS and value is not None and not whole:
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not an integer")
        if key in FLOAT_FIELDS and value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not a number")
        if key in ID_LISTS and value is not None and not (
                isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            raise DraftLoadError(f"{file}: {where}{key} is {value!r}, not a list of layer ids")


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, every floating one finite (check_finite): the one reader of a
    draft's weights (an export, a checkpoint, --init-from). A damaged or truncated file, or a NaN or
    inf in a weight, is one line naming the file (and the tensor), not a SafetensorError or a draft
    that decodes garbage."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(file).is_file():
        raise DraftLoadError(f"{Path(file).parent} holds no {Path(file).name}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, ValueError) as e:
        raise DraftLoadError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]}): it is damaged "
                             "or truncated") from None
    try:
        check_finite(tensors, str(file))
    except ValueError as e:
        raise DraftLoadError(f"{e}: the draft is broken (retrain it, or use an earlier checkpoint)") from None
    return tensors


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming `source` and the first floating tensor (by name) holding a NaN or an inf."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise ValueError(f"{source}: {name}: {bad} of {t.numel()} values are not finite")


def select_layers(manifest: dict, family: DraftFamily, options, explicit: tuple[int, ...] | None,
                  num_target_layers: int, source: str) -> list[int]:
    """The stored layers a family reads: `explicit` (--layers) if given; else every stored layer when
    the set holds exactly as many as the family reads; else the family's default for the target.
    Refuses a layer the set lacks, naming it and what the set holds."""
    held = list(manifest["aux_layer_ids"])
    count = family.layer_count(options)
    if explicit:
        wanted = list(explicit)
        how = "--layers"
    elif count is None or len(held) == count:
        wanted = held
        how = ""
    else:
        wanted = family.default_layers(num_target_layers, options)
        how = f"the {family.name} default for a {num_target_layers}-layer target"
    if wanted != sorted(set(wanted)):  # engines concatenate the tapped layers in layer order
        raise FeatureSetError(f"layers {wanted} ({how or source}) must be ascending and distinct (engines "
                              "concatenate the tapped layers in layer order)" + ("" if explicit else "; pass --layers"))
    if count is not None and len(wanted) != count and not (explicit and family.any_layer_count):
        raise FeatureSetError(f"the {family.name} draft reads {count} layers; {how or source} gives {wanted}")
    missing = [i for i in wanted if i not in held]
    if missing:
        raise FeatureSetError(f"{source} lacks layer{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} that the {family.name} draft reads ({how}: {wanted}); "
                              f"it holds {held}: recapture with sf-capture --aux-layers, or pick --layers from those")
    return wanted
