"""Draft heads (Medusa, EAGLE-1, EAGLE-3, DFlash), hidden-state capture and head checkpoints (exports to
serving engines: the `engines` package)."""

from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.features import FeatureCapture, find_decoder_layers
from heads.io import load_heads, save_heads
from heads.medusa import MedusaConfig, MedusaHeads

__all__ = [
    "DFlashConfig",
    "DFlashHead",
    "EagleConfig",
    "EagleHead",
    "FeatureCapture",
    "MedusaConfig",
    "MedusaHeads",
    "find_decoder_layers",
    "load_heads",
    "save_heads",
]
