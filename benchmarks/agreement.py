"""Where a greedy speculative output leaves plain greedy decoding, and whether the target's logits there are
an fp32 tie.

Speculative decoding is lossless in exact arithmetic; in fp32 a verify pass computes a position's logits from
other row counts and other tree layouts than plain decoding does, so their last bits differ (docs/cpu.md).
Where the target's two best logits are closer than that rounding, the two runs may take different tokens,
and from there on their texts part. Such a difference is a tie, not a drafting error: the benchmark names it
and counts it apart (`Tally.ties`); any other difference is a defect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# logits closer than this (absolute; they are about 10-20 here) are a tie: passes that round differently
# were seen 1e-5 apart (SmolLM2-135M, fp32, a verify pass of 13 rows against plain decoding's 1)
TIE_GAP = 1e-4


@dataclass(frozen=True)
class Difference:
    at: int  # index in the sequence (prompt included) of the first token that differs
    plain: int  # plain decoding's token there
    other: int  # the other run's token
    gap: float | None  # the target's logit of `plain` minus that of `other` at that position; None: one run
    # stopped there (its sequence is a prefix of the other's)

    @property
    def tie(self) -> bool:
        return self.gap is not None and abs(self.gap) < TIE_GAP

    def __str__(self) -> str:
        if self.gap is None:
            return f"one run stops at token {self.at}, the other goes on"
        kind = "an fp32 tie" if self.tie else "NOT a tie"
        return (
            f"token {self.at}: plain {self.plain}, this run {self.other}; their logits differ by "
            f"{self.gap:.2e} ({kind}: below {TIE_GAP:g} is)"
        )


@torch.no_grad()
def first_difference(model: nn.Module, plain: Tensor, other: Tensor) -> Difference | None:
    """The first position where the (1, T) sequences `plain` and `other` differ (None if equal), and the gap
    between the two tokens' logits there, from one forward of `model` over plain's prefix."""
    a, b = plain.reshape(-1).tolist(), other.reshape(-1).tolist()
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None:
        return None if len(a) == len(b) else Difference(min(len(a), len(b)), -1, -1, None)
    prefix = torch.tensor([a[:at]], device=next(model.parameters()).device)
    logits = model(prefix).logits[0, -1].float()
    return Difference(at, a[at], b[at], (logits[a[at]] - logits[b[at]]).item())
