"""Hidden-state capture from any HF decoder-only model, by forward hooks (no copied modeling code).

Tap convention (stored as `aux_layer_ids` in head configs): id i means "the OUTPUT of decoder layer i"
(0-based), which equals `output_hidden_states=True`'s `hidden_states[i + 1]` for every layer but the last
(HF's last entry is after the final norm; a hook on the last layer sees its raw output, and training and
decoding both use these hooks). The other convention in the wild, "input to layer i" (EAGLE official,
vLLM), is this one plus 1; see `to_input_convention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Self

import torch
from torch import Tensor, nn

from heads.typed import check_int_ids

LAST = -1  # pseudo tap id: the decoder's final (post-norm) hidden state, i.e. the lm_head input


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of decoder layers of an HF causal LM; raises for layouts it does not know."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for attr in ("layers", "h", "blocks"):
        layers = getattr(decoder, attr, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (looked for .layers, .h, .blocks on "
        f"{type(decoder).__name__}); selfspec supports HF decoder-only models that expose them"
    )


def default_eagle3_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """Low/mid/high taps of EAGLE-3 in the output-of-layer convention: (1, N/2 - 1, N - 4)."""
    n = num_hidden_layers
    if n < 5:  # tiny test models: three valid ids, avoiding the last layer where possible
        return (0, max(0, n // 2 - 1), max(0, n - 2))
    return (1, n // 2 - 1, n - 4)


def to_input_convention(layer_ids: Sequence[int]) -> list[int]:
    """Output-of-layer ids -> input-to-layer ids (EAGLE official / vLLM style)."""
    return [i + 1 for i in layer_ids]


def from_input_convention(layer_ids: Sequence[int]) -> list[int]:
    """Input-to-layer ids (EAGLE official / vLLM style) -> our output-of-layer ids. Id 0 (the embeddings'
    output, hidden_states[0]) is refused: it has no output-of-layer id, and -1 is `LAST` here."""
    name = "input-to-layer tap ids (id 0 is the embeddings' output, which selfspec's heads do not tap)"
    return [i - 1 for i in check_int_ids(layer_ids, name, low=1)]


class FeatureCapture:
    """Context manager that records the hidden states a head needs during target forwards.

    `layer_ids` holds output-of-layer ids and/or `LAST`. After a forward, `features()` returns the
    captured tensors concatenated on the last axis in the order given: (B, T, len(layer_ids) * H).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        self.model = model
        self.layer_ids = tuple(layer_ids)
        layers = find_decoder_layers(model)
        for i in self.layer_ids:
            if i != LAST and not 0 <= i < len(layers):
                raise ValueError(
                    f"tap layer id {i} out of range: the target has {len(layers)} decoder layers"
                )
        self._layers = layers
        self._store: dict[int, Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, key: int):
        def record(_module: nn.Module, _args, output) -> None:
            if not isinstance(output, Tensor):  # a tuple, or the base decoder's ModelOutput
                output = output[0]
            self._store[key] = output

        return record

    def __enter__(self) -> Self:
        for i in dict.fromkeys(self.layer_ids):
            module = self.model.get_decoder() if i == LAST else self._layers[i]
            self._handles.append(module.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._store.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside an active capture: its hooks are off for the block (which may run a capture of its own) and
        back on after it, even when the block raises."""
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()

    def features(self) -> Tensor:
        """(B, T, K*H) captured states of the last forward, in `layer_ids` order."""
        missing = [i for i in self.layer_ids if i not in self._store]
        if missing:
            raise RuntimeError(
                f"no hidden state captured for tap ids {missing}: run a forward inside the context"
            )
        parts = [self._store[i] for i in self.layer_ids]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
