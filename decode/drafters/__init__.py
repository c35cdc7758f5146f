"""The built-in drafters (`decode.drafter.Drafter` implementations) and `make_drafter`, which finds the
drafter of any draft source through the registry (`heads.registry`)."""

from __future__ import annotations

from torch import nn

from decode.drafter import Drafter, RowDrafters
from heads.registry import kind_of


def make_drafter(source, target: nn.Module, batch: int) -> Drafter:
    """The drafter of `source` for a batch of `batch` rows: a registered draft source (head modules, an
    `Ngram` spec, a `DraftModel`, a `Composite` ...) gets its registered drafter; a `Drafter` instance is used
    as it is; a list of B one-row drafters is driven as one (`RowDrafters`)."""
    if isinstance(source, Drafter):
        return source
    if isinstance(source, (list, tuple)):
        if len(source) != batch:
            raise ValueError(f"{len(source)} drafters for a batch of {batch}")
        return RowDrafters([make_drafter(s, target, 1) for s in source])
    return kind_of(source).make_drafter(source, target, batch)
