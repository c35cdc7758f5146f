"""The registry of draft sources: one record per kind of drafter, the one place that knows what a kind is made
of. Loading (`heads.io`), decoding (`decode.drafters.make_drafter`, `decode.prepare`, `decode.calibrate`),
exports (`engines`), the benchmark and training (`train`) look a kind up here instead of branching on
classes.

A record names its parts as "module:attribute" strings, imported on first use, so this module imports none
of the packages it points into (heads/ stays at the bottom of the import graph) and a kind's parts can live
where a reader looks for them. Adding a drafter is one module plus one `register(Kind(...))`.

Parts of a record (None: the kind has none):
    source: the class whose instances draft through this kind (a head module, a spec such as `Ngram`).
    drafter: `factory(source, target, batch) -> decode.drafter.Drafter`.
    head_types: the `head_type` values of checkpoints of this kind (config.json), () for untrained kinds.
    config: the dataclass of its checkpoint's `head_config`.
    loss: its training loss (`train.losses`), recipe: the script that trains it.
    formats: the export formats that hold it (`engines.formats`).
    vllm: (export format, vLLM `method`) that vLLM serves it with (`engines.serving`).
    models: `models(source) -> list[nn.Module]`, the models a source drafts with that `decode.prepare` lays
        out as it lays out the target (a separate draft model); checkpoint heads are laid out as heads.
What the cost model needs of a kind (how deep it drafts, whether one forward drafts every level) is the
drafter's own `limits()` (`decode.drafter.DraftLimits`); `decode.calibrate` measures a kind through its
drafter, so it needs no hook here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


def resolve(path: str):
    """The object a "package.module:attribute" string names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Kind:
    name: str
    source: str
    drafter: str
    head_types: tuple[str, ...] = ()
    config: str | None = None
    loss: str | None = None
    recipe: str | None = None
    formats: tuple[str, ...] = ()
    vllm: tuple[str, str] | None = None
    models: str | None = None

    def source_class(self) -> type:
        return resolve(self.source)

    def make_drafter(self, source, target, batch: int):
        return resolve(self.drafter)(source, target, batch)

    def part(self, name: str):
        """A part resolved (`kind.part("loss")`), or None when the kind has none."""
        path = getattr(self, name)
        return resolve(path) if path is not None else None


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind; its name and head types must be new."""
    if kind.name in KINDS:
        raise ValueError(f"a drafter kind named {kind.name!r} is registered already")
    taken = {t for k in KINDS.values() for t in k.head_types}
    if taken.intersection(kind.head_types):
        raise ValueError(f"head types {sorted(taken.intersection(kind.head_types))} are registered already")
    KINDS[kind.name] = kind
    return kind


def find_kind(source) -> Kind | None:
    """The kind whose source class `source` is an instance of (subclasses included) and, for a kind of
    checkpoints, whose head types hold `source.head_type`; None if no kind is."""
    for kind in KINDS.values():
        if isinstance(source, kind.source_class()) and (
            not kind.head_types or getattr(source, "head_type", None) in kind.head_types
        ):
            return kind
    return None


def kind_of(source) -> Kind:
    """`find_kind`, or a TypeError that names the registered kinds."""
    kind = find_kind(source)
    if kind is None:
        known = ", ".join(f"{k.name} ({k.source.partition(':')[2]})" for k in KINDS.values())
        raise TypeError(f"no drafter is registered for {type(source).__name__}; registered: {known}")
    return kind


def kind_for_head_type(head_type: str) -> Kind:
    """The kind whose checkpoints carry `head_type` (ValueError naming the known ones otherwise)."""
    for kind in KINDS.values():
        if head_type in kind.head_types:
            return kind
    raise ValueError(f"unknown head_type {head_type!r}; expected one of {head_types()}")


def formats() -> dict[str, str]:
    """Every registered export format -> the head type it holds, in registration order."""
    return {fmt: kind.head_types[0] for kind in KINDS.values() for fmt in kind.formats}


def head_types() -> tuple[str, ...]:
    """Every registered checkpoint head type, in registration order."""
    return tuple(t for kind in KINDS.values() for t in kind.head_types)


register(
    Kind(
        name="eagle3",
        source="heads.eagle:EagleHead",
        drafter="decode.drafters.eagle:EagleDrafter",
        head_types=("eagle3",),
        config="heads.eagle:EagleConfig",
        loss="train.losses:eagle3_ttt_loss",
        recipe="train/eagle.py",
        formats=("sglang", "speculators"),
        vllm=("speculators", "eagle3"),
    )
)
register(
    Kind(
        name="eagle1",
        source="heads.eagle:EagleHead",
        drafter="decode.drafters.eagle:EagleDrafter",
        head_types=("eagle1",),
        config="heads.eagle:EagleConfig",
        loss="train.losses:eagle1_loss",
        recipe="train/eagle.py",
        formats=("eagle1",),
        vllm=("eagle1", "eagle"),
    )
)
register(
    Kind(
        name="medusa",
        source="heads.medusa:MedusaHeads",
        drafter="decode.drafters.medusa:MedusaDrafter",
        head_types=("medusa",),
        config="heads.medusa:MedusaConfig",
        loss="train.losses:medusa_loss",
        recipe="train/medusa.py",
        formats=("medusa", "medusa-vllm"),
        vllm=("medusa-vllm", "medusa"),
    )
)
register(
    Kind(
        name="dflash",
        source="heads.dflash:DFlashHead",
        drafter="decode.drafters.dflash:DFlashDrafter",
        head_types=("dflash",),
        config="heads.dflash:DFlashConfig",
        loss="train.block_losses:dflash_loss",
        recipe="train/eagle.py",
        formats=("dflash",),
        vllm=("dflash", "dflash"),
    )
)
register(
    Kind(
        name="peagle",
        source="heads.peagle:PEagleHead",
        drafter="decode.drafters.peagle:PEagleDrafter",
        head_types=("peagle",),
        config="heads.peagle:PEagleConfig",
        loss="train.block_losses:peagle_loss",
        recipe="train/eagle.py",
        formats=("peagle",),
        vllm=("peagle", "eagle3"),
    )
)
register(
    Kind(name="ngram", source="decode.drafters.ngram:Ngram", drafter="decode.drafters.ngram:NgramDrafter")
)
register(
    Kind(
        name="draft_model",
        source="decode.drafters.model:DraftModel",
        drafter="decode.drafters.model:ModelDrafter",
        models="decode.drafters.model:draft_models",
    )
)
register(
    Kind(
        name="composite",
        source="decode.drafters.composite:Composite",
        drafter="decode.drafters.composite:CompositeDrafter",
        models="decode.drafters.composite:part_models",
    )
)
