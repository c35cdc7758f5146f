"""A fused decode-time forward of an EAGLE head's draft layer.

`EagleHead.forward` runs transformers' Llama modules: three projections for q, k and v, two for the MLP's gate
and up, and a dozen small module calls around them. A draft level multiplies a handful of rows, so on a CPU
each call costs about as much as its weight traffic, and drafting a deep tree pays for every call at every
level. `FusedEagleStep` computes the same function with the q/k/v weights stacked into one matrix, gate/up
into another, and plain tensor ops for the norms, rope and attention (SDPA, grouped-query heads read without
copying them). It works on every form `decode/layout.py` leaves a layer in: fp32 (pretransposed, packed or
oneDNN copies included) and fbgemm's int8 (the stacked int8 weight keeps each row's scale, so it is the same
int8 matrix). Same inputs, same cache update, same output as the module path up to float rounding: it only
changes how the draft is computed, never what the target verifies, so decoding stays lossless either way.

Fewer, larger calls make each drafting step cheaper, for shallow and deep dynamic trees alike, with the same
trees, proposals and tau either way (measured: docs/cpu.md, The fused EAGLE draft step).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from decode.layout import (
    is_int8_linear,
    is_onednn,
    is_pretransposed,
    onednn_linears,
    pack_linears,
    packed_rows,
    pretranspose_linears,
    steps_over,
    transpose_min_rows,
    value_sample,
)
from heads.eagle import DraftCache, EagleHead, causal_mask

_CACHE = "_selfspec_fused_step"  # (fingerprint, FusedEagleStep) kept on the head, outside its state_dict


def _stack(layers: list[nn.Module]) -> nn.Module:
    """One layer computing the given layers' outputs side by side (same input): int8 or fp32 like them."""
    if all(is_int8_linear(layer) for layer in layers):
        weights = [layer.weight() for layer in layers]
        biases = [layer.bias() for layer in layers]
        if any(w.qscheme() not in (torch.per_channel_affine, torch.per_channel_symmetric) for w in weights):
            raise TypeError("stacking int8 layers needs per-channel weight scales")
        weight = torch._make_per_channel_quantized_tensor(
            torch.cat([w.int_repr() for w in weights]),
            torch.cat([w.q_per_channel_scales() for w in weights]),
            torch.cat([w.q_per_channel_zero_points() for w in weights]),
            0,
        )
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat([b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)])
        )
        stacked = torch.ao.nn.quantized.dynamic.Linear(weight.shape[1], weight.shape[0], dtype=torch.qint8)
        stacked.set_weight_bias(weight, bias)
        return stacked
    if any(is_int8_linear(layer) or not isinstance(layer, nn.Linear) for layer in layers):
        raise TypeError(f"cannot stack {[type(layer).__name__ for layer in layers]}")
    weight = torch.cat([layer.weight.detach() for layer in layers])
    has_bias = any(layer.bias is not None for layer in layers)
    stacked = nn.Linear(
        weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype
    )
    stacked.requires_grad_(False)
    stacked.weight.copy_(weight)
    if has_bias:
        stacked.bias.copy_(
            torch.cat(
                [
                    layer.bias.detach()
                    if layer.bias is not None
                    else torch.zeros(layer.out_features, dtype=weight.dtype)
                    for layer in layers
                ]
            )
        )
    return stacked


class FusedEagleStep:
    """`EagleHead.forward` for decoding (no autograd), computed with stacked projections; see the module
    docstring.

    Use `fused_step(head)`: it builds one per head and rebuilds it when the head's weights or layout change.
    """

    def __init__(self, head: EagleHead) -> None:
        layer, cfg = head.midlayer, head.config
        attn, mlp = layer.self_attn, layer.mlp
        self.head, self.eagle3 = head, head.head_type != "eagle1"
        self.num_heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not split into {self.kv_heads} kv groups")
        self.scale = attn.scaling
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        self.layers = nn.ModuleDict(
            {
                "qkv": _stack([attn.q_proj, attn.k_proj, attn.v_proj]),
                "gate_up": _stack([mlp.gate_proj, mlp.up_proj]),
            }
        )
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.norms = {"post": layer.post_attention_layernorm}
        if self.eagle3:
            self.norms.update(embeds=layer.input_layernorm, hidden=layer.hidden_norm)
        fp32 = [m for m in self.layers.values() if isinstance(m, nn.Linear)]
        if fp32 and is_pretransposed(head):  # the same fp32 layout as the head's own layers
            pretranspose_linears(self.layers, min_rows=transpose_min_rows(head))
            pack_linears(self.layers, packed_rows(head))
        if fp32 and is_onednn(head):
            onednn_linears(self.layers)

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor) -> Tensor:
        return nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    @torch.no_grad()
    def __call__(
        self,
        features: Tensor,
        input_embeds: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Same arguments and result as `EagleHead.forward` (batch 1), cache extended in place."""
        batch, rows = features.shape[:2]
        if attention_mask is None:
            attention_mask = causal_mask(rows, len(cache), features.dtype, features.device)
        if self.eagle3:
            residual = features
            attn_in = torch.cat(
                [self._norm(self.norms["embeds"], input_embeds), self._norm(self.norms["hidden"], features)],
                dim=-1,
            )
        else:
            residual = attn_in = self.head.fc(torch.cat([input_embeds, features], dim=-1))
        cos, sin = self.head.rotary_emb(residual, position_ids)
        qkv = self.layers["qkv"](attn_in)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(batch, rows, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = cache.update(k, v)
        out = nn.functional.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=attention_mask,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.num_heads,
        )
        hidden = residual + self.o_proj(out.transpose(1, 2).reshape(batch, rows, self.q_size))
        gate, up = self.layers["gate_up"](self._norm(self.norms["post"], hidden)).split(
            self.head.config.intermediate_size, dim=-1
        )
        out = hidden + self.down_proj(self.act(gate) * up)
        return self._norm(self.head.norm, out) if self.eagle3 and self.head.config.norm_output else out


def _fingerprint(head: EagleHead) -> tuple:
    """Changes when the head's weights are replaced or updated in place (optimizer steps included: fused ones
    bump no version counter) or its layers are swapped, pretransposed or packed."""
    return (
        tuple((id(p), p.data_ptr(), p._version, steps_over(p), p.device, p.dtype) for p in head.parameters()),
        tuple(id(m) for m in head.modules()),
        is_pretransposed(head),
        packed_rows(head),
        is_onednn(head),
    )


def forget_changed_fused_step(head: nn.Module) -> bool:
    """Drop the head's `FusedEagleStep` when a parameter's values changed without a version bump since it was
    built (`decode.layout.drop_changed` for the layers' copies); True when it was dropped."""
    cached = head.__dict__.get(_CACHE)
    if cached is None or all(
        torch.equal(value_sample(p, clone=False), s) for p, s in zip(head.parameters(), cached[2])
    ):
        return False
    head.__dict__.pop(_CACHE)
    return True


def forget_fused_step(head: nn.Module) -> None:
    """Drop the head's `FusedEagleStep` (built again at its next use): after writes through `weight.data`,
    which no fingerprint sees."""
    head.__dict__.pop(_CACHE, None)


def fused_step(head: EagleHead) -> FusedEagleStep:
    """The head's `FusedEagleStep`, built on first use and rebuilt after its weights or layout changed."""
    key = _fingerprint(head)
    cached = head.__dict__.get(_CACHE)
    if cached is None or cached[0] != key:
        cached = (key, FusedEagleStep(head), [value_sample(p) for p in head.parameters()])
        object.__setattr__(head, _CACHE, cached)  # not a submodule: stays out of state_dict() and .to()
    return cached[1]
