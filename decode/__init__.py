"""Tree-attention speculative decoding: trees, verification, acceptance, `prepare` and `generate`."""

from decode.calibrate import BudgetChoice, Calibration, calibrate, size_best_first
from decode.drafter import Drafter, DraftLimits, RowDrafters
from decode.generate import GenerateOutput, RowOutput, generate
from decode.policy import TreePolicy
from decode.prepare import is_int8_draft, prepare
from decode.sizing import best_tree
from decode.tree import (
    DEFAULT_EAGLE_TREE,
    DEFAULT_TREES,
    BestFirstTree,
    DynamicTree,
    TreeBuffers,
    build_tree,
    tree_label,
    verify_rows,
)

__all__ = [
    "DEFAULT_EAGLE_TREE",
    "DEFAULT_TREES",
    "BestFirstTree",
    "BudgetChoice",
    "Calibration",
    "DraftLimits",
    "Drafter",
    "DynamicTree",
    "GenerateOutput",
    "RowDrafters",
    "RowOutput",
    "TreeBuffers",
    "TreePolicy",
    "best_tree",
    "build_tree",
    "calibrate",
    "generate",
    "is_int8_draft",
    "prepare",
    "size_best_first",
    "tree_label",
    "verify_rows",
]
