"""The decoding API's edge: every argument of `decode.generate` is checked here once, before any work, and a
bad one is refused with a message that names it (and the row, for prompts and masks).

What is refused, and why it would otherwise go wrong: ids that are not integers or lie outside the target's
vocabulary (an embedding error deep inside, or a wrong row silently read); an attention mask that is not 0/1,
has a hole (`[1, 0, 1, 1]`) or an empty row (the prefill paths read such a row differently, so the output
would match neither reading); NaN or infinite sampling parameters (a NaN temperature samples token 0 forever);
non-integer counts; stop ids that no target token can match; and targets whose cache decoding does not lay out
(`attention_windows`: chunked attention, layers mixing linear and softmax attention, other cache kinds).
Hybrid targets, whose layers keep recurrent state beside KV layers, decode with chains (`decode.recurrent`).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer


@dataclass(frozen=True)
class Request:
    """A checked decoding request: what the decode loops read."""

    input_ids: Tensor  # (B, T) int64, B >= 1, T >= 1, every id in the target's vocabulary
    attention_mask: Tensor | None  # (B, T) int64 0/1, each row's ones contiguous and last; None = no padding
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos: frozenset[int]  # stop tokens (the given ones, else the model's generation_config's)
    seed: int | None
    windows: dict[str, int | None]  # the target's layer types and their sliding windows (`attention_windows`)
    recurrent: tuple[int, ...] = ()  # a hybrid target's layers with recurrent state (`decode.recurrent`)


def check_request(
    model: nn.Module,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    eos_token_id=None,
    seed=None,
    pad_token_id=0,
) -> Request:
    """Check and normalise the arguments of a decoding call (see the module docstring).

    Args:
        model: the target (its input embedding gives the vocabulary ids must fall in).
        input_ids: (T,) or (B, T) integer token ids.
        attention_mask: None, or (B, T) with 1 on tokens, left-padded.
        max_new_tokens, temperature, top_p, top_k, eos_token_id, seed, pad_token_id: as `decode.generate`.
    Returns:
        the Request (ids as (B, T) int64, on their own device).
    Raises:
        TypeError: an argument of the wrong type (a float count, float ids), named with its value.
        ValueError: a bad value (out of range, NaN, a mask with a hole), named with the value and row; or a
            target decoding cannot serve (`attention_windows`).
    """
    windows = attention_windows(model)  # a target the loop cannot serve is refused first
    vocab = _vocab_size(model)
    ids = _ids(input_ids, vocab)
    if (
        isinstance(attention_mask, Tensor)
        and attention_mask.dim() == 1
        and getattr(input_ids, "ndim", 0) == 1
    ):
        attention_mask = attention_mask[None]  # one prompt's mask, as its ids: (T,) -> (1, T)
    mask = None if attention_mask is None else check_attention_mask(attention_mask, tuple(ids.shape))
    eos = stop_tokens(model, eos_token_id)
    if eos_token_id is not None and eos and all(not 0 <= e < vocab for e in eos):
        # one id in range suffices: a stop list may name other tokenizers' ids too
        raise ValueError(
            f"eos_token_id {sorted(eos)} lies outside the target's vocabulary [0, {vocab}): no token "
            "can stop the reply"
        )
    if seed is not None:  # what torch.Generator.manual_seed takes
        _integer("seed", seed, minimum=-(2**63), maximum=2**64 - 1)
    _integer("pad_token_id", pad_token_id, minimum=-(2**63), maximum=2**63 - 1)  # an int64 of the output
    return Request(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=_integer("max_new_tokens", max_new_tokens, minimum=1),
        temperature=_real("temperature", temperature, low=0.0),
        top_p=_real("top_p", top_p, low=0.0, high=1.0, open_low=True),
        top_k=_integer("top_k", top_k, minimum=0),
        eos=eos,
        seed=seed,
        windows=windows,
        recurrent=tuple(recurrent_layer_indices(model)),
    )


def check_attention_mask(mask, shape: tuple[int, ...]) -> Tensor:
    """`mask` as (B, T) int64 after checking it: the ids' shape, only 0 and 1, and in every row a non-empty,
    contiguous run of ones that ends in the last column (left padding)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"input_ids {shape} and attention_mask {tuple(mask.shape)} must have one (B, T) shape"
        )
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        values = sorted({float(v) for v in mask.flatten().tolist()} - {0.0, 1.0})
        raise ValueError(f"attention_mask must hold only 0 and 1, found {values[0]:g}")
    mask = mask.to(torch.long)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row {empty[0]} has no tokens (all padding): every prompt needs one")
    # left padding: once a row's ones start they run to the end, so the row never steps down from 1 to 0
    holes = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero().flatten().tolist()
    if holes:
        row = holes[0]
        raise ValueError(
            f"attention_mask row {row} is {_show(mask[row])}: prompts must be left-padded, each row's tokens "
            "(1) one contiguous run ending in the last column"
        )
    return mask


def stop_tokens(model: nn.Module, eos_token_id) -> frozenset[int]:
    """The stop token ids: `eos_token_id` (an id, a list of ids, or an integer tensor), else the model's
    generation_config's."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, Tensor):
        if eos_token_id.is_floating_point() or eos_token_id.is_complex() or eos_token_id.dtype == torch.bool:
            raise TypeError(f"eos_token_id must hold integer ids, got a {eos_token_id.dtype} tensor")
        eos_token_id = eos_token_id.flatten().tolist()
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    return frozenset(_integer("eos_token_id", e, minimum=0) for e in ids)


def attention_windows(model: nn.Module) -> dict[str, int | None]:
    """The target's attention layer types, each with its sliding window (None: full attention), read from the
    KV cache transformers lays out for it. Decoding keeps every column in every layer
    (`decode.verify.target_cache`) and applies the windows in its masks (`decode.verify.attention_masks`).
    The recurrent layers of a hybrid target (linear attention, Mamba) are left out: they take no mask, and
    decoding verifies chains over them and rolls their state back (`decode.recurrent`).

    Raises:
        ValueError: a target decoding cannot serve, named with its layers: chunked attention, a hybrid with
            sliding-window layers, layers that mix linear and softmax attention in one cache layer, or any
            other cache layout but plain or sliding-window KV layers and recurrent layers.
    """
    text = model.config.get_text_config(decoder=True)
    name = getattr(text, "model_type", type(model).__name__)
    layers = DynamicCache(config=model.config).layers
    types = list(getattr(text, "layer_types", None) or [])
    if "chunked_attention" in types or getattr(text, "attention_chunk_size", None) is not None:
        raise ValueError(
            f"{name} has chunked attention layers, which decoding does not mask (it supports full and "
            "sliding-window attention)"
        )
    kv_layers = (DynamicLayer, DynamicSlidingWindowLayer)
    known = (*kv_layers, LinearAttentionLayer, DummyLayer)
    other = [i for i, layer in enumerate(layers) if type(layer) not in known]
    if other:
        kinds = ", ".join(sorted({type(layers[i]).__name__ for i in other}))
        raise ValueError(
            f"{name}: layers {other} keep a {kinds} cache; decoding supports targets whose layers keep a "
            "plain or sliding-window KV cache, or a recurrent state (linear attention, Mamba) in layers of "
            "their own"
        )
    recurrent = [i for i, layer in enumerate(layers) if type(layer) is LinearAttentionLayer]
    if len(recurrent) == len(layers):
        raise ValueError(
            f"{name}: every layer keeps recurrent state (a pure state-space or linear-attention model); "
            "decoding supports hybrids, whose other layers attend"
        )
    windowed = [i for i, layer in enumerate(layers) if type(layer) is DynamicSlidingWindowLayer]
    if recurrent and windowed:
        raise ValueError(
            f"{name} is a hybrid target (recurrent layers {recurrent}) with sliding-window layers "
            f"{windowed}: decoding supports hybrids whose attention layers attend fully"
        )
    layers = {i: layer for i, layer in enumerate(layers) if type(layer) in kv_layers}
    windows: dict[str, int | None] = {}
    for i, layer in layers.items():
        window = getattr(layer, "sliding_window", None)
        kind = types[i] if i < len(types) else ("sliding_attention" if window else "full_attention")
        if windows.setdefault(kind, window) != window:
            raise ValueError(
                f"{name}: layers of type {kind!r} have different sliding windows ({windows[kind]}, "
                f"{window}); decoding builds one mask per layer type"
            )
    return windows


def recurrent_layer_indices(model: nn.Module) -> list[int]:
    """The target's layers that keep recurrent state (linear attention, Mamba): a hybrid target's; [] for
    the others."""
    return [
        i
        for i, layer in enumerate(DynamicCache(config=model.config).layers)
        if type(layer) is LinearAttentionLayer
    ]


def _ids(input_ids, vocab: int) -> Tensor:
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (1, T) prompt, got shape {tuple(input_ids.shape)}")
    if ids.shape[0] == 0:
        raise ValueError(f"input_ids holds no prompts (shape {tuple(ids.shape)}): a batch needs a row")
    ids = ids.to(torch.long)
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if outside.numel():
        row, column = outside[0].tolist()
        raise ValueError(
            f"input_ids row {row}, column {column} holds {int(ids[row, column])}, outside the target's "
            f"vocabulary [0, {vocab}) (padding too must be a valid id)"
        )
    return ids


def _vocab_size(model: nn.Module) -> int:
    embedding = model.get_input_embeddings()
    return int(getattr(embedding, "num_embeddings", None) or model.config.get_text_config().vocab_size)


def _integer(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dim() > 0):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def _real(name: str, value, low: float, high: float | None = None, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    if high is None and number < low:
        raise ValueError(f"{name} must be >= {low:g}, got {number}")
    if high is not None and not ((low < number if open_low else low <= number) and number <= high):
        raise ValueError(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {number}")
    return number


def _show(row: Tensor, limit: int = 12) -> str:
    values = row.tolist()
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...]"
