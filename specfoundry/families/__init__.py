"""The draft families: one torch-free catalogue, the only place a family is named.

Each entry says what every stage needs to know about a family without loading it: its name,
its options group (a frozen config class, one nested section of sf-train's config), the family
it extends (whose group it reads on purpose), its default target layers, the architectures its
exports carry in config.json (how a draft folder is recognised), and its provider: the object
on the interface of families/interface.py that builds, trains, exports, reads back, decodes and gates
it. Everything but the names is given as "module:attribute" and imported on first use, so
importing this module loads neither torch nor any family, and no family module is imported by
the interface it implements (families/interface.py) or by this catalogue's import.

Adding a family is its folder (families/<name>/) plus one entry in FAMILIES (docs/families.md,
"Adding a family"). A name or an architecture that no entry knows is a one-line error wherever
it is met, never a fallback to another family.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass


class UnknownFamilyError(ValueError):
    """A family name that no entry of the catalogue has."""


class DraftLoadError(ValueError):
    """A draft folder that cannot be read back: a missing file, setting or tensor, a shape its
    config disagrees with, an option specfoundry's draft does not have, an architecture no family
    exports (one line, naming it)."""


def resolve(spec: str):
    """The object a "module:attribute" string names."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True, kw_only=True)
class Family:
    """One catalogue entry."""

    name: str
    """The --family value, the name recorded in checkpoints and exports, and its options group's field."""
    summary: str
    """A few words for --family's help (docs/families.md says the rest)."""
    options: str
    """"module:Class" of its options, a frozen keyword-only Settings dataclass (families/<name>/options.py)."""
    default_layers: str
    """"module:function" (num_target_layers, options) -> the target layers it reads by default."""
    architectures: tuple[str, ...]
    """config.json `architectures` values its exports carry, ours and other tools'; each names one family.
    The first is the one its own sglang layout writes."""
    provider: str
    """"module:object" of its provider, on families/interface.py's DraftFamily interface."""
    extends: str | None = None
    """The family it extends: its options group is read as the parent's (options_for), so the
    child adds options of its own and can never shadow the parent's."""
    builds_on: tuple[str, ...] = ()
    """Other families whose code it uses (its parent's it may use anyway); a house test holds every
    import between family folders to this and `extends`."""
    speculators_types: tuple[str, ...] = ()
    """speculators_model_type values (vLLM's speculators format) that name this family."""
    projector_types: tuple[str, ...] = ()
    """dflash_config.projector_type values that name this family where config.json names its
    parent's architecture (SGLang serves Domino as DFlashDraftModel with projector_type "domino")."""
    proposes: str
    """What a round proposes, which says what -k means for it (PROPOSALS): "chain" (a chain of k
    tokens), "block" (a block's slots after the bonus token, B - 1), "block+bonus" (every slot of a
    block, B), "depths" (its first k trained depths, one forward)."""
    layouts: tuple[str, ...] = ("sglang",)
    """The directory layouts its export writes (sf-export --format); the first is sf-train's."""
    speculators_k: str | None = None
    """sf-export's -k for its speculators layout where -k is not given, in words (None: it has none)."""
    token_losses: tuple[str, ...] = ("ce",)
    """The token losses it trains with (sf-train --token-loss; kernels/lk_loss.py), the first its default."""


PROPOSALS = {  # a family's `proposes`: (what -k means, sf-eval's k where -k is not given)
    "chain": ("a chain of k tokens (the gate trains k TTT steps)", "4"),
    "block": ("the B - 1 slots after the bonus token of a block of B (sf-eval serves a block of k + 1, at most "
              "the trained one; the gate trains blocks of k + 1)", "B - 1"),
    "block+bonus": ("every slot of a block of B (sf-eval serves a block of k, at most the trained one; the gate "
                    "trains blocks of k)", "B"),
    "depths": ("its first k trained depths, at most K (the gate trains K = k)", "its trained K"),
}


@dataclass(frozen=True)
class Extended:
    """The options of a family that extends another: its parent's group (itself an Extended where
    the parent extends a third) and its own. The child's code reads `parent` on purpose."""

    parent: object
    own: object


class Registry:
    """The families, checked when built: distinct names, architectures and speculators types; a
    parent that is an earlier entry."""

    def __init__(self, families: tuple[Family, ...]):
        self.families: dict[str, Family] = {}
        self.by_architecture: dict[str, str] = {}
        self.by_speculators_type: dict[str, str] = {}
        self.by_projector_type: dict[str, str] = {}
        for f in families:
            if f.name in self.families:
                raise TypeError(f"family {f.name!r} is registered twice")
            for how, other in [("extends", f.extends)] + [("builds on", b) for b in f.builds_on]:
                if other is not None and other not in self.families:
                    raise TypeError(f"family {f.name!r} {how} {other!r}, which is not an earlier entry")
            for arch in f.architectures:
                if arch in self.by_architecture:
                    raise TypeError(f"architecture {arch!r} names two families: {self.by_architecture[arch]} and {f.name}")
                self.by_architecture[arch] = f.name
            for kind in f.speculators_types:
                if kind in self.by_speculators_type:
                    raise TypeError(f"speculators_model_type {kind!r} names two families: "
                                    f"{self.by_speculators_type[kind]} and {f.name}")
                self.by_speculators_type[kind] = f.name
            for kind in f.projector_types:
                if kind in self.by_projector_type or f.extends is None:
                    raise TypeError(f"projector_type {kind!r} of {f.name} must name one family that extends another")
                self.by_projector_type[kind] = f.name
            self.families[f.name] = f

    def names(self) -> tuple[str, ...]:
        return tuple(self.families)

    @property
    def default(self) -> str:
        """The family a command trains, captures for or gates when none is named: the first entry."""
        return next(iter(self.families))

    def get(self, name: str) -> Family:
        family = self.families.get(name) if isinstance(name, str) else None
        if family is None:
            raise UnknownFamilyError(f"unknown draft family {name!r}: choose one of {', '.join(self.families)}")
        return family

    def chain(self, name: str) -> list[Family]:
        """The family and the families it extends, root first."""
        out = [self.get(name)]
        while out[0].extends is not None:
            out.insert(0, self.get(out[0].extends))
        return out

    def uses(self, name: str) -> set[str]:
        """The families whose code `name`'s may import: the ones it extends, directly or not, and
        the ones it builds on."""
        return {f.name for f in self.chain(name)[:-1]} | set(self.get(name).builds_on)

    def provider(self, name: str):
        """The family's provider (families/interface.py's interface), imported on first use."""
        return resolve(self.get(name).provider)

    def options_class(self, name: str) -> type:
        return resolve(self.get(name).options)

    def options_for(self, cfg, name: str):
        """The options `name` reads from a config holding every family's group (TrainConfig): its
        own group, or Extended(parent's options, own group) for a family that extends another."""
        options = None
        for f in self.chain(name):
            own = getattr(cfg, f.name)
            options = own if options is None else Extended(options, own)
        return options

    def default_options(self, name: str):
        """options_for a config of every group's defaults."""
        options = None
        for f in self.chain(name):
            own = self.options_class(f.name)()
            options = own if options is None else Extended(options, own)
        return options

    def default_layers(self, name: str, num_target_layers: int, options=None) -> list[int]:
        """The target layers `name` reads by default (with its default options unless given)."""
        options = self.default_options(name) if options is None else options
        return list(resolve(self.get(name).default_layers)(num_target_layers, options))

    def family_of_config(self, config: dict, source: str) -> str:
        """The family of a draft folder whose config.json is `config` (ours or another tool's),
        from the architectures it names or its speculators_model_type."""
        archs = config.get("architectures") or []
        archs = archs if isinstance(archs, list) else [archs]
        found = {self.by_architecture[a] for a in archs if isinstance(a, str) and a in self.by_architecture}
        kind = config.get("speculators_model_type")
        if isinstance(kind, str) and kind in self.by_speculators_type:
            found.add(self.by_speculators_type[kind])
        dflash_config = config.get("dflash_config")
        projector = dflash_config.get("projector_type") if isinstance(dflash_config, dict) else None
        if projector is not None and found:  # a head on its parent's architecture: the child, or no family
            child = self.by_projector_type.get(projector) if isinstance(projector, str) else None
            if child is None:
                raise DraftLoadError(f"{source}: dflash_config.projector_type {projector!r} names no draft family "
                                     f"(known: {', '.join(self.by_projector_type) or 'none'})")
            if found <= {child, self.get(child).extends}:
                found = {child}
        if len(found) == 1:
            return found.pop()
        known = ", ".join(f"{f.name}: {'/'.join(f.architectures)}" for f in self.families.values())
        if found:
            raise DraftLoadError(f"{source}: architectures {archs} name several families ({', '.join(sorted(found))})")
        what = f"architectures {archs}" if archs else "no architectures"
        if kind is not None:
            what += f", speculators_model_type {kind!r}"
        raise DraftLoadError(f"{source} names {what}, which no draft family exports ({known})")

    # ---- the help texts of the commands above the families, rendered from the entries' facts ------

    def family_help(self) -> str:
        return ("Draft family: " + ", ".join(f"{f.name} ({f.summary})" for f in self.families.values())
                + "; docs/families.md.")

    def grouped(self, text) -> str:
        """'names: text; ...' of text(entry), families that read the same sharing one part."""
        out: dict[str, list[str]] = {}
        for f in self.families.values():
            out.setdefault(text(f), []).append(f.name)
        return "; ".join(f"{', '.join(names)}: {words}" for words, names in out.items())

    def draft_tokens_help(self) -> str:
        return f"Tokens the draft proposes a round (the gate trains for it), by family: {self.grouped(lambda f: PROPOSALS[f.proposes][0])}."

    def eval_k_shown(self) -> str:
        return self.grouped(lambda f: PROPOSALS[f.proposes][1])

    def export_k_shown(self) -> str:
        return "; ".join(f"{f.name}: {f.speculators_k}" for f in self.families.values() if f.speculators_k)

    def layers_shown(self, num_target_layers: int = 32) -> str:
        """Each family's default layers, at a target of `num_target_layers` layers (from its own function)."""
        return self.grouped(lambda f: str(self.default_layers(f.name, num_target_layers)))

    def layouts_help(self) -> str:
        return (f"The layout written, by family: {self.grouped(lambda f: ' or '.join(f.layouts))} (docs/stages.md, "
                "\"sf-export run\").")

    def layouts(self) -> tuple[str, ...]:
        """Every layout some family exports, sglang first."""
        return tuple(dict.fromkeys(layout for f in self.families.values() for layout in f.layouts))

    def option_groups(self, after: str):
        """Class decorator for a config class, applied before @dataclass: one field per family,
        named after it, holding its options group (defaults: the group's defaults), inserted
        after the field `after` in declaration order."""

        def decorate(cls):
            annotations = dict(cls.__dict__.get("__annotations__", {}))
            if after not in annotations:
                raise TypeError(f"{cls.__name__} has no field {after!r} to put the family options after")
            out = {}
            for name, hint in annotations.items():
                out[name] = hint
                if name == after:
                    for f in self.families.values():
                        if f.name in annotations:
                            raise TypeError(f"{cls.__name__}.{f.name} is both a setting and family {f.name}'s options")
                        options = self.options_class(f.name)
                        out[f.name] = options
                        setattr(cls, f.name, dataclasses.field(default_factory=options))
            cls.__annotations__ = out
            return cls

        return decorate


FAMILIES = Registry((
    Family(
        name="eagle3",
        proposes="chain",
        summary="a chain",
        options="specfoundry.families.eagle3.options:Eagle3Options",
        default_layers="specfoundry.families.eagle3.options:default_layers",
        # SGLang's (ours), vLLM's own, and speculators' classes (ours writes Eagle3DraftModel)
        architectures=("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel", "Eagle3Speculator"),
        speculators_types=("eagle3",),
        layouts=("sglang", "speculators"),
        speculators_k="3",
        token_losses=("ce", "lk-alpha", "lk-lambda", "tv"),
        provider="specfoundry.families.eagle3.family:EAGLE3",
    ),
    Family(
        name="dflash",
        proposes="block",
        summary="a block",
        options="specfoundry.families.dflash.options:DFlashOptions",
        default_layers="specfoundry.families.dflash.options:default_layers",
        architectures=("DFlashDraftModel",),
        provider="specfoundry.families.dflash.family:DFLASH",
        token_losses=("ce", "lk-alpha", "lk-lambda", "tv"),
    ),
    Family(
        name="domino",
        proposes="block",
        summary="a block, a prefix GRU",
        options="specfoundry.families.domino.options:DominoOptions",
        default_layers="specfoundry.families.domino.options:default_layers",
        # SGLang serves it as DFlashDraftModel with dflash_config.projector_type "domino";
        # upstream's (SpecForge) configs name DominoDraftModel
        architectures=("DominoDraftModel",),
        projector_types=("domino",),
        provider="specfoundry.families.domino.family:DOMINO",
        extends="dflash",
    ),
    Family(
        name="dspark",
        proposes="block+bonus",
        summary="a block, a Markov head",
        options="specfoundry.families.dspark.options:DSparkOptions",
        default_layers="specfoundry.families.dspark.options:default_layers",
        # ours and SGLang's entry class (vLLM's name too); SGLang's and vLLM's other name for it
        architectures=("Qwen3DSparkModel", "DSparkDraftModel"),
        provider="specfoundry.families.dspark.family:DSPARK",
        extends="dflash",
    ),
    Family(
        name="dflash2",
        proposes="block",
        summary="a block, one selected path",
        options="specfoundry.families.dflash2.options:DFlash2Options",
        default_layers="specfoundry.families.dflash2.options:default_layers",
        architectures=("DFlash2DraftModel",),  # SGLang's and vLLM's entry class, z-lab's, SpecForge's, ModelOpt's
        provider="specfoundry.families.dflash2.family:DFLASH2",
        extends="dflash",
    ),
    Family(
        name="peagle",
        proposes="depths",
        summary="K depths at once",
        options="specfoundry.families.peagle.options:PEagleOptions",
        default_layers="specfoundry.families.peagle.options:default_layers",
        # ours and speculators' class, vLLM's registry names (both map to its Eagle3LlamaForCausalLM), and
        # speculators' config default; speculators_model_type "peagle" (vLLM: eagle3 + parallel drafting)
        architectures=("PEagleDraftModel", "PeagleLlamaForCausalLM", "PeagleQwen3ForCausalLM", "PEagleSpeculator"),
        speculators_types=("peagle",),
        layouts=("speculators",),
        speculators_k="its trained depths K",
        token_losses=("ce", "lk-alpha", "lk-lambda", "tv"),
        provider="specfoundry.families.peagle.family:PEAGLE",
        builds_on=("eagle3", "dflash"),  # EAGLE-3: config, layouts, vocabulary checks; DFlash: mask token, anchor seeds
    ),
))
"""Every family specfoundry trains, in the order --help lists them."""


def family_names() -> tuple[str, ...]:
    return FAMILIES.names()
