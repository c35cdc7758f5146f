"""Tree-attention speculative decoding: trees, verification, acceptance and `generate`."""

from decode.generate import GenerateOutput, generate
from decode.prepare import prepare
from decode.tree import DEFAULT_TREES, DynamicTree, TreeBuffers, build_tree

__all__ = [
    "DEFAULT_TREES",
    "DynamicTree",
    "GenerateOutput",
    "TreeBuffers",
    "build_tree",
    "generate",
    "prepare",
]
