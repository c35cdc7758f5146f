"""Two (or more) drafters in one tree under one node budget: each node's draft distribution is a mixture of
its parts' distributions over the target's vocabulary, q = sum_i w_i q_i, so one tree growth ranks every
part's candidates together (a dynamic tree's budget goes to the best of them, whoever proposed them) and the
lossless rule samples against the q the children were drawn from, as for any drafter.

For example EAGLE-3 plus n-gram lookup: where the text copies from its context the n-gram part puts almost
all of its weight on the copied token, which then leads the node's children; elsewhere it is flat and the
EAGLE-3 part's candidates lead.

Every part sees the same calls (the same nodes, in the same order); a part that taps the target gets its
own layers' slice of the features the composite taps (the union of the parts' layers, in order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from decode.drafter import Drafter, DraftLimits

FLOOR = math.log(1e-30)  # log-probability of the tokens no part proposes (the mixture's floor)


@dataclass(frozen=True, eq=False)
class Composite:
    """A draft source made of other draft sources: `Composite([eagle_head, Ngram()], weights=[0.5, 0.5])`."""

    parts: list
    weights: list[float] = field(default_factory=list)  # mixture weights (normalised); [] = equal
    abstain: bool = True  # a part with flat logits at a node (no opinion) leaves that node's mixture

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a Composite needs at least two parts, got {len(self.parts)}")
        if self.weights and (len(self.weights) != len(self.parts) or min(self.weights) <= 0):
            raise ValueError(f"weights must be {len(self.parts)} positive numbers, got {self.weights}")


def part_models(source: Composite) -> list[nn.Module]:
    """What `decode.prepare` lays out for the parts: their head modules and their draft models."""
    from heads.registry import kind_of

    models = []
    for part in source.parts:
        if isinstance(part, Drafter):  # a drafter instance: its own business, nothing for prepare to lay out
            continue
        kind = kind_of(part)
        models += [part] if kind.head_types else (kind.part("models")(part) if kind.models else [])
    return models


class CompositeDrafter(Drafter):
    """`Composite`'s drafter for a batch (see the module docstring)."""

    def __init__(self, source: Composite, target: nn.Module, batch: int) -> None:
        from decode.drafters import make_drafter  # the registry's factory (this module is one of its kinds)

        self.parts = [make_drafter(part, target, batch) for part in source.parts]
        weights = source.weights or [1.0] * len(self.parts)
        self.weights = [w / sum(weights) for w in weights]
        self.abstain = source.abstain
        self._ids: dict[tuple, Tensor | None] = {}
        self._weights: dict[torch.device, Tensor] = {}  # self.weights on each device: uploaded once
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.feature_layers = tuple(dict.fromkeys(layer for p in self.parts for layer in p.feature_layers))
        # where each part's layers sit among the composite's (features are concatenated per layer)
        self.slices = [[self.feature_layers.index(layer) for layer in p.feature_layers] for p in self.parts]

    def limits(self) -> DraftLimits:
        depths = [p.limits().max_depth for p in self.parts if p.limits().max_depth is not None]
        return DraftLimits(
            max_depth=min(depths) if depths else None,
            dynamic=True,
            block=all(p.limits().block for p in self.parts),
        )

    def start(self, prompts):
        for part in self.parts:
            part.start(prompts)

    def advance(self, features, tokens):
        for part, layers in zip(self.parts, self.slices):
            if not layers:
                part.advance(None, tokens)
                continue
            width = features[0].shape[-1] // len(self.feature_layers)
            columns = torch.cat([torch.arange(i * width, (i + 1) * width) for i in layers])
            part.advance([f[:, columns.to(f.device)] for f in features], tokens)

    def _target_ids(self, i: int, logits: Tensor) -> Tensor | None:
        """Part i's vocabulary as target ids (cached), or None where it is the target's own, in order."""
        key = (i, logits.shape[-1], logits.device)
        if key not in self._ids:
            ids = self.parts[i].to_target_ids(torch.arange(logits.shape[-1], device=logits.device))
            identity = logits.shape[-1] == self.vocab_size and bool(
                (ids == torch.arange(self.vocab_size, device=ids.device)).all()
            )
            self._ids[key] = None if identity else ids
        return self._ids[key]

    def _in_target_vocabulary(self, logits: list[Tensor]) -> list[Tensor]:
        """The parts' logits over the target's vocabulary: -inf for the tokens outside a part's own (by a
        scatter: index_copy_ along the last dimension is slower on the CPU)."""
        out = []
        for i, x in enumerate(logits):
            ids = self._target_ids(i, x)
            if ids is not None:
                full = x.new_full((*x.shape[:-1], self.vocab_size), -math.inf)
                x = full.scatter_(-1, ids.expand(*x.shape[:-1], -1), x)
            out.append(x)
        return out

    def _mixture(self, logits: list[Tensor]) -> Tensor:
        """log of the weighted mixture of the parts' softmaxes, over the target's vocabulary. A part may give
        one row for every node of a level, (B, 1, V), beside parts that give one per node (B, n, V). With
        `abstain`, a part whose logits are flat at a node (n-gram lookup without a match, or all -inf) has no
        weight there, and the others' weights are renormalised; a node where every part is flat keeps those
        with finite logits. On the CPU a part with no weight at any node of the call is skipped, and where one
        part speaks alone its log-probabilities are the result (checks that would each cost a GPU a host
        round trip)."""
        logits = [x.float() for x in self._in_target_vocabulary(logits)]
        device = logits[0].device
        shape = torch.broadcast_shapes(*(x.shape[:-1] for x in logits))
        if device not in self._weights:
            self._weights[device] = torch.tensor(self.weights, device=device)
        weights = self._weights[device].expand(*shape, -1)
        if self.abstain:  # NaN logits are not flat: they speak, and the NaN shows in the result
            top = torch.stack([x.amax(-1).expand(shape) for x in logits], dim=-1)
            speaks = top != torch.stack([x.amin(-1).expand(shape) for x in logits], dim=-1)
            speaks |= (top > -math.inf) & ~speaks.any(-1, keepdim=True)
            weights = weights * speaks
            weights = weights / weights.sum(-1, keepdim=True)
        used = list(range(len(self.parts)))
        if device.type == "cpu":
            used = [i for i in used if bool(weights[..., i].any())]
        if len(used) == 1:  # weight 1 wherever it is used
            return torch.log_softmax(logits[used[0]], dim=-1).clamp_min_(FLOOR)
        mixed = 0.0
        for i in used:  # a part adds nothing where it has no weight, even a NaN softmax (all -inf logits)
            weight = weights[..., i : i + 1]
            mixed = mixed + (torch.softmax(logits[i], dim=-1) * weight).masked_fill_(weight == 0, 0.0)
        return mixed.clamp_min_(math.exp(FLOOR)).log_()

    def root_logits(self):
        return self._mixture([p.root_logits() for p in self.parts])

    def expand(self, parent_rows, tokens, depth):
        return self._mixture([p.expand(parent_rows, tokens, depth) for p in self.parts])

    def end_proposal(self):
        for part in self.parts:
            part.end_proposal()

    def select(self, rows):
        for part in self.parts:
            part.select(rows)
