"""`prepare`: the one call that readies a target and its draft heads for fast decoding on their device."""

from __future__ import annotations

import torch
from torch import nn

from decode.layout import (
    can_int8,
    can_pack,
    is_int8_draft,
    pack_for_tree,
    pretranspose_linears,
    quantize_draft,
)


def prepare(
    model: nn.Module,
    heads: nn.Module | None = None,
    tree=None,
    *,
    pretranspose: bool | None = None,
    int8_draft: bool | None = None,
) -> nn.Module | None:
    """Apply what the measurements in `decode/layout.py` support for decoding `model` with `heads` and `tree`;
    returns the heads to pass to `generate` (the same object, changed in place).

    On an x86 CPU (MKL and fbgemm present) with an fp32 target: int8 draft weights, pretransposed weight
    copies for multi-token passes, and MKL-packed weights for the tree's verify row count. Elsewhere (CUDA,
    other CPUs, half precision) nothing is changed. Greedy output stays token for token that of plain
    decoding; int8 drafts can only move acceptance. Call it again with another tree before decoding with that
    tree (re-packing takes about 0.2 s on the default target); the other steps are done once.

    Args:
        model: the target, in inference use.
        heads: the draft heads (None for plain decoding, which then keeps its one-row passes as they are).
        tree: the tree `generate` will get (None: the heads' default tree).
        pretranspose: force the weight copies and packing on (True) or off (False); None: where they help.
        int8_draft: force int8 draft weights on or off; None: on where fbgemm's x86 kernels exist.
    """
    fast_cpu = model.device.type == "cpu" and getattr(model, "dtype", None) == torch.float32
    if int8_draft is None:
        int8_draft = fast_cpu and can_int8()
    if pretranspose is None:
        pretranspose = fast_cpu and can_pack()
    if heads is not None and int8_draft and not is_int8_draft(heads):
        quantize_draft(heads, model)
    if pretranspose:
        pretranspose_linears(model)
        if heads is not None:
            pretranspose_linears(heads)
    pack_for_tree(model, heads, tree)
    return heads
