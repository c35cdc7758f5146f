"""EAGLE draft heads: EAGLE-1 (Li et al. 2401.15077, section 4) and EAGLE-3 (2503.01840, section 3).

Both are one Llama-style decoder layer that autoregresses on features. EAGLE-1 reads the target's final
hidden state and reuses its frozen embedding and lm_head; EAGLE-3 fuses three tapped target layers with `fc`
and owns a norm and an lm_head over a reduced draft vocabulary mapped to target ids by `d2t`.
The layer's submodules are transformers' public Llama modules; only the wiring lives here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from heads.features import LAST, default_eagle3_layers
from heads.typed import check_int_ids, check_tap_order, misspelt

HEAD_TYPES = ("eagle1", "eagle3")


@dataclass
class EagleConfig:
    HEAD_TYPES: ClassVar[tuple[str, ...]] = HEAD_TYPES  # the head types this config describes
    head_type: str  # "eagle1" or "eagle3" (subclasses: their own, built as eagle3's layer)
    hidden_size: int  # draft width H; equals the target's (EAGLE reuses its embedding)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary V
    target_hidden_size: int | None = None  # width of one tapped target state; None = hidden_size
    aux_layer_ids: tuple[int, ...] | None = (
        None  # eagle3 taps, output-of-layer convention (heads/features.py)
    )
    draft_vocab_size: int | None = None  # eagle3 reduced vocabulary Vd; None = V
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    fc_bias: bool = False  # EAGLE-1's original fc had a bias; vLLM builds it without one
    attention_bias: bool = False
    # EAGLE-3.1 (vLLM's `norm_before_fc` / `norm_output`): an RMSNorm over the concatenated taps before fc,
    # and the draft's normed output (not its pre-norm state) as the next step's feature
    norm_before_fc: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.head_type not in self.HEAD_TYPES:
            raise ValueError(f"head_type must be one of {self.HEAD_TYPES}, got {self.head_type!r}")
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = check_int_ids(self.aux_layer_ids, "aux_layer_ids")
            check_tap_order(self.aux_layer_ids, "aux_layer_ids")
        check_rope_parameters(self.rope_parameters)
        if self.head_type != "eagle1" and (self.aux_layer_ids is None or len(self.aux_layer_ids) == 0):
            raise ValueError(f"an {self.head_type} head needs aux_layer_ids (the tapped target layers)")
        if self.head_type == "eagle1" and self.target_hidden_size != self.hidden_size:
            raise ValueError("eagle1 feeds its output to the target's lm_head: hidden sizes must match")
        if self.head_type == "eagle1" and (self.norm_before_fc or self.norm_output):
            raise ValueError("norm_before_fc and norm_output are EAGLE-3.1 options: eagle3 heads only")

    @classmethod
    def from_target(cls, target_config, head_type: str, **overrides) -> EagleConfig:
        """A head config sized from a target's HF config (any Llama-like decoder)."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        fields = {"head_type": head_type, **target_layer_sizes(text)}
        if head_type != "eagle1":
            fields["aux_layer_ids"] = default_eagle3_layers(text.num_hidden_layers)
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids) if self.aux_layer_ids is not None else None
        return out

    def llama_config(self) -> LlamaConfig:
        """The 1-layer Llama config of the draft layer (also what exports write)."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=self.attention_bias,
            mlp_bias=False,
        )
        config._attn_implementation = "sdpa"  # the mask is always explicit (heads build it), so sdpa is exact
        return config


# the keys transformers' rope types read (transformers.modeling_rope_utils), for spotting a slip in one
ROPE_KEYS = frozenset({
    "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor", "low_freq_factor",
    "high_freq_factor", "partial_rotary_factor",
})  # fmt: skip


def check_rope_parameters(rope) -> None:
    """A head's rope parameters must name their type and theta: transformers fills a missing rope_theta with
    10000 and only logs a slip such as `rope_thetaa`, so a head for a target with another theta would
    draft with the wrong positions and no error."""
    keys = list(rope) if isinstance(rope, dict) else None
    for key in keys or ():
        slip = misspelt(key, ROPE_KEYS)
        if slip is not None:
            raise ValueError(f"rope_parameters has {key!r}: a slip of {slip!r}? ({rope!r})")
    theta = rope.get("rope_theta") if keys is not None else None
    if keys is None or not isinstance(rope.get("rope_type"), str) or theta is None:
        raise ValueError(f"rope_parameters needs a rope_type (a string) and a rope_theta, got {rope!r}")
    if isinstance(theta, bool) or not (isinstance(theta, (int, float)) and theta > 0):
        raise ValueError(f"rope_parameters needs a positive rope_theta, got {rope!r}")


def target_layer_sizes(text) -> dict:
    """The sizes a draft layer at the target's width takes from the target's text config: widths, heads,
    vocabulary, norm epsilon, positions and its full-attention rope parameters."""
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate_size": text.intermediate_size,
        "vocab_size": text.vocab_size,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
        "rope_parameters": _full_attention_rope(text),
    }


def _full_attention_rope(text_config) -> dict:
    """The target's rope parameters; per-layer-type dicts (Gemma 3) give their full-attention entry."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    return rope


class DraftCache:
    """KV cache of the single draft layer: plain tensors, cropped and re-indexed by the decoder."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (B, kv_heads, S, head_dim)
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, keys: Tensor, values: Tensor, layer_idx: int = 0, **_kwargs) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer whose attention reads `attn_input_size` features (H for EAGLE-1, 2H for
    EAGLE-3)."""

    def __init__(self, config: LlamaConfig, attn_input_size: int, eagle3: bool) -> None:
        super().__init__()
        self.eagle3 = eagle3
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if attn_input_size != config.hidden_size:
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.self_attn, name)
                setattr(
                    self.self_attn,
                    name,
                    nn.Linear(attn_input_size, old.out_features, bias=old.bias is not None),
                )
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if eagle3:  # EAGLE-1 has no input_layernorm: its fc output goes straight into attention
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        embeds: Tensor | None,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor,
        cache: DraftCache | None,
    ) -> Tensor:
        residual = hidden
        if self.eagle3:
            hidden = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        hidden, _ = self.self_attn(
            hidden, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache
        )
        hidden = residual + hidden
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def causal_mask(query_length: int, past_length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(1, 1, T, past + T) additive mask: each query sees the past and itself and earlier queries."""
    allowed = torch.ones(query_length, past_length + query_length, dtype=torch.bool, device=device)
    allowed[:, past_length:] = torch.tril(allowed[:, past_length:])
    return additive_mask(allowed, dtype)[None, None]


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean "may attend" -> float mask (0 allowed, dtype-min blocked); boolean masks are wrong under
    eager."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def check_draft_vocab(
    d2t: Tensor, vocab_size: int, draft_vocab_size: int, source: str, t2d: Tensor | None = None
) -> None:
    """Raise ValueError naming `source` unless d2t maps the Vd draft ids one-to-one into the target vocab."""

    def fail(problem: str):
        raise ValueError(f"{source}: {problem}")

    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        fail(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} of shape {tuple(d2t.shape)}")
    if d2t.numel() != draft_vocab_size:
        fail(f"d2t has {d2t.numel()} entries, but the config says draft_vocab_size={draft_vocab_size}")
    target = d2t.cpu() + torch.arange(d2t.numel())
    outside = ((target < 0) | (target >= vocab_size)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        fail(
            f"d2t maps draft id {i} to target id {int(target[i])}, outside the target vocab [0, {vocab_size})"
        )
    values, order = target.sort(stable=True)
    later = order[1:][values[1:] == values[:-1]]
    if later.numel():
        j = int(later.min())
        i = int((target == target[j]).nonzero()[0])
        fail(
            f"d2t maps draft ids {i} and {j} to target id {int(target[j])} "
            "(the draft vocabulary must map to distinct target tokens)"
        )
    if t2d is None:
        return
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        fail(f"t2d must be bool of shape ({vocab_size},), got {t2d.dtype} of shape {tuple(t2d.shape)}")
    if not torch.equal(t2d.cpu().nonzero().flatten(), target):
        fail("d2t and t2d disagree: nonzero(t2d) != d2t + arange(Vd)")


def draft_vocab_buffers(head: nn.Module, draft_vocab_size: int, vocab_size: int) -> None:
    """Register a reduced draft vocabulary's maps on `head`: `d2t` (target_id = draft_id + d2t[draft_id]) and
    `t2d` (which target ids are in it); the first Vd ids until `write_draft_vocab` sets them."""
    head.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    head.register_buffer("t2d", t2d)


@torch.no_grad()
def _token_ids(ids) -> Tensor:
    """Token ids as int64; floating ids (2.7) are refused, not cut to 2."""
    tensor = torch.as_tensor(ids)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"draft vocabulary ids must be integers, got a {tensor.dtype} tensor")
    return tensor.long()


def write_draft_vocab(head: nn.Module, target_ids: Tensor) -> None:
    """Set `head`'s d2t / t2d to the Vd distinct target ids `target_ids` (validated in the order given, so an
    error names positions in it)."""
    target_ids = _token_ids(target_ids).flatten()
    vd = head.config.draft_vocab_size
    given = target_ids - torch.arange(target_ids.numel(), device=target_ids.device)
    check_draft_vocab(given, head.config.vocab_size, vd, "set_draft_vocab(target_ids)")
    target_ids = target_ids.sort().values
    head.d2t.copy_(target_ids - torch.arange(vd, device=target_ids.device))
    head.t2d.zero_()
    head.t2d[target_ids] = True


class EagleHead(nn.Module):
    """EAGLE-1 or EAGLE-3 draft head; sees only tensors (features, embeddings, the target's lm_head)."""

    # layers an int8 draft keeps in fp32: `fc` reads the target's raw hidden states, whose outlier channels
    # one int8 activation scale per tensor cannot hold (`decode.prepare.quantize_draft`)
    int8_skip = ("fc",)

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.head_type = config.head_type
        llama = config.llama_config()
        h = config.hidden_size
        if config.head_type == "eagle1":
            self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)  # concat(embedding, feature) -> H
            self.midlayer = DraftDecoderLayer(llama, h, eagle3=False)
        else:
            taps = len(config.aux_layer_ids)
            if config.norm_before_fc:
                self.input_norm = LlamaRMSNorm(taps * config.target_hidden_size, eps=config.rms_norm_eps)
            self.fc = nn.Linear(taps * config.target_hidden_size, h, bias=config.fc_bias)
            self.midlayer = DraftDecoderLayer(llama, 2 * h, eagle3=True)
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            draft_vocab_buffers(self, config.draft_vocab_size, config.vocab_size)
        self.rotary_emb = LlamaRotaryEmbedding(llama)

    def checkpoint_notes(self) -> dict:
        """What `heads.io.save_heads` records in config.json beside the head's config."""
        if self.head_type == "eagle1":
            return {}
        return {"aux_layer_ids_convention": "output of decoder layer i (0-based) = hidden_states[i + 1]"}

    def check_checkpoint(self, state: dict[str, Tensor], source: str) -> None:
        """Refuse a checkpoint's tensors that load without error but decode wrongly (a bad draft vocabulary
        map); `heads.io.load_heads` calls it on the raw tensors, before `load_state_dict` casts them."""
        if self.head_type != "eagle1":
            c = self.config
            check_draft_vocab(state["d2t"], c.vocab_size, c.draft_vocab_size, source, t2d=state["t2d"])

    @property
    def shares_target_lm_head(self) -> bool:
        """EAGLE-1 projects with the target's lm_head; EAGLE-3 has its own (over its draft vocabulary)."""
        return self.head_type == "eagle1"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target taps this head reads (see heads/features.py)."""
        return (LAST,) if self.head_type == "eagle1" else tuple(self.config.aux_layer_ids)

    def project_features(self, target_features: Tensor) -> Tensor:
        """Target states (B, T, taps*Ht) -> the head's input feature (B, T, H)."""
        if self.head_type == "eagle1":
            return target_features
        if self.config.norm_before_fc:
            target_features = self.input_norm(target_features)
        return self.fc(target_features)

    def forward(
        self,
        features: Tensor,
        input_embeds: Tensor,
        position_ids: Tensor,
        cache: DraftCache | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """One draft step over T positions.

        Args:
            features: (B, T, H) feature at each position (projected target feature, or the draft's own
            output).
            input_embeds: (B, T, H) target embedding of the NEXT token at each position.
            position_ids: (B, T) positions.
            cache: draft KV cache, extended in place.
            attention_mask: (B, 1, T, past + T) additive mask; None means causal.
        Returns:
            (B, T, H) predicted features, the input feature of the following step: pre-norm, or after the
            final norm with `norm_output` (EAGLE-3.1).
        """
        past = len(cache) if cache is not None else 0
        if attention_mask is None:
            attention_mask = causal_mask(features.shape[1], past, features.dtype, features.device)
        if self.head_type == "eagle1":
            hidden = self.fc(torch.cat([input_embeds, features], dim=-1))  # (B, T, H)
            embeds = None
        else:
            hidden, embeds = features, input_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        out = self.midlayer(hidden, embeds, position_embeddings, attention_mask, cache)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden: Tensor, target_lm_head: nn.Module) -> Tensor:
        """Draft logits (B, T, Vd) of `forward`'s output; EAGLE-1 uses the target's lm_head (Vd = V)."""
        if self.head_type == "eagle1":
            return target_lm_head(hidden)
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (identity for EAGLE-1)."""
        return draft_ids if self.head_type == "eagle1" else draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` (Vd distinct target ids, e.g. the most frequent in the training data) as draft
        vocab."""
        if self.head_type == "eagle1":
            raise ValueError("only eagle3 heads have a reduced draft vocabulary")
        write_draft_vocab(self, target_ids)

    @torch.no_grad()
    def init_lm_head_from_target(self, target_lm_weight: Tensor) -> None:
        """EAGLE-3: start the draft lm_head from the target's rows of the draft vocabulary."""
        if self.head_type != "eagle1":
            self.lm_head.weight.copy_(
                target_lm_weight[self.to_target_ids(torch.arange(self.config.draft_vocab_size))]
            )


@torch.no_grad()
def with_draft_vocab(head: EagleHead, target_ids: Tensor, target_lm_weight: Tensor) -> EagleHead:
    """A copy of the EAGLE-3 (or P-EAGLE) `head` drafting over `target_ids` instead: Vd' distinct target ids,
    any number. Every other weight carries over. A token the head already drafts keeps its trained lm_head
    row; a new one starts as the target's lm_head row, as a new head's rows do (`init_lm_head_from_target`).

    Args:
        head: an eagle3 or peagle head.
        target_ids: (Vd',) the new draft vocabulary, e.g. `train.data.draft_vocab_from_frequencies`.
        target_lm_weight: (V, H) the target's output embedding.
    """
    if head.shares_target_lm_head:
        raise ValueError(
            f"this {head.head_type} head drafts over the target's vocabulary: it has none to redraw"
        )
    target_ids = _token_ids(target_ids).flatten().to(head.d2t.device)
    vocab = head.config.vocab_size
    expected = (vocab, head.config.hidden_size)
    if tuple(target_lm_weight.shape) != expected:
        raise ValueError(f"target lm_head weight {tuple(target_lm_weight.shape)}, expected {expected}")
    new = type(head)(replace(head.config, draft_vocab_size=target_ids.numel()))
    new = new.to(dtype=head.lm_head.weight.dtype, device=head.lm_head.weight.device)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if set(missing) != {"lm_head.weight", "d2t", "t2d"} or unexpected:
        raise ValueError(f"redrawn vocabulary: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    new.set_draft_vocab(target_ids)  # validates: distinct ids in [0, V)
    old_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=target_ids.device))
    new_ids = new.to_target_ids(torch.arange(new.config.draft_vocab_size, device=target_ids.device))
    row_of = torch.full((vocab,), -1, dtype=torch.long, device=target_ids.device)
    row_of[old_ids] = torch.arange(old_ids.numel(), device=target_ids.device)
    rows = row_of[new_ids]
    weight = target_lm_weight[new_ids].to(new.lm_head.weight).clone()
    weight[rows >= 0] = head.lm_head.weight[rows[rows >= 0]]
    new.lm_head.weight.copy_(weight)
    return new.train(head.training)
