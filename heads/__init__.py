"""Draft heads (Medusa, EAGLE-1, EAGLE-3), hidden-state capture and head checkpoints."""

from heads.eagle import EagleConfig, EagleHead
from heads.export import export_head, import_head, validate_export
from heads.features import FeatureCapture, find_decoder_layers
from heads.io import load_heads, save_heads
from heads.medusa import MedusaConfig, MedusaHeads

__all__ = [
    "EagleConfig",
    "EagleHead",
    "FeatureCapture",
    "MedusaConfig",
    "MedusaHeads",
    "export_head",
    "find_decoder_layers",
    "import_head",
    "load_heads",
    "save_heads",
    "validate_export",
]
