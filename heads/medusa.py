"""Medusa draft heads (Cai et al. 2401.10774, section 2.1): K residual heads on the target's last hidden
state.

Head k (0-based) reads the target's final hidden state at position t and predicts token t + k + 2, i.e. the
token after the one the target's own lm_head predicts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from heads.features import LAST


@dataclass
class MedusaConfig:
    hidden_size: int  # the target's hidden size H
    vocab_size: int  # the target's vocabulary V
    num_heads: int = 4  # K draft heads; head k predicts k + 2 tokens ahead
    num_layers: int = 1  # ResBlocks per head (Medusa paper: 1)
    share_lm_head: bool = False  # True: project with the target's frozen lm_head instead of a trained copy

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised so a fresh block is the identity (SiLU(0) = 0)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of L ResBlocks, each followed by a vocab projection (own or the target's shared lm_head)."""

    head_type = "medusa"
    int8_skip = ()  # every Linear may be int8 (`decode.prepare.quantize_draft`)

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(  # a fresh ResBlock per layer: `[ResBlock(h)] * n` would share one
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        self.lm_heads = (
            None
            if config.share_lm_head
            else nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
        )

    def checkpoint_notes(self) -> dict:
        """What `heads.io.save_heads` records in config.json beside the head's config: nothing more."""
        return {}

    def check_checkpoint(self, state: dict[str, Tensor], source: str) -> None:
        """Medusa tensors are checked by their keys and shapes alone (`heads.io.load_heads`)."""

    @property
    def shares_target_lm_head(self) -> bool:
        return self.lm_heads is None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (LAST,)

    @torch.no_grad()
    def init_from_lm_head(self, lm_head_weight: Tensor) -> None:
        """Copy the target's lm_head into every head's projection (the Medusa initialisation)."""
        if self.lm_heads is None:
            return
        for proj in self.lm_heads:
            if proj.weight.shape != lm_head_weight.shape:
                raise ValueError(
                    f"lm_head shape {tuple(lm_head_weight.shape)} != head projection "
                    f"{tuple(proj.weight.shape)}"
                )
            proj.weight.copy_(lm_head_weight)

    def head_logits(self, k: int, hidden_states: Tensor, lm_head: nn.Module | None = None) -> Tensor:
        """Logits (..., V) of head k alone (training computes one head at a time to bound memory)."""
        if self.lm_heads is None and lm_head is None:
            raise ValueError("these Medusa heads share the target's lm_head: pass lm_head=")
        projection = self.lm_heads[k] if self.lm_heads is not None else lm_head
        return projection(self.blocks[k](hidden_states))

    def forward(self, hidden_states: Tensor, lm_head: nn.Module | None = None) -> Tensor:
        """Logits of every head.

        Args:
            hidden_states: (B, T, H) final hidden states of the target.
            lm_head: the target's lm_head; required when `share_lm_head` is set.
        Returns:
            (K, B, T, V) logits; head k at position t scores token t + k + 2.
        """
        if self.lm_heads is None and lm_head is None:
            raise ValueError("these Medusa heads share the target's lm_head: pass lm_head=")
        # one K-row pass of the shared lm_head: on a CPU much cheaper than K one-row passes
        if self.lm_heads is None:
            return lm_head(torch.stack([block(hidden_states) for block in self.blocks]))
        return torch.stack([proj(block(hidden_states)) for block, proj in zip(self.blocks, self.lm_heads)])
