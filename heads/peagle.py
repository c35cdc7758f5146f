"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 head that drafts K tokens in one forward.

The head is EAGLE-3's (`heads.eagle.EagleHead`: fused taps, one decoder layer, a reduced-vocabulary
lm_head) plus two learned inputs for the positions it has not seen yet. After the last committed position
p (its real feature and the root token, as EAGLE-3 runs it) come K - 1 placeholder positions p + 1 ..
p + K - 1 whose feature is `mask_hidden`, a vector in the space of the concatenated taps (it goes through
`input_norm` and `fc` like a real feature), and whose token embedding is `mask_embedding`, the trained
embedding of `mask_token_id`. Attention is causal: placeholder j sees the committed positions and the
placeholders before it. The output at p scores depth 1 (the root's children), placeholder j scores depth
j + 1, whatever the tokens drafted before it: one forward drafts depths 1 .. K, as a block drafter.

vLLM 0.32 serves this with `parallel_drafting`: `mask_hidden` is a weight of its eagle3 model, the mask
token id its placeholder (`pard_token` / `mask_token_id`), and the mask embedding the row `mask_token_id`
of the draft's own `embed_tokens` (engines/export.py writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from heads.eagle import EagleConfig, EagleHead

HEAD_TYPE = "peagle"


@dataclass
class PEagleConfig(EagleConfig):
    HEAD_TYPES: ClassVar[tuple[str, ...]] = (HEAD_TYPE,)
    parallel_depths: int = 4  # K: tokens drafted per forward (the root's output + K - 1 placeholders)
    mask_token_id: int | None = None  # the placeholders' token (its embedding row is `mask_embedding`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.parallel_depths < 1:
            raise ValueError(f"parallel_depths must be at least 1, got {self.parallel_depths}")
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be a token id in [0, {self.vocab_size}), got {self.mask_token_id!r}"
            )

    @classmethod
    def from_target(cls, target_config, head_type: str = HEAD_TYPE, **overrides) -> PEagleConfig:
        return super().from_target(target_config, head_type, **overrides)


class PEagleHead(EagleHead):
    """EAGLE-3's head with the placeholder inputs of parallel drafting (module docstring)."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        taps = len(config.aux_layer_ids) * config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(taps))  # as speculators starts it
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))  # init_from_target sets it

    @property
    def parallel_depths(self) -> int:
        return self.config.parallel_depths

    @property
    def draft_depths(self) -> int:
        """Tree depths one forward drafts (as `DFlashHead.draft_depths`)."""
        return self.config.parallel_depths

    def checkpoint_notes(self) -> dict:
        return {**super().checkpoint_notes(), "mask_embedding": "the trained embedding of mask_token_id"}

    @classmethod
    def from_eagle3(
        cls, head: EagleHead, parallel_depths: int, mask_token_id: int, target_embedding: Tensor
    ) -> PEagleHead:
        """A P-EAGLE head that starts from a trained EAGLE-3 head: its taps, fc (and EAGLE-3.1's norm before
        it), layer, norm, lm_head and draft vocabulary; new placeholder inputs. EAGLE-3.1's `norm_output` is
        dropped: it changes only the feature a head feeds back to itself, which a parallel drafter never
        does (its logits are the same either way), and vLLM's P-EAGLE config has no such key."""
        if head.head_type != "eagle3":
            raise ValueError(f"a P-EAGLE head starts from an eagle3 head, got {head.head_type}")
        fields = {k: v for k, v in head.config.to_dict().items() if k != "head_type"}
        config = PEagleConfig(
            head_type=HEAD_TYPE,
            **{**fields, "norm_output": False},
            parallel_depths=parallel_depths,
            mask_token_id=mask_token_id,
        )
        new = cls(config).to(device=next(head.parameters()).device)
        missing, unexpected = new.load_state_dict(head.state_dict(), strict=False)
        if set(missing) != {"mask_hidden", "mask_embedding"} or unexpected:
            raise ValueError(f"eagle3 -> peagle: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        new.init_from_target(target_embedding)
        return new

    @torch.no_grad()
    def init_from_target(self, target_embedding: Tensor) -> None:
        """Start `mask_embedding` from the target's embedding of `mask_token_id`."""
        self.mask_embedding.copy_(target_embedding[self.config.mask_token_id])

    def placeholders(self, batch: int, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The (feature, embedding) inputs of `count` placeholder positions per row: (B, count, H) each."""
        feature = self.project_features(self.mask_hidden.to(dtype))
        shape = (batch, count, self.config.hidden_size)
        return feature.expand(shape), self.mask_embedding.to(dtype).expand(shape)
