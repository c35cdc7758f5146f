"""DFlash block drafter (Chen et al., arXiv 2602.06036): a few decoder layers at the target's width that
draft a whole block in one forward.

The target's states tapped at `aux_layer_ids` (output-of-layer convention, heads/features.py) are fused by
`fc` and `hidden_norm` into one context vector per committed position. Every draft layer projects that
vector with its own k_proj / v_proj (and k_norm, RoPE at the position) into extra keys and values: the
context never changes once committed, so its K/V per layer are computed once and cached. The queries come
only from the block: the embeddings of [root, MASK, ..., MASK] at positions p .. p + B - 1 (the root is the
token whose children are drafted, MASK is `mask_token_id`), attending to the whole block (bidirectional)
and to the context before p. The output at block slot k (1 .. B - 1) scores the token at position p + k,
so one forward drafts depths 1 .. B - 1. Qwen3-style layers (RMSNorm on each head's queries and keys);
weight names are those vLLM's `qwen3_dflash` reads. The target's embedding is shared; the lm_head is the
target's, or the head's own over a reduced draft vocabulary mapped by `d2t` as EAGLE-3's is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from heads.eagle import (
    check_draft_vocab,
    check_rope_parameters,
    draft_vocab_buffers,
    target_layer_sizes,
    write_draft_vocab,
)
from heads.features import find_decoder_layers
from heads.typed import check_int_ids, check_tap_order

HEAD_TYPE = "dflash"


def dflash_layers(num_target_layers: int, taps: int) -> tuple[int, ...]:
    """DFlash's default taps: `taps` layers spread evenly from layer 1 to layer N - 3 (output-of-layer ids);
    one tap is the middle layer."""
    if taps == 1:
        return (num_target_layers // 2,)
    start, end = (1, num_target_layers - 3) if num_target_layers - 3 > taps else (0, num_target_layers - 1)
    return tuple(round(start + i * (end - start) / (taps - 1)) for i in range(taps))


@dataclass
class DFlashConfig:
    hidden_size: int  # draft width H, the target's (the target's embedding feeds the block)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary V
    aux_layer_ids: tuple[int, ...]  # target taps, output-of-layer convention (vLLM: target_layer_ids)
    mask_token_id: int  # the target token whose embedding fills the block's slots after the root
    num_hidden_layers: int = 3  # draft layers (the paper: 5)
    block_size: int = 8  # B: root + B - 1 drafted tokens per forward
    target_hidden_size: int | None = None  # width of one tapped state; None = hidden_size
    draft_vocab_size: int | None = None  # own lm_head over Vd tokens; None = the target's lm_head (Vd = V)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False

    def __post_init__(self) -> None:
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.aux_layer_ids = check_int_ids(self.aux_layer_ids, "aux_layer_ids")
        check_tap_order(self.aux_layer_ids, "aux_layer_ids")
        check_rope_parameters(self.rope_parameters)
        if not self.aux_layer_ids:
            raise ValueError("a dflash head needs aux_layer_ids (the tapped target layers)")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (the root and one draft), got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1, got {self.num_hidden_layers}")
        whole = isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool)
        if not whole or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")

    @classmethod
    def from_target(cls, target_config, mask_token_id: int, **overrides) -> DFlashConfig:
        """A config sized from a target's HF config; taps default to DFlash's spread, one per draft layer."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        layers = overrides.pop("num_hidden_layers", 3)
        fields = {
            **target_layer_sizes(text),
            "aux_layer_ids": dflash_layers(text.num_hidden_layers, layers),
            "mask_token_id": mask_token_id,
            "num_hidden_layers": layers,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    def llama_config(self) -> LlamaConfig:
        """The Llama config the draft's MLPs and rotary embedding are built from."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            mlp_bias=False,
        )


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half layout, as HF Llama/Qwen3 and vLLM's neox style) on (B, heads, T, D) with (B, T, D)
    cos / sin."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Attention of block queries over [context keys, block keys]; RMSNorm on each head's q and k."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        return x.view(*x.shape[:-1], heads, self.head_dim).transpose(1, 2)  # (B, heads, T, D)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """(B, kv_heads, T, D) keys (normed, rotated) and values of inputs x (B, T, H)."""
        keys = rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return keys, self._split(self.v_proj(x), self.kv_heads)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor
    ) -> Tensor:
        """x (B, Q, H) block inputs; context (keys, values) (B, kv_heads, S, D); mask (B | 1, 1, Q, S + Q)
        additive."""
        queries = rope(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)
        keys, values = self.keys_values(x, cos, sin)
        keys, values = torch.cat([context[0], keys], 2), torch.cat([context[1], values], 2)
        out = nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask.to(queries.dtype), enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    """The DFlash drafter's weights and its two passes: `context` (target taps -> per-layer K/V, once per
    committed position) and `forward` (a block's queries over context and block)."""

    head_type = HEAD_TYPE
    int8_skip = ("fc",)  # fc reads the target's raw states (outlier channels), as EAGLE-3's does

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        if config.draft_vocab_size < config.vocab_size:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            draft_vocab_buffers(self, config.draft_vocab_size, config.vocab_size)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)

    @property
    def shares_target_lm_head(self) -> bool:
        return self.config.draft_vocab_size == self.config.vocab_size

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_depths(self) -> int:
        """Tree depths one forward drafts: the block less its root."""
        return self.config.block_size - 1

    def checkpoint_notes(self) -> dict:
        return {"aux_layer_ids_convention": "output of decoder layer i (0-based) = hidden_states[i + 1]"}

    def check_checkpoint(self, state: dict[str, Tensor], source: str) -> None:
        if not self.shares_target_lm_head:
            c = self.config
            check_draft_vocab(state["d2t"], c.vocab_size, c.draft_vocab_size, source, t2d=state["t2d"])

    def context(self, target_features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per draft layer, the (keys, values) (B, kv_heads, T, D) of committed positions from the target's
        concatenated taps (B, T, taps * Ht) at `positions` (B, T)."""
        fused = self.hidden_norm(self.fc(target_features))
        cos, sin = self.rotary_emb(fused, positions)
        return [layer.self_attn.keys_values(fused, cos, sin) for layer in self.layers]

    def forward(
        self, embeds: Tensor, positions: Tensor, context: list[tuple[Tensor, Tensor]], attention_mask: Tensor
    ) -> Tensor:
        """Normed outputs (B, Q, H) of block inputs `embeds` (B, Q, H) at `positions` (B, Q), over `context`
        (from `context`, S positions) under `attention_mask` (B | 1, 1, Q, S + Q) additive."""
        cos, sin = self.rotary_emb(embeds, positions)
        x = embeds
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, kv, attention_mask)
        return self.norm(x)

    def logits(self, hidden: Tensor, target_lm_head: nn.Module | None) -> Tensor:
        """(..., Vd) draft logits of `forward`'s outputs: the own lm_head, or the target's."""
        return target_lm_head(hidden) if self.shares_target_lm_head else self.lm_head(hidden)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.shares_target_lm_head else draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` (Vd distinct target ids) as the draft vocabulary (own lm_head only)."""
        if self.shares_target_lm_head:
            raise ValueError(
                "this dflash head drafts over the target's vocabulary: it has no draft vocabulary"
            )
        write_draft_vocab(self, target_ids)

    @torch.no_grad()
    def init_lm_head_from_target(self, target_lm_weight: Tensor) -> None:
        """Start the own lm_head from the target's rows of the draft vocabulary."""
        if not self.shares_target_lm_head:
            self.lm_head.weight.copy_(
                target_lm_weight[self.to_target_ids(torch.arange(self.config.draft_vocab_size))]
            )

    @torch.no_grad()
    def init_from_target(self, target: nn.Module, layers: bool = False) -> None:
        """Start the final norm as the target's (the lm_head rows it feeds were trained behind it) and, with
        `layers`, the draft layers as copies of the target's last ones (their attention and MLP weights and
        norms; q_norm and k_norm stay ones). Weights the shapes do not match are left as they are."""
        text_norm = getattr(target.get_decoder(), "norm", None)
        if text_norm is not None and text_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(text_norm.weight)
        if not layers:
            return
        source = find_decoder_layers(target)[-len(self.layers) :]
        for ours, theirs in zip(self.layers, source, strict=True):
            mine, other = ours.state_dict(), theirs.state_dict()
            ours.load_state_dict(
                {k: other[k] if k in other and other[k].shape == v.shape else v for k, v in mine.items()}
            )
