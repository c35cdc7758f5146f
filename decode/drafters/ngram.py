"""Prompt lookup (n-gram) drafting in our own loop: a node's children are the tokens that followed the longest
suffix of its context (the row's text so far plus the node's path) wherever that suffix occurred before in
the row's text (prompt and reply), most frequent first. No model, no target features: what pays off on
prompts that copy from their own context (summaries, edits, code changes).

The draft distribution of a node puts its candidates far above every other token (logit `CONFIDENT` plus the
log of how often each followed), so greedy trees take them first, a dynamic tree ranks a node with a long,
frequent match above one without any, and sampling stays lossless (q is a proper distribution, the rest of
the vocabulary keeps a tiny probability). A node without any match gets flat logits: its children score so
low that a dynamic tree's budget goes elsewhere first.

The matching runs on the host over per-row tables of n-gram positions, updated as text is committed; a node's
tokens are read back once per level (free on the CPU; on a GPU a host round trip per draft level).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from decode.drafter import Drafter, DraftLimits

CONFIDENT = 30.0  # logit of a candidate over the rest of the vocabulary (about e^-30 each)


@dataclass(frozen=True)
class Ngram:
    """A prompt-lookup draft source: `generate(model, ids, Ngram(), tree=...)`.

    Args:
        max_ngram: the longest suffix matched (longer suffixes are tried first).
        min_ngram: the shortest suffix matched.
        max_depth: the deepest level drafted (None: as deep as the tree asks).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    max_depth: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


class _Text:
    """One row's committed text and, per n, where each n-gram ended (the index of the token after it)."""

    def __init__(self, sizes: range) -> None:
        self.tokens: list[int] = []
        self.sizes = sizes
        self.follow: dict[int, defaultdict[tuple[int, ...], list[int]]] = {
            n: defaultdict(list) for n in sizes
        }

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in self.sizes:
                if end > n:  # the n tokens before the new one are followed by it
                    self.follow[n][tuple(self.tokens[end - 1 - n : end - 1])].append(end - 1)

    def candidates(self, path: list[int]) -> dict[int, int]:
        """Next-token counts after the longest suffix of text + path that occurred before."""
        context = self.tokens[-max(self.sizes) :] + path if path else self.tokens[-max(self.sizes) :]
        for n in reversed(self.sizes):
            if len(context) < n:
                continue
            ends = self.follow[n].get(tuple(context[-n:]))
            if ends:
                counts: dict[int, int] = {}
                for end in ends:
                    counts[self.tokens[end]] = counts.get(self.tokens[end], 0) + 1
                return counts
        return {}


class NgramDrafter(Drafter):
    """`Ngram`'s drafter for a batch (see the module docstring)."""

    feature_layers = ()

    def __init__(self, spec: Ngram, target: nn.Module, batch: int) -> None:
        self.spec = spec
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.device = target.get_output_embeddings().weight.device
        self.rows: list[_Text] = []
        self.paths: list[
            list[list[int]]
        ] = []  # per row: the path (tokens below the root) of each expanded node

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=self.spec.max_depth, dynamic=True, block=False)

    def start(self, prompts: list[Tensor]) -> None:
        sizes = range(self.spec.min_ngram, self.spec.max_ngram + 1)
        self.rows = [_Text(sizes) for _ in prompts]
        for text, prompt in zip(self.rows, prompts):
            text.extend(prompt[:1].tolist())  # the rest arrives through `advance` (the tokens after each)
        self.paths = [[] for _ in prompts]

    def advance(self, features, tokens: list[Tensor]) -> None:
        for text, new in zip(self.rows, tokens, strict=True):
            text.extend(new.tolist())

    def _logits(self, counts_per_node: list[list[dict[int, int]]]) -> Tensor:
        batch, n = len(counts_per_node), len(counts_per_node[0])
        logits = torch.zeros(batch, n, self.vocab_size)
        for b, nodes in enumerate(counts_per_node):
            for i, counts in enumerate(nodes):
                for token, count in counts.items():
                    logits[b, i, token] = CONFIDENT + math.log(count)
        return logits.to(self.device)

    def root_logits(self) -> Tensor:
        return self._logits([[text.candidates([])] for text in self.rows])[:, 0]

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        counts = []
        for b, (parents, nodes) in enumerate(zip(parent_rows.tolist(), tokens.tolist())):
            paths = [(self.paths[b][p] if p >= 0 else []) + [token] for p, token in zip(parents, nodes)]
            self.paths[b] += paths
            counts.append([self.rows[b].candidates(path) for path in paths])
        return self._logits(counts)

    def end_proposal(self) -> None:
        self.paths = [[] for _ in self.rows]

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
        self.paths = [self.paths[r] for r in rows]
