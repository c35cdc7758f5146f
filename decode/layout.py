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

`quantize_draft(heads, target)` is for the draft only: int8 weights (per output channel) with int8 dynamic
activations, fbgemm's x86 kernels. Draft passes read every weight of the head for a handful of rows, so they
are bound by memory traffic; int8 cuts it 4x. Measured on this project's 2-core CPU (microseconds per call,
fp32 pretransposed / int8): (8192, 576) EAGLE-3 draft lm_head, 4 rows 1041 / 213; (1536, 576) 4 rows 129 / 66.
Verification still runs the unchanged target, so decoding stays lossless: greedy output is the target's, and
sampling accepts against the draft distribution the int8 head actually proposed from. Only acceptance can
move.

`pack_linears(module, rows)` goes one step further for the ONE row count a tree verify always passes (a static
tree's node count, a dynamic tree's total_tokens + 1): it stores MKL's packed form of each weight for exactly
that many rows (`cblas_sgemm_pack`, what torch's inductor uses for frozen CPU linears). Whole target, one
process, interleaved A/B (ms per verify forward above 200 cached tokens, transposed / packed): 9 rows 92 / 78,
13 rows 95 / 78; 5 rows 77 / 78 (no gain). The packed buffers are about 4x the weights (2.6 GiB for the
default target), so a module holds one packed row count at a time; packing it takes about 0.2 s.
"""

from __future__ import annotations

import types
import warnings

import torch
from torch import Tensor, nn

_ATTR = "_selfspec_weight_t"
_PACKED = "_selfspec_packed"  # (rows, MKL-packed weight) or absent


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    packed = getattr(self, _PACKED, None)
    if packed is not None and rows == packed[0]:
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed[1], self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    weight = getattr(self, _ATTR) if rows >= self._selfspec_min_rows else self.weight
    return nn.functional.linear(x, weight, self.bias)


def can_pack() -> bool:
    """True when this torch build has MKL's packed sgemm (x86 CPU wheels do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def pack_linears(module: nn.Module, rows: int | None) -> int:
    """Make every pretransposed fp32 `nn.Linear` under `module` multiply inputs of exactly `rows` rows with an
    MKL-packed weight (see the module docstring); `rows=None` drops the packed weights. A new row count
    replaces the previous one (the buffers are large). A no-op where MKL packing is unavailable.

    Args:
        module: a module already passed to `pretranspose_linears` (other layers are left alone).
        rows: the row count of the passes to speed up, typically `decode.tree.verify_rows(tree)`; >= 2.
    Returns:
        Bytes the packed buffers now hold (0 when nothing is packed).
    """
    if rows is not None and rows < 2:
        raise ValueError(f"rows must be >= 2 (one-row passes keep the original weight), got {rows}")
    held, packable = 0, rows is not None and can_pack()
    for layer in module.modules():
        if not isinstance(layer, nn.Linear) or not hasattr(layer, _ATTR):
            continue
        current = getattr(layer, _PACKED, None)
        if not packable or layer.weight.dtype != torch.float32:
            if current is not None:
                delattr(layer, _PACKED)
            continue
        if current is None or current[0] != rows:
            with torch.no_grad():
                setattr(
                    layer,
                    _PACKED,
                    (rows, torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows)),
                )
        buffer = getattr(layer, _PACKED)[1]
        held += buffer.numel() * buffer.element_size()
    return held


def packed_rows(module: nn.Module) -> int | None:
    """The row count `module`'s layers are packed for, or None."""
    return next((getattr(layer, _PACKED)[0] for layer in module.modules() if hasattr(layer, _PACKED)), None)


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


def pack_for_tree(target: nn.Module, heads: nn.Module | None, tree) -> None:
    """Pack the pretransposed target for the tree's verify row count and, for a dynamic tree, an EAGLE head
    for its `top_k` rows per level (each level of a dynamic tree expands exactly top_k nodes). Modules that
    were not pretransposed are left alone; other trees and heads drop their packed weights.

    Args:
        target: the target model.
        heads: the draft heads passed to `generate` (or None for plain decoding).
        tree: the tree passed to `generate` (a `DynamicTree`, rank paths, a tree name, `TreeBuffers`
            or None for the heads' default tree).
    """
    from decode.generate import resolve_tree
    from decode.tree import verify_rows

    tree = resolve_tree(heads, tree, target.device)
    pack_linears(target, None if tree is None else verify_rows(tree))
    if isinstance(heads, nn.Module):
        pack_linears(heads, head_rows(heads, tree))


def head_rows(heads: nn.Module, tree) -> int | None:
    """The row count a draft head is packed for with this (resolved) tree: an EAGLE head's `top_k` on a
    dynamic tree (every level expands exactly top_k nodes), else None (row counts vary or are 1)."""
    from decode.tree import DynamicTree
    from heads.eagle import EagleHead

    dynamic = isinstance(heads, EagleHead) and isinstance(tree, DynamicTree) and tree.top_k >= 2
    return tree.top_k if dynamic else None


DRAFT_LM_HEAD = "_selfspec_draft_lm_head"  # int8 copy of the target's lm_head for drafts that share it


def _int8_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Swap the `nn.Linear` layers under `module` (not `module` itself, nor those named in `skip`) for
    fbgemm's dynamic int8 Linear, in place."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    names = {
        name for name, layer in module.named_modules() if isinstance(layer, nn.Linear) and name not in skip
    }
    # torch.ao.quantization announces its move to torchao; the kernels are here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(
            module, {name: per_channel_dynamic_qconfig for name in names}, dtype=torch.qint8, inplace=True
        )


def can_int8() -> bool:
    """True when this torch build has the x86 (fbgemm) kernels `quantize_draft` needs."""
    return bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))


def quantize_draft(heads: nn.Module, target: nn.Module | None = None) -> nn.Module:
    """Give the draft int8 weights for decoding (see the module docstring), in place; returns `heads`.

    Every `nn.Linear` of the heads becomes a dynamic int8 Linear (pretransposed or packed copies are dropped
    with the old layers), except an EAGLE head's `fc`: it reads the target's raw hidden states, whose outlier
    channels one int8 activation scale per tensor cannot hold (measured on the default target's EAGLE-3 head,
    3 chat
    prompts: tau 3.18 with fc kept in fp32, as with the fp32 head; 2.56 with fc in int8). `fc` runs once per
    step, on the accepted tokens only. Heads that project with the target's lm_head (Medusa `share_lm_head`,
    EAGLE-1) get an int8 copy of it that only their drafts use; the target itself is not touched. Inference
    only: do not train or save quantized heads (their Linear weights are no longer parameters).

    Args:
        heads: MedusaHeads or an EagleHead, fp32, on the CPU.
        target: the target whose lm_head the heads share; required for such heads.
    Raises:
        RuntimeError: this torch build has no x86 quantized engine.
        ValueError: heads off the CPU or not fp32, or a shared lm_head without `target`.
    """
    from heads.eagle import EagleHead
    from heads.medusa import MedusaHeads

    if not can_int8():
        raise RuntimeError(
            "int8 drafts need fbgemm (x86) kernels; this torch build has "
            f"{torch.backends.quantized.supported_engines}"
        )
    floats = [p for p in (*heads.parameters(), *heads.buffers()) if p.is_floating_point()]
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in floats):
        raise ValueError(
            "int8 drafts are for fp32 heads on the CPU; these heads hold "
            f"{sorted({f'{p.dtype} on {p.device}' for p in floats})}"
        )
    shares = (isinstance(heads, MedusaHeads) and heads.config.share_lm_head) or (
        isinstance(heads, EagleHead) and heads.head_type == "eagle1"
    )
    if shares:
        if target is None:
            raise ValueError(f"these {type(heads).__name__} project with the target's lm_head: pass target=")
        shared = target.get_output_embeddings()
        plain = nn.Linear(shared.in_features, shared.out_features, bias=shared.bias is not None)
        plain.weight, plain.bias = (
            shared.weight,
            shared.bias,
        )  # the target's tensors, read once by the quantizer
        holder = nn.Sequential(plain)
        _int8_linears(holder)
        object.__setattr__(heads, DRAFT_LM_HEAD, holder[0])  # not a submodule: stays out of state_dict()
    _int8_linears(heads, skip=("fc",) if isinstance(heads, EagleHead) else ())
    return heads


def draft_lm_head(heads: nn.Module, target: nn.Module) -> nn.Module:
    """The lm_head a draft that shares the target's projects with: its int8 copy, if any, else the
    target's."""
    own = heads.__dict__.get(DRAFT_LM_HEAD)
    return own if own is not None else target.get_output_embeddings()


def is_int8_draft(heads: nn.Module) -> bool:
    """True when `quantize_draft` has been applied to `heads`."""
    from heads.io import quantized_layers

    return bool(quantized_layers(heads))
