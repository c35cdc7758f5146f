"""Dataclasses from plain data (YAML, JSON): unknown keys, wrong types and missing required keys fail with the
dotted key and its origin named, before anything is built from them. Run configs (`train.config`) and head
configs (`heads.io`) are read through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
import numbers
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be loaded: unknown key, wrong type, bad choice or missing required key."""


def misspelt(key: str, known) -> str | None:
    """The known key that `key` (not itself known) looks like a slip of (`base_num_hidden_layer` for
    `base_num_hidden_layers`), or None. For mappings that take free-form keys beside the ones read: a slip
    there is not unknown, it is a key read as absent."""
    if key in known:
        return None
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.85)
    return close[0] if close else None


def check_int_ids(ids, name: str, low: int = 0) -> tuple[int, ...]:
    """`ids` as a tuple of ints, each >= `low`; floats (1.5, 2.0), bools and strings are refused, not cut."""
    out = []
    for i in ids:
        whole = isinstance(i, numbers.Integral) and not isinstance(i, bool)
        if not whole or i < low:
            raise ValueError(f"{name} must hold integer ids >= {low}, got {i!r} in {list(ids)!r}")
        out.append(int(i))
    return tuple(out)


def taps_out_of_order(ids: Sequence[int]) -> bool:
    """Whether tap ids are listed out of layer order: vLLM and SGLang concatenate a head's taps in layer
    order whatever order its config lists them in, so a head trained on another order would read its
    features permuted (no error, fewer drafts accepted)."""
    return any(b < a for a, b in itertools.pairwise(ids))


def check_tap_order(ids: Sequence[int], name: str) -> None:
    """Refuse tap ids out of layer order (`taps_out_of_order`)."""
    if taps_out_of_order(ids):
        raise ValueError(
            f"{name} must be in increasing layer order (the engines concatenate taps in layer order), "
            f"got {list(ids)!r}"
        )


def build_dataclass(
    cls: type[T], raw: Any, prefix: str = "", where: Callable[[str], str] = lambda key: "the given data"
) -> T:
    """One dataclass from its raw mapping, recursing into nested dataclass sections.

    Args:
        cls: the dataclass.
        raw: a mapping of its fields (None: all defaults).
        prefix: the dotted key of this section in the whole config ("" at the top), for messages.
        where: names where a dotted key came from (a file, an override), for messages.
    Raises:
        ConfigError: (a ValueError) unknown key, wrong type or missing required key, naming the dotted key;
            a `__post_init__` ValueError is re-raised as one, with the section and origin added.
    """
    section = prefix.rstrip(".") or "the top level"
    raw = {} if raw is None else raw  # an empty section (`eagle:`) means all defaults
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping (section), got {raw!r} in {where(section)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted((f"{prefix}{key}" for key in raw if key not in fields), key=str)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]} in {where(unknown[0])}; valid keys of {section}: {', '.join(fields)}"
        )
    kwargs, missing = {}, []
    for name, f in fields.items():
        tp, dotted = hints[name], prefix + name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if dataclasses.is_dataclass(tp) and (name in raw or required):
            kwargs[name] = build_dataclass(tp, raw.get(name), dotted + ".", where)
        elif name in raw:
            kwargs[name] = _convert(raw[name], tp, dotted, where)
        elif required:
            missing.append(dotted)
    if missing:
        raise ConfigError(f"missing required key(s) {', '.join(missing)} in {where(section)} (no default)")
    try:
        return cls(**kwargs)
    except ValueError as error:  # __post_init__ messages start with the field name: add section and source
        name = str(error).split(" ", 1)[0]
        origin = where(prefix + name if name in fields else section)
        raise ConfigError(f"{prefix}{error} (in {origin})") from None


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) and not get_args(tp) else str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str, where: Callable[[str], str], shown: str = "") -> Any:
    """`value` checked against `tp` (int widened to float); `shown` names the type in errors (`X | None`)."""
    origin, args = get_origin(tp), get_args(tp)

    def wrong() -> ConfigError:
        hint = " (quote strings YAML reads as numbers: key='0123')" if str in (tp, *args) else ""
        found = f"{value!r} ({type(value).__name__})"
        return ConfigError(f"{key}: expected {shown or _type_name(tp)}, got {found} in {where(key)}{hint}")

    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) == 1:  # Optional[X]: X's own error, which may name a list index
            return _convert(value, options[0], key, where, shown or _type_name(tp))
        for option in options:
            with contextlib.suppress(ConfigError):
                return _convert(value, option, key, where)
        raise wrong()
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)) or (origin is list and isinstance(value, tuple)):
            raise wrong()
        if origin is tuple and args[1:] != (Ellipsis,):  # fixed-length tuple[X, Y]: one type per position
            if len(value) != len(args):
                raise wrong()
            return tuple(_convert(v, a, f"{key}[{i}]", where) for i, (v, a) in enumerate(zip(value, args)))
        items = [_convert(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is dict and isinstance(value, dict):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)  # `1` for a float field is fine; stored as 1.0
    if tp in (int, str, bool) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise wrong()
