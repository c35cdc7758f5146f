"""Speculate-or-not policies: what `decode.generate` asks, every step, for the tree to draft (or None: a
plain step), and what it tells the policy back. A policy is a `TreePolicy`; a plain callable `rows -> tree
or None` is wrapped in one (`as_policy`).

Calling order per step: `tree(rows)` with the number of rows still decoding; then, after a speculative
step, `observe(accepted, offered)` with the step's counts per (depth, rank) summed over its rows
(`decode.accept.tally_ranks`); then `record_time(seconds)` with the step's wall time (the policy's own pick
and a drafter's catch-up on positions it skipped are not in it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TreePolicy:
    """Base class of per-step tree policies (`decode.sizing.AdaptivePolicy` is one)."""

    def tree(self, rows: int):
        """The tree spec for this step's `rows` rows (anything `decode.generate`'s `tree` takes), or None."""
        raise NotImplementedError

    def observe(self, accepted: Sequence[Sequence[int]], offered: Sequence[Sequence[int]]) -> None:
        """A speculative step's acceptance counts per (depth, rank), summed over the batch's rows."""

    def record_time(self, seconds: float) -> None:
        """The wall time of the step just taken with what `tree` last handed out."""


class CallablePolicy(TreePolicy):
    """A function `rows -> tree or None` as a policy that learns nothing."""

    def __init__(self, pick: Callable[[int], object]) -> None:
        self.pick = pick

    def tree(self, rows: int):
        return self.pick(rows)


def as_policy(tree) -> TreePolicy | None:
    """`tree` as a policy when it is one or a callable (a per-step choice), else None (a fixed tree)."""
    if isinstance(tree, TreePolicy):
        return tree
    if callable(tree):
        return CallablePolicy(tree)
    return None
