"""CPU weight layout for the multi-token passes of speculative decoding.

On x86 CPUs, `F.linear(x, W)` with the usual (out, in) row-major weight is slow for a handful of rows: a tree
verify of 4-16 tokens multiplies 4-16 rows. The same product against the weight stored (in, out) row-major is
2-4x faster there, and no faster (sometimes slower) for the single row of plain decoding. Measured on this
project's 2-core CPU (fp32, MKL, microseconds per call, standard / transposed storage):

    (1536, 576) MLP up:  1 row 135 / 93,  8 rows 279 / 144,  16 rows 850 / 188
    (49152, 576) lm_head: 1 row 6065 / 4612, 8 rows 19928 / 10931, 16 rows 32037 / 13790

`pretranspose_linears` keeps both layouts: one-row inputs use the original weight (plain decoding runs exactly
as before), inputs of `min_rows` rows or more use the transposed copy. The patched layers compute the same
product (fp32 rounding may differ in the last bits, as it already does between different row counts), so
greedy speculative decoding still matches plain decoding token for token. Inference only: the copy is taken
once and does not follow later changes to the weight.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

_ATTR = "_selfspec_weight_t"


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    weight = getattr(self, _ATTR) if rows >= self._selfspec_min_rows else self.weight
    return nn.functional.linear(x, weight, self.bias)


def pretranspose_linears(module: nn.Module, *, min_rows: int = 4) -> int:
    """Give every CPU `nn.Linear` under `module` a transposed copy of its weight for inputs of `min_rows` or
    more rows (see the module docstring). Idempotent; layers on other devices are left alone (GPU kernels do
    not need it).

    Args:
        module: a frozen target or a draft head, in inference use.
        min_rows: smallest input row count (all leading dims multiplied) that uses the transposed copy.
    Returns:
        Bytes of memory the copies added (0 when nothing was patched).
    """
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    added = 0
    for layer in module.modules():
        if not isinstance(layer, nn.Linear) or layer.weight.device.type != "cpu":
            continue
        layer._selfspec_min_rows = min_rows
        if hasattr(layer, _ATTR):
            continue
        with torch.no_grad():
            # (out, in) view of an (in, out) row-major copy: F.linear then multiplies by the contiguous copy
            setattr(layer, _ATTR, layer.weight.detach().t().contiguous().t())
        layer.forward = types.MethodType(_forward, layer)
        added += layer.weight.numel() * layer.weight.element_size()
    return added


def is_pretransposed(module: nn.Module) -> bool:
    """True when some `nn.Linear` under `module` carries the transposed copy."""
    return any(hasattr(layer, _ATTR) for layer in module.modules() if isinstance(layer, nn.Linear))
