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
once and does not follow later changes to the weight's values.

`int8_linears(module)` swaps Linear layers for int8 weights (per output channel) with int8 dynamic
activations, fbgemm's x86 kernels; `decode.prepare.quantize_draft` applies it to the draft only. Draft passes
read every weight of the head for a handful of rows, so they are bound by memory traffic; int8 cuts it 4x.
Measured on this project's 2-core CPU (microseconds per call, fp32 pretransposed / int8): (8192, 576) EAGLE-3
draft lm_head, 4 rows 1041 / 213; (1536, 576) 4 rows 129 / 66.
Verification still runs the unchanged target, so decoding stays lossless: greedy output is the target's, and
sampling accepts against the draft distribution the int8 head actually proposed from. Only acceptance can
move.

`pack_linears(module, rows)` goes one step further for the ONE row count a tree verify always passes (a static
tree's node count, a dynamic tree's total_tokens + 1): it stores MKL's packed form of each weight for exactly
that many rows (`cblas_sgemm_pack`, what torch's inductor uses for frozen CPU linears). Whole target, one
process, interleaved A/B (ms per verify forward above 200 cached tokens, transposed / packed): 9 rows 92 / 78,
13 rows 95 / 78; 5 rows 77 / 78 (no gain). The packed buffers are about 4x the weights (2.6 GiB for the
default target), so a module holds one packed row count at a time; packing it takes about 0.2 s.

Why not torch's own inductor path: with `torch._inductor.config.freezing = True`, `torch.compile` (torch 2.13)
packs each frozen fp32 Linear with the same `_mkl_reorder_linear_weight` / `_mkl_linear` pair, but only for a
static row count (a dynamic one falls back to oneDNN's `_linear_pointwise`), and `options={"freezing": True}`
does not freeze. Measured on the default target (one thread, 200 cached tokens, interleaved, ms per verify
forward, eager / ours / frozen compile): 9 rows 123 / 91 / 110, 13 rows 160 / 98 / 148, outputs matching
(argmax identical). It also compiles for 35-66 s per graph, and needs a new graph per row count, per cache
length until that dimension turns dynamic, and per cropped (non-contiguous) cache as `compact_cache` leaves
it. Compiling only paid for one-row plain decoding (51 vs 63 ms), which is not what this module speeds up.

`onednn_linears(module)` supersedes both on CPUs where oneDNN has fast fp32 kernels and MKL does not: it
keeps oneDNN's reordered (blocked) copy of each fp32 weight (`torch.ops.mkldnn._reorder_linear_weight`, the
same bytes as the weight) and multiplies EVERY row count through `torch.ops.mkldnn._linear_pointwise`, plain
decoding's single row included. On this project's machine (AMD EPYC, AVX-512 with BF16, 2 cores) MKL's sgemm
takes its slow path for a handful of rows; oneDNN does not. Measured in one process (microseconds per call,
MKL standard / oneDNN reordered):

    (1536, 576) MLP up:  1 row 55 / 39,  2 rows 107 / 38,  13 rows 230 / 71
    (49152, 576) lm_head: 1 row 7207 / 3193, 2 rows 15391 / 2388, 13 rows 11274 / 3178

and over the whole default target (ms per forward above 200 cached tokens, MKL with the transposed and packed
copies / oneDNN): 1 token 49.1 / 31.6, 4 tokens 66.3 / 32.6, 13 tokens 73.4 / 40.5, 24 tokens 92.1 / 48.6.
A row's result does not depend on the other rows of its call (measured: a row alone and inside 13 rows give
bitwise the same lm_head output), so verification scores a tree node exactly as plain decoding scores the
same prefix, where the MKL layouts differ in the last bits. The reordered weight is an opaque mkldnn tensor
that cannot follow `.to()`; a layer uses it only while its weight is the very tensor it was taken from
(same storage, no in-place change since; the record holds that storage, so a weight moved or cast away and
back cannot land on the old address) and the input is an fp32 CPU tensor outside autocast that needs no
gradient (neither input, weight nor bias). Anything else (a moved, cast or edited weight, another dtype,
autocast, a pass that autograd records) runs the ordinary `F.linear`, so a stale copy is never read and
gradients still flow; a stale copy is freed at the layer's next call. One edit goes unseen: writing through
`weight.data` in place (`w.data += d`) bumps no version counter, so after such an edit call `onednn_linears`
again with `force=True` (or `drop_onednn`). `heads.target.merge_lora` merges by replacing storage, which is
seen.

The transposed copy is a non-persistent buffer of its layer: `state_dict()` is unchanged, and `.to()` moves
and casts it with the weight, which keeps it valid wherever it goes (the same values, cast the same way). The
packed weight cannot follow: it is an opaque MKL (mkldnn) tensor that `Module.to()` can neither move nor cast
(torch raises inside `_apply`), so it is held beside the module's tensors and stays on the CPU. A layer
moved off the CPU or cast to another dtype therefore refuses inputs of its packed row count, with an error
naming the layer, until `pack_linears(module, None)` (or `decode.prepare` on the new device or dtype, which
calls it) drops the packed weight; other row counts run as usual.

A leaf: this module knows `nn.Linear` only (no heads, trees or decoding loop).
"""

from __future__ import annotations

import types
import warnings

import torch
from torch import Tensor, nn

_WEIGHT_T = "_selfspec_weight_t"  # buffer: (out, in) view of the (in, out) row-major copy of the weight
_PACKED = "_selfspec_packed"  # attribute: (rows, MKL's packed form of the fp32 weight for that many rows)
_ONEDNN = "_selfspec_onednn"  # attribute: (weight it was taken from (detached), its version, reordered copy)


def _onednn_valid(layer: nn.Linear, record: tuple) -> bool:
    """The reordered copy still holds the layer's weight: same storage, no in-place change since. `record`
    keeps the source storage alive, so a different storage can never sit at its address."""
    weight, (source, version, _) = layer.weight, record
    return weight.data_ptr() == source.data_ptr() and weight._version == version and _packable(weight)


def _current_onednn(layer: nn.Linear) -> Tensor | None:
    """The layer's reordered weight while valid; a stale record is dropped (copy and old storage freed)."""
    record = layer.__dict__.get(_ONEDNN)
    if record is None:
        return None
    if _onednn_valid(layer, record):
        return record[2]
    del layer.__dict__[_ONEDNN]
    return None


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    onednn = _current_onednn(self)
    if (
        onednn is not None
        and rows
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and not (torch.is_grad_enabled() and _needs_grad(x, self))  # the kernel has no backward
    ):
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(rows, x.shape[-1]), onednn, self.bias, "none", [], ""
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
    packed = self.__dict__.get(_PACKED)
    if packed is not None and rows == packed[0]:
        if not _packable(self.weight):
            raise RuntimeError(
                f"Linear layer {self._selfspec_name!r} holds an MKL-packed weight for {rows}-row inputs, "
                f"valid on the CPU in float32 only, but it is now on {self.weight.device} / "
                f"{str(self.weight.dtype).removeprefix('torch.')}; after moving or casting a prepared model, "
                "call decode.prepare(model, heads, tree) again (or decode.layout.pack_linears(model, None))"
            )
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed[1], self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    transposed = self._buffers.get(_WEIGHT_T)
    weight = transposed if transposed is not None and rows >= self._selfspec_min_rows else self.weight
    return nn.functional.linear(x, weight, self.bias)


def _needs_grad(x: Tensor, layer: nn.Linear) -> bool:
    return (
        x.requires_grad or layer.weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad)
    )


def _packable(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32


def can_pack() -> bool:
    """True when this torch build has MKL's packed sgemm (x86 CPU wheels do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def can_onednn() -> bool:
    """True when this torch build multiplies fp32 Linear layers through oneDNN with reordered weights (the x86
    CPU wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_linears(module: nn.Module, *, rows_hint: int = 64, force: bool = False) -> int:
    """Give every fp32 CPU `nn.Linear` under `module` oneDNN's reordered copy of its weight, used for inputs
    of every row count (see the module docstring). Idempotent: a layer whose copy still matches its weight
    keeps it; one whose weight changed since gets a new copy. Other layers (other devices or dtypes, int8)
    are left alone. Inference only (no autograd through the copy).

    Args:
        module: a frozen target or a draft head.
        force: take every copy again, also those that look current (after writing weights through `.data`).
        rows_hint: the row count oneDNN picks its blocking for; any count runs. 64 measured best on the
            default target's lm_head from 1 to 17 rows (1 row 2.5 ms, 13 rows 3.0 ms, against 2.8 / 3.8 for
            a hint of 13 and 3.9 / 5.1 for a hint of 1).
    Returns:
        Bytes the copies hold (0 when nothing was patched or this build has no such kernels).
    """
    if not can_onednn():
        return 0
    held = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or not _packable(layer.weight):
            continue
        if force or _current_onednn(layer) is None:
            with torch.no_grad():
                weight = layer.weight.detach()
                copy = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
            layer.__dict__[_ONEDNN] = (weight, layer.weight._version, copy)
            layer._selfspec_name = name or type(module).__name__
            layer.forward = types.MethodType(_forward, layer)
        held += layer.weight.numel() * layer.weight.element_size()
    return held


def drop_onednn(module: nn.Module) -> int:
    """Remove the oneDNN copies `onednn_linears` gave the layers under `module` (they run `F.linear` again, or
    their MKL copies); returns how many layers had one."""
    dropped = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.__dict__.pop(_ONEDNN, None) is not None:
            dropped += 1
    return dropped


def is_onednn(module: nn.Module) -> bool:
    """True when some `nn.Linear` under `module` multiplies through a valid oneDNN reordered copy."""
    return any(onednn_weight(layer) is not None for layer in module.modules())


def onednn_weight(layer: nn.Module) -> Tensor | None:
    """The layer's oneDNN reordered weight while it still matches the weight, else None (a stale one is
    dropped)."""
    return _current_onednn(layer) if isinstance(layer, nn.Linear) else None


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
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or layer.weight.device.type != "cpu":
            continue
        layer._selfspec_min_rows = min_rows
        if _WEIGHT_T in layer._buffers:
            continue
        with torch.no_grad():
            # (out, in) view of an (in, out) row-major copy: F.linear then multiplies by the contiguous copy
            copy = layer.weight.detach().t().contiguous().t()
        layer.register_buffer(_WEIGHT_T, copy, persistent=False)
        layer._selfspec_name = name or type(module).__name__  # for error messages
        layer.forward = types.MethodType(_forward, layer)
        added += layer.weight.numel() * layer.weight.element_size()
    return added


def drop_pretranspose(module: nn.Module) -> int:
    """Remove the transposed copies `pretranspose_linears` gave the layers under `module`, and their packed
    weights; returns how many layers had a copy."""
    pack_linears(module, None)
    dropped = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer._buffers.pop(_WEIGHT_T, None) is not None:
            dropped += 1
    return dropped


def is_pretransposed(module: nn.Module) -> bool:
    """True when some `nn.Linear` under `module` carries the transposed copy."""
    return any(transposed_weight(layer) is not None for layer in module.modules())


def transposed_weight(layer: nn.Module) -> Tensor | None:
    """The layer's transposed copy ((out, in), stored (in, out) row-major), or None when it has none."""
    return layer._buffers.get(_WEIGHT_T) if isinstance(layer, nn.Linear) else None


def transpose_min_rows(module: nn.Module) -> int | None:
    """The smallest row count for which `module`'s (first) pretransposed layer uses its copy, or None."""
    return next(
        (layer._selfspec_min_rows for layer in module.modules() if transposed_weight(layer) is not None), None
    )


def pack_linears(module: nn.Module, rows: int | None) -> int:
    """Make every pretransposed fp32 CPU `nn.Linear` under `module` multiply inputs of exactly `rows` rows
    with an MKL-packed weight (see the module docstring); `rows=None` drops the packed weights, and so do
    layers no longer fp32 on the CPU. A new row count replaces the previous one (the buffers are
    large). A no-op where MKL packing is unavailable.

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
        if transposed_weight(layer) is None:
            continue
        current = layer.__dict__.get(_PACKED)
        if not packable or not _packable(layer.weight):
            if current is not None:
                del layer.__dict__[_PACKED]
            continue
        if current is None or current[0] != rows:
            with torch.no_grad():
                layer.__dict__[_PACKED] = (
                    rows,
                    torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows),
                )
        buffer = layer.__dict__[_PACKED][1]
        held += buffer.numel() * buffer.element_size()
    return held


def packed_weight(layer: nn.Module) -> Tensor | None:
    """The layer's MKL-packed weight (an opaque fp32 CPU tensor), or None when it has none."""
    packed = layer.__dict__.get(_PACKED)
    return None if packed is None else packed[1]


def packed_rows(module: nn.Module) -> int | None:
    """The row count `module`'s layers are packed for, or None."""
    return next((layer.__dict__[_PACKED][0] for layer in module.modules() if _PACKED in layer.__dict__), None)


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
