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

from pathlib import Path

import torch

from specfoundry.families import FAMILIES
from specfoundry.kernels.lk_loss import TokenLoss

__all__ = ["Decoder", "DraftFamily"]


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


class DraftFamily:
    """The interface; each family's provider (families/<name>/family.py) subclasses it.
    `options` below is what the catalogue's options_for gives: the family's own options group,
    or an Extended(parent's, own) for a family that extends another."""

    name: str
    config_class: type
    """The draft's config: frozen, with to_dict/from_dict, `family` and `target_layers`."""

    # ---- layers ------------------------------------------------------------------------------

    def default_layers(self, num_target_layers: int, options) -> list[int]:
        """The target layers it reads by default: its catalogue entry's function."""
        return FAMILIES.default_layers(self.name, num_target_layers, options)

    def layer_count(self, options) -> int | None:
        """How many layers the family reads by default; None: any number."""
        raise NotImplementedError

    any_layer_count = False
    """Whether --layers may name another number of layers than layer_count (DFlash: its fc reads K
    layers whatever the number of draft layers)."""

    def needs_final_state(self, options) -> bool:
        """Whether it reads the teacher: the final state, or a top-k teacher stored in its place."""
        raise NotImplementedError

    def trains_from_topk_teacher(self, options) -> bool:
        """Whether the teacher's distribution is all it reads of the final state, so that a set of a
        top-k teacher (featureset/teacher.py) serves it."""
        return False

    def final_state_use(self, options) -> str:
        """What it reads the final state for beyond the teacher's distribution (for the refusal)."""
        return "its loss reads the state itself"

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

    serves_engine_tree = False
    """Whether the family drafts the engines' tree (sf-eval --num-steps/--topk/--num-draft-tokens, passed
    to decoder as `tree`: families/eagle3/engine_tree.py EngineTree): EAGLE-3's."""

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
