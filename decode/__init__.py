"""Tree-attention speculative decoding: trees, verification, acceptance, `prepare` and `generate`."""

from decode.batch import BatchOutput, generate_batch
from decode.calibrate import Calibration, calibrate
from decode.generate import GenerateOutput, generate
from decode.prepare import is_int8_draft, prepare
from decode.sizing import best_tree
from decode.tree import (
    DEFAULT_EAGLE_TREE,
    DEFAULT_TREES,
    DynamicTree,
    TreeBuffers,
    build_tree,
    tree_label,
    verify_rows,
)

__all__ = [
    "DEFAULT_EAGLE_TREE",
    "DEFAULT_TREES",
    "BatchOutput",
    "Calibration",
    "DynamicTree",
    "GenerateOutput",
    "TreeBuffers",
    "best_tree",
    "build_tree",
    "calibrate",
    "generate",
    "generate_batch",
    "is_int8_draft",
    "prepare",
    "tree_label",
    "verify_rows",
]
