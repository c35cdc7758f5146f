"""`prepare`: the one call that readies a target and its draft heads for fast decoding on their device, and
the head-aware steps it takes (int8 drafts, packing for a tree's row counts) over `decode/layout.py`'s layers.
"""

from __future__ import annotations

import torch
from torch import nn

from decode.drafter import Drafter, DraftLimits
from decode.drafters import make_drafter
from decode.drafters.lm_head import DRAFT_LM_HEAD
from decode.fused import forget_changed_fused_step, forget_fused_step
from decode.inputs import attention_windows
from decode.layout import (
    can_int8,
    can_onednn,
    can_pack,
    drop_changed,
    drop_onednn,
    drop_pretranspose,
    int8_linears,
    onednn_linears,
    pack_linears,
    pretranspose_linears,
)
from decode.tree import DynamicTree, resolve_tree, verify_rows
from heads.io import quantized_layers
from heads.registry import find_kind, kind_of


def prepare(
    model: nn.Module,
    heads: nn.Module | None = None,
    tree=None,
    *,
    pretranspose: bool | None = None,
    int8_draft: bool | None = None,
    onednn: bool | None = None,
    refresh: bool = True,
    temperature: float = 0.0,
) -> nn.Module | None:
    """Apply what the measurements in docs/cpu.md support for decoding `model` with `heads` and `tree`;
    returns the heads to pass to `generate` (the same object, changed in place).

    On a CPU with an fp32 target: oneDNN's reordered fp32 weights for every pass of the target, plain
    decoding's included (`decode.layout.onednn_linears`; where oneDNN is missing, pretransposed weight copies
    for multi-token passes and MKL-packed weights for the tree's verify row count instead), and int8 draft
    weights where fbgemm is present (the draft's layers left in fp32 get the oneDNN copies too). Elsewhere
    (CUDA, half precision) nothing is changed (copies an earlier call took on the CPU in fp32 are stale
    there: never read, freed at the layers' next call). Greedy output stays token for token that of plain
    decoding; int8 drafts can only move acceptance.

    Every call takes the weight copies again from the current weights, also those that look current (and the
    EAGLE head's fused draft step is built again): call it again with another tree before decoding with that
    tree, after moving or casting the model, and after writing weights through `weight.data` (which the
    layers cannot see). Other weight changes (an optimizer step, fused ones included, `load_state_dict`,
    in-place edits) are seen by the layers themselves, which run plain `F.linear` until the next call
    (docs/cpu.md, "When a weight copy is read"); `refresh=False` keeps the copies that still hold their
    weights. The draft is quantized once. Training a prepared model is safe: passes that autograd records
    never read the copies.

    Args:
        model: the target, in inference use.
        heads: the draft heads, a `Composite` (its head parts readied as heads), or a custom `Drafter` (which
            only sizes the tree), or a list of those, one per row, as `generate` takes it; None for plain
            decoding (which gets the oneDNN weights too, so that both are
            measured on the same kernels).
        tree: the tree `generate` will get (None: the heads' default tree).
        pretranspose: force the MKL weight copies and packing on (True) or off (False); None: where they
            help and oneDNN is not used (with oneDNN on, copies an earlier call made are removed unless True).
        int8_draft: force int8 draft weights on or off; None: on where fbgemm's x86 kernels exist.
        onednn: force oneDNN's reordered weights on or off; None: on for fp32 CPU targets where this torch
            build has them; False removes copies an earlier call gave.
        refresh: take every copy again (the default); False keeps the copies that still hold their weights,
            for loops that prepare before each call and write no weights (`benchmarks.benchmark`).
        temperature: the temperature `generate` will get, which picks the default tree when `tree` is None
            (`decode.tree.default_tree`).
    Raises:
        ValueError: a target `generate` cannot decode (`decode.inputs.attention_windows`), before any work.
    """
    attention_windows(model)
    inference = [name for name, p in model.named_parameters() if p.is_inference()][:3]
    if inference:  # `_take` would fail on their version counter with a RuntimeError that names nothing
        raise ValueError(
            f"the target's weights ({', '.join(inference)}, ...) are inference tensors, made under "
            "torch.inference_mode: they keep no version counter, so a weight copy could not tell when they "
            "change; load the model outside inference_mode (torch.no_grad is fine) or clone its parameters"
        )
    fast_cpu = model.device.type == "cpu" and getattr(model, "dtype", None) == torch.float32
    if int8_draft is None:
        int8_draft = fast_cpu and can_int8()
    if onednn is None:
        onednn = fast_cpu and can_onednn()
    if pretranspose is None:
        pretranspose = fast_cpu and can_pack() and not onednn
    # the heads (`heads`, or a composite's head parts) and the models the target and a draft source draft with
    # (a separate draft model); other sources (a custom `Drafter`, n-gram ...) are left as they are
    parts, drafted = _sources_parts(heads)
    models = [model, *drafted]
    for head in parts:
        if int8_draft and not is_int8_draft(head):
            quantize_draft(head, model)
        elif int8_draft and refresh and head.shares_target_lm_head:
            _int8_shared_lm_head(head, model)  # its int8 copy of the target's lm_head, taken again
    for module in [*models, *parts]:
        if onednn:
            # a head: the layers int8 left in fp32 (EAGLE's fc), or all of an fp32 one
            onednn_linears(module, force=refresh)
            if not pretranspose:
                drop_pretranspose(module)  # an earlier call's MKL copies, which fp32 inputs no longer read
        elif onednn is False:
            drop_onednn(module)
    if pretranspose:
        for module in [*models, *parts]:
            pretranspose_linears(module, force=refresh)
    pack_for_tree(model, heads, tree, force=refresh, temperature=temperature)
    for head in parts if refresh else ():
        forget_fused_step(head)  # its stacked draft weights are taken again at the next draft
    return heads


def drop_changed_copies(model: nn.Module, heads=None) -> int:
    """Before a decode: drop the weight copies (and EAGLE's fused draft step) of the target, the heads and a
    draft model whose weights changed without a version bump since `prepare` (`decode.layout.drop_changed`),
    so they run on their current weights; returns how many were dropped."""
    parts, models = _sources_parts(heads)
    dropped = sum(drop_changed(m) for m in [model, *models, *parts])
    return dropped + sum(forget_changed_fused_step(head) for head in parts)


def quantize_draft(heads: nn.Module, target: nn.Module | None = None) -> nn.Module:
    """Give the draft int8 weights for decoding (`decode.layout.int8_linears`), in place; returns `heads`.

    Every `nn.Linear` of the heads becomes a dynamic int8 Linear (pretransposed or packed copies are dropped
    with the old layers), except an EAGLE head's `fc`: it reads the target's raw hidden states, whose outlier
    channels one int8 activation scale per tensor cannot hold (with `fc` in int8, the default target's EAGLE-3
    head lost much of its tau; measured: docs/cpu.md, int8 drafts). `fc` runs once per step, on the accepted
    tokens only. Heads that project with the target's lm_head (Medusa `share_lm_head`, EAGLE-1) get an int8
    copy of it that only their drafts use (`decode.drafters.lm_head.draft_lm_head`); the target itself is not
    touched.
    Inference only: do not train or save quantized heads (their Linear weights are no longer parameters).

    Args:
        heads: MedusaHeads or an EagleHead, fp32, on the CPU.
        target: the target whose lm_head the heads share; required for such heads.
    Raises:
        RuntimeError: this torch build has no x86 quantized engine.
        ValueError: heads off the CPU or not fp32, or a shared lm_head without `target`.
    """
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
    if heads.shares_target_lm_head:
        if target is None:
            raise ValueError(f"these {type(heads).__name__} project with the target's lm_head: pass target=")
        _int8_shared_lm_head(heads, target)
    int8_linears(heads, skip=heads.int8_skip)
    return heads


def _int8_shared_lm_head(heads: nn.Module, target: nn.Module) -> None:
    """Give heads that project with the target's lm_head an int8 copy of it, for their drafts only."""
    shared = target.get_output_embeddings()
    plain = nn.Linear(shared.in_features, shared.out_features, bias=shared.bias is not None)
    plain.weight, plain.bias = shared.weight, shared.bias  # the target's tensors, read once by the quantizer
    holder = nn.Sequential(plain)
    int8_linears(holder)
    object.__setattr__(heads, DRAFT_LM_HEAD, holder[0])  # not a submodule: stays out of state_dict()


def is_int8_draft(heads: nn.Module) -> bool:
    """True when `quantize_draft` has been applied to `heads`."""
    return bool(quantized_layers(heads))


def pack_for_tree(
    target: nn.Module, heads: nn.Module | None, tree, *, force: bool = False, temperature: float = 0.0
) -> None:
    """Pack the pretransposed target for the tree's verify row count and, for a dynamic tree, an EAGLE head
    for its `top_k` rows per level (each level of a dynamic tree expands exactly top_k nodes). Modules that
    were not pretransposed are left alone; other trees and heads drop their packed weights, and so do layers
    no longer fp32 on the CPU.

    Args:
        target: the target model.
        heads: the draft heads passed to `generate` (or None for plain decoding).
        tree: the tree passed to `generate` (a `DynamicTree`, rank paths, a tree name, `TreeBuffers`
            or None for the heads' default tree).
        force: pack again also the layers whose packed weight looks current.
        temperature: the temperature `generate` will get (picks the default tree when `tree` is None).
    """
    if heads is None:
        pack_linears(target, None)
        return
    sources = list({id(s): s for s in heads}.values()) if isinstance(heads, (list, tuple)) else [heads]
    rows = set()
    for source in sources:
        limits = make_drafter(source, target, 1).limits()
        resolved = resolve_tree(
            tree,
            max_depth=limits.max_depth,
            dynamic=limits.dynamic,
            device=target.device,
            temperature=temperature,
        )
        rows.add(verify_rows(resolved, limits.max_depth))
        for head in _head_parts(source):  # a composite's head part is packed for the rows it drafts itself
            own = limits if head is source else make_drafter(head, target, 1).limits()
            pack_linears(head, head_rows(own, resolved), force=force)
    # row drafters whose trees verify different row counts: the target's passes have no one count to pack for
    pack_linears(target, rows.pop() if len(rows) == 1 else None, force=force)


def _draft_models(source) -> list[nn.Module]:
    """The models a draft source drafts with, from its kind's `models` part (none for heads and drafters)."""
    if source is None or isinstance(source, Drafter):
        return []
    kind = kind_of(source)
    return kind.part("models")(source) if kind.models else []


def _sources_parts(heads) -> tuple[list[nn.Module], list[nn.Module]]:
    """The distinct heads and separate draft models of `heads`: one draft source, or a list of them (one per
    row, as `generate` takes them)."""
    sources = heads if isinstance(heads, (list, tuple)) else [heads]
    parts = {id(h): h for source in sources for h in _head_parts(source)}
    models = {id(m): m for source in sources for m in _draft_models(source) if not _is_head(m)}
    return list(parts.values()), list(models.values())


def _head_parts(source) -> list[nn.Module]:
    """The heads `prepare` readies for a draft source: itself, or a composite's head parts."""
    return [source] if _is_head(source) else [m for m in _draft_models(source) if _is_head(m)]


def _is_head(source) -> bool:
    """A head module of a registered checkpoint kind (what `prepare` lays out and quantizes); a separate draft
    model's network is not one, nor registered at all."""
    kind = find_kind(source) if isinstance(source, nn.Module) else None
    return kind is not None and bool(kind.head_types)


def head_rows(limits: DraftLimits, tree) -> int | None:
    """The row count a draft head is packed for with this (resolved) tree: on a dynamic tree a drafter that
    drafts level by level expands exactly `top_k` nodes per level, else None (row counts vary or are 1)."""
    dynamic = not limits.block and isinstance(tree, DynamicTree) and tree.top_k >= 2
    return tree.top_k if dynamic else None
