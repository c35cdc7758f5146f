"""The lm_head a head's drafts project with, and a head's floating dtype."""

from __future__ import annotations

import torch
from torch import nn

DRAFT_LM_HEAD = "_selfspec_draft_lm_head"  # a draft's own copy of the target's lm_head (`decode.prepare`)


def draft_lm_head(heads: nn.Module, target: nn.Module) -> nn.Module:
    """The lm_head a draft that shares the target's projects with: its own (int8) copy, if
    `decode.prepare.quantize_draft` gave it one, else the target's."""
    own = heads.__dict__.get(DRAFT_LM_HEAD)
    return own if own is not None else target.get_output_embeddings()


def float_dtype(module: nn.Module) -> torch.dtype:
    """dtype of the first floating-point parameter (float32 when there is none, e.g. all-int8 heads)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
