"""CPU weight layout for the multi-token passes of speculative decoding.

On x86 CPUs, `F.linear(x, W)` with the usual (out, in) row-major weight is slow for a handful of rows: a tree
verify of 4-16 tokens multiplies 4-16 rows. The same product against the weight stored (in, out) row-major is
much faster there, and no faster (sometimes slower) for the single row of plain decoding (measured:
docs/cpu.md, Pretransposed weights).

`pretranspose_linears` keeps both layouts: one-row inputs use the original weight (plain decoding runs exactly
as before), inputs of `min_rows` rows or more use the transposed copy. The patched layers compute the same
product (fp32 rounding may differ in the last bits, as it already does between different row counts), so
greedy speculative decoding still matches plain decoding token for token. The copy serves inference only,
and only while it holds the weight (see "When a copy is read" below).

`int8_linears(module)` swaps Linear layers for int8 weights (per output channel) with int8 dynamic
activations, fbgemm's x86 kernels; `decode.prepare.quantize_draft` applies it to the draft only. Draft passes
read every weight of the head for a handful of rows, so they are bound by memory traffic, and int8 moves a
quarter of the bytes (measured: docs/cpu.md, int8 drafts).
Verification still runs the unchanged target, so decoding stays lossless: greedy output is the target's, and
sampling accepts against the draft distribution the int8 head actually proposed from. Only acceptance can
move.

`pack_linears(module, rows)` goes one step further for the ONE row count a tree verify always passes (a static
tree's node count, a dynamic tree's total_tokens + 1): it stores MKL's packed form of each weight for exactly
that many rows (`cblas_sgemm_pack`, what torch's inductor uses for frozen CPU linears). It cut the target's
verify forward further at 9 and 13 rows and gained nothing at 5 (measured: docs/cpu.md, MKL-packed weights).
The packed buffers are about 4x the weights, so a module holds one packed row count at a time.

Why not torch's own inductor path: with `torch._inductor.config.freezing = True`, `torch.compile` (torch 2.13)
packs each frozen fp32 Linear with the same `_mkl_reorder_linear_weight` / `_mkl_linear` pair, but only for a
static row count (a dynamic one falls back to oneDNN's `_linear_pointwise`), and `options={"freezing": True}`
does not freeze. Its verify forwards were slower than this module's, with the same argmax; it compiles for
tens of seconds per graph, and needs a new graph per row count, per cache length until that dimension turns
dynamic, and per cropped (non-contiguous) cache as `compact_cache` leaves it. Compiling only paid for one-row
plain decoding, which is not what this module speeds up (measured: docs/cpu.md, Why not torch.compile).

`onednn_linears(module)` supersedes both on CPUs where oneDNN has fast fp32 kernels and MKL does not: it
keeps oneDNN's reordered (blocked) copy of each fp32 weight (`torch.ops.mkldnn._reorder_linear_weight`, the
same bytes as the weight) and multiplies EVERY row count through `torch.ops.mkldnn._linear_pointwise`, plain
decoding's single row included. On some CPUs (the AMD EPYC this project was measured on among them) MKL's
sgemm takes a slow path for a handful of rows, where two rows cost about twice one; oneDNN does not, so every
forward of the target gets cheaper, plain decoding's too (measured: docs/cpu.md, oneDNN reordered weights).
A row's result does not depend on the other rows of its call (a row alone and inside 13 rows give bitwise
the same lm_head output), so verification scores a tree node exactly as plain decoding scores the same
prefix, where the MKL layouts differ in the last bits.

When a copy is read. The three copies (oneDNN's reordered weight, the transposed copy, the packed weight) are
taken from fp32 CPU weights and held beside the module's tensors: `state_dict()` does not save them and
`.to()` does not move them (the reordered and packed ones are opaque mkldnn tensors it could not move). A
layer reads a copy only while its weight is the very tensor the copy was taken from, unchanged: the same
storage (the copy's record keeps it alive, so a weight moved or cast away and back cannot land on the old
address), dtype and shape, the same version counter (in-place writes through the parameter, such as
`load_state_dict`, bump it), and the same count of optimizer steps. That count is needed because fused
optimizers (`fused=True` AdamW, Adam, SGD) update weights in place without bumping their version counters:
importing this module registers a global optimizer step post-hook that counts a step on every tensor the
stepping optimizer holds. Tensors no optimizer holds keep their copies (a frozen target stays fast while an
optimizer trains a draft head). The input must also be an fp32 CPU tensor outside autocast, in a pass that
needs no gradient (neither input, weight nor bias): the copies have no backward. Anything else (a moved,
cast, loaded, trained or edited weight, another dtype, autocast, a pass that autograd records) runs the
ordinary `F.linear` with the weight, so a stale copy is never read and every weight gets its gradient; a
stale copy is freed at the layer's next call, and the next `onednn_linears`, `pretranspose_linears` or
`pack_linears` call takes a new one. Writes that bump no version counter (through `weight.data` in place,
`w.data += d`; through a NumPy or DLPack alias of the weight; into its storage) are not seen there:
`decode.generate` calls `drop_changed` once per call, which compares a few sampled rows of each weight with
their values when copied, so a whole-tensor write (a reload) is seen before any token; after a partial write
of that kind call these with `force=True`, or `decode.prepare`, which takes every copy again.
`targets.merge_lora` merges by replacing storage, which is seen.

A leaf: this module knows `nn.Linear` only (no heads, trees or decoding loop).
"""

from __future__ import annotations

import types
import uuid
import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_ONEDNN = "_selfspec_onednn"  # layer attribute: a `_Copy` holding oneDNN's reordered weight
_WEIGHT_T = "_selfspec_weight_t"  # layer attribute: a `_Copy` holding the (out, in) view of an (in, out) copy
_PACKED = "_selfspec_packed"  # layer attribute: a `_Copy` holding MKL's packed weight for `rows` rows
# tensor attribute: how many optimizer steps have held it (see `_count_step`). Named per copy of this module:
# a second copy (a reload, or an earlier revision's decode/ that `benchmarks.ab` imports under another name)
# registers its own hook, which then counts on its own attribute instead of counting every step twice here
_STEPS = f"_selfspec_steps_{uuid.uuid4().hex}"


class _Copy(NamedTuple):
    """A copy of a layer's weight in another layout, and the state of the weight it was taken from."""

    tensor: Tensor  # the copy
    source: Tensor  # the weight, detached: keeps its storage alive, so no other tensor can take its address
    version: int  # the weight's version counter (bumped by in-place writes through the parameter)
    steps: int  # optimizer steps over the weight (fused optimizers write without bumping the version)
    rows: int | None = None  # a packed copy: the one row count it serves
    sample: Tensor | None = None  # `value_sample` of the weight when copied (`drop_changed` compares it)


def _count_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """After any optimizer step: count a step on every tensor the optimizer holds."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            setattr(param, _STEPS, getattr(param, _STEPS, 0) + 1)


register_optimizer_step_post_hook(_count_step)  # global, once per copy of this module


def _holds(weight: Tensor, copy: _Copy) -> bool:
    """True while `weight` is the tensor `copy` was taken from, unchanged: same storage, dtype and shape, no
    in-place write through it and no optimizer step over it since."""
    return (
        weight.data_ptr() == copy.source.data_ptr()
        and weight._version == copy.version
        and steps_over(weight) == copy.steps
        and weight.dtype == copy.source.dtype
        and weight.shape == copy.source.shape
    )


def _current(layer: nn.Module, key: str) -> _Copy | None:
    """The layer's copy under `key` while it holds the layer's weight; a stale one is dropped (freed)."""
    copy = layer.__dict__.get(key)
    if copy is None or _holds(layer.weight, copy):
        return copy
    del layer.__dict__[key]
    return None


def _take(layer: nn.Linear, key: str, make, rows: int | None = None) -> int:
    """Store `make(weight)` as the layer's copy under `key` (the old copy freed first); returns its bytes."""
    layer.__dict__.pop(key, None)
    weight = layer.weight
    with torch.no_grad():
        source = weight.detach()
        copy = make(source)
    layer.__dict__[key] = _Copy(copy, source, weight._version, steps_over(weight), rows, value_sample(source))
    layer.forward = types.MethodType(_forward, layer)
    return weight.numel() * weight.element_size()


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not (
        rows
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and not (torch.is_grad_enabled() and _needs_grad(x, self))  # the copies have no backward
    ):
        return nn.functional.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    onednn = _current(self, _ONEDNN)  # looked up in the order they are preferred: one lookup on oneDNN CPUs
    if onednn is not None:
        out = torch.ops.mkldnn._linear_pointwise(flat, onednn.tensor, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])
    packed = _current(self, _PACKED)
    if packed is not None and rows == packed.rows:
        out = torch.ops.mkl._mkl_linear(flat, packed.tensor, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    transposed = _current(self, _WEIGHT_T)
    use_t = transposed is not None and rows >= self._selfspec_min_rows
    return nn.functional.linear(x, transposed.tensor if use_t else self.weight, self.bias)


def _needs_grad(x: Tensor, layer: nn.Linear) -> bool:
    return (
        x.requires_grad or layer.weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad)
    )


def _packable(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32


def _fp32_linears(module: nn.Module) -> list[nn.Linear]:
    """The `nn.Linear` layers under `module` whose weight is fp32 on the CPU."""
    return [layer for layer in module.modules() if isinstance(layer, nn.Linear) and _packable(layer.weight)]


def value_sample(tensor: Tensor, clone: bool = True) -> Tensor:
    """About 8 whole rows of `tensor` (every (n / 8)-th), cloned (else a view): what `drop_changed` compares
    to see writes that bump no version counter."""
    tensor = tensor.detach()
    rows = tensor if tensor.dim() else tensor[None]
    rows = rows[:: max(1, rows.shape[0] // 8)]
    return rows.clone() if clone else rows


def drop_changed(module: nn.Module) -> int:
    """Drop the copies under `module` whose weight's values changed without a version bump (a write through
    `weight.data`, a NumPy or DLPack alias, the storage): a whole-tensor write (a reload) always shows in the
    sampled rows, an edit of other rows does not. `decode.generate` calls it once per call (3-5 ms on the
    default target); returns how many copies were dropped."""
    dropped = 0
    for layer in module.modules():
        for key in (_ONEDNN, _WEIGHT_T, _PACKED):
            copy = layer.__dict__.get(key)
            if (
                copy is not None
                and copy.sample is not None
                and not torch.equal(value_sample(layer.weight, clone=False), copy.sample)
            ):
                del layer.__dict__[key]
                dropped += 1
    return dropped


def steps_over(tensor: Tensor) -> int:
    """How many optimizer steps have held `tensor` in this process (fused optimizers update weights without
    bumping their version counters; this count sees them)."""
    return getattr(tensor, _STEPS, 0)


def can_pack() -> bool:
    """True when this torch build has MKL's packed sgemm (x86 CPU wheels do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def can_onednn() -> bool:
    """True when this torch build multiplies fp32 Linear layers through oneDNN with reordered weights (the x86
    CPU wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_linears(module: nn.Module, *, rows_hint: int = 64, force: bool = False) -> int:
    """Give every fp32 CPU `nn.Linear` under `module` oneDNN's reordered copy of its weight, used for inputs
    of every row count (see the module docstring). Idempotent: a layer whose copy still holds its weight
    keeps it; one whose weight changed since gets a new copy. Other layers (other devices or dtypes, int8)
    are left alone. Passes that autograd records run `F.linear`.

    Args:
        module: a frozen target or a draft head.
        rows_hint: the row count oneDNN picks its blocking for; any count runs. 64 was fastest on the
            default target's lm_head for every count from 1 to 17 rows (measured: docs/cpu.md, oneDNN
            reordered weights).
        force: take every copy again, also those that look current (after writing weights through `.data`).
    Returns:
        Bytes the copies hold (0 when nothing was patched or this build has no such kernels).
    """
    if not can_onednn():
        return 0
    held = 0
    for layer in _fp32_linears(module):
        if force or _current(layer, _ONEDNN) is None:
            _take(layer, _ONEDNN, lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint))
        held += layer.weight.numel() * layer.weight.element_size()
    return held


def drop_onednn(module: nn.Module) -> int:
    """Remove the oneDNN copies `onednn_linears` gave the layers under `module` (they run `F.linear` again, or
    their MKL copies); returns how many layers had one."""
    return sum(layer.__dict__.pop(_ONEDNN, None) is not None for layer in module.modules())


def is_onednn(module: nn.Module) -> bool:
    """True when some `nn.Linear` under `module` multiplies through a valid oneDNN reordered copy."""
    return any(onednn_weight(layer) is not None for layer in module.modules())


def onednn_weight(layer: nn.Module) -> Tensor | None:
    """The layer's oneDNN reordered weight while it still holds the weight, else None (a stale one is
    dropped)."""
    return _tensor(layer, _ONEDNN)


def _tensor(layer: nn.Module, key: str) -> Tensor | None:
    """The tensor of the layer's valid copy under `key`, or None."""
    copy = _current(layer, key) if isinstance(layer, nn.Linear) else None
    return None if copy is None else copy.tensor


def pretranspose_linears(module: nn.Module, *, min_rows: int = 4, force: bool = False) -> int:
    """Give every fp32 CPU `nn.Linear` under `module` a transposed copy of its weight for inputs of `min_rows`
    or more rows (see the module docstring). Idempotent: a layer whose copy still holds its weight keeps it;
    other layers (other devices or dtypes) are left alone. Passes that autograd records run `F.linear`.

    Args:
        module: a frozen target or a draft head.
        min_rows: smallest input row count (all leading dims multiplied) that uses the transposed copy.
        force: take every copy again, also those that look current (after writing weights through `.data`).
    Returns:
        Bytes of memory the new copies hold (0 when every layer kept its copy).
    """
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    added = 0
    for layer in _fp32_linears(module):
        layer._selfspec_min_rows = min_rows
        if force or _current(layer, _WEIGHT_T) is None:
            # (out, in) view of an (in, out) row-major copy: F.linear then multiplies by the contiguous copy
            added += _take(layer, _WEIGHT_T, lambda weight: weight.t().contiguous().t())
    return added


def drop_pretranspose(module: nn.Module) -> int:
    """Remove the transposed copies `pretranspose_linears` gave the layers under `module`, and their packed
    weights; returns how many layers had a copy."""
    pack_linears(module, None)
    return sum(layer.__dict__.pop(_WEIGHT_T, None) is not None for layer in module.modules())


def is_pretransposed(module: nn.Module) -> bool:
    """True when some `nn.Linear` under `module` carries a valid transposed copy."""
    return any(transposed_weight(layer) is not None for layer in module.modules())


def transposed_weight(layer: nn.Module) -> Tensor | None:
    """The layer's transposed copy ((out, in), stored (in, out) row-major) while it still holds the weight,
    else None (a stale one is dropped)."""
    return _tensor(layer, _WEIGHT_T)


def transpose_min_rows(module: nn.Module) -> int | None:
    """The smallest row count for which `module`'s (first) pretransposed layer uses its copy, or None."""
    return next(
        (layer._selfspec_min_rows for layer in module.modules() if transposed_weight(layer) is not None), None
    )


def pack_linears(module: nn.Module, rows: int | None, *, force: bool = False) -> int:
    """Make every pretransposed fp32 CPU `nn.Linear` under `module` multiply inputs of exactly `rows` rows
    with an MKL-packed weight (see the module docstring); `rows=None` drops the packed weights. A new row
    count replaces the previous one (the buffers are large). A no-op where MKL packing is unavailable.

    Args:
        module: a module already passed to `pretranspose_linears` (layers without a valid transposed copy
            are not packed).
        rows: the row count of the passes to speed up, typically `decode.tree.verify_rows(tree)`; >= 2.
        force: pack every layer again, also those whose packed weight looks current.
    Returns:
        Bytes the packed buffers now hold (0 when nothing is packed).
    """
    if rows is not None and rows < 2:
        raise ValueError(f"rows must be >= 2 (one-row passes keep the original weight), got {rows}")
    held = 0
    for layer in module.modules():
        if rows is None or not can_pack() or transposed_weight(layer) is None:
            layer.__dict__.pop(_PACKED, None)
            continue
        current = _current(layer, _PACKED)
        if force or current is None or current.rows != rows:
            _take(layer, _PACKED, lambda weight: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), rows)
        buffer = layer.__dict__[_PACKED].tensor
        held += buffer.numel() * buffer.element_size()
    return held


def packed_weight(layer: nn.Module) -> Tensor | None:
    """The layer's MKL-packed weight (an opaque fp32 CPU tensor) while it still holds the weight, else
    None."""
    return _tensor(layer, _PACKED)


def packed_rows(module: nn.Module) -> int | None:
    """The row count `module`'s layers are packed for, or None."""
    return next(
        (layer.__dict__[_PACKED].rows for layer in module.modules() if packed_weight(layer) is not None), None
    )


def can_int8() -> bool:
    """True when this torch build has the x86 (fbgemm) kernels `int8_linears` needs."""
    return bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))


def int8_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Swap the `nn.Linear` layers under `module` (not `module` itself, nor those named in `skip`) for
    fbgemm's dynamic int8 Linear (per output channel weights), in place; their copies go with them."""
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


def is_int8_linear(layer: nn.Module) -> bool:
    """True for fbgemm's dynamic int8 Linear (what `int8_linears` swaps in)."""
    return isinstance(layer, torch.ao.nn.quantized.dynamic.Linear)
