"""hf_depthgrow: grow pretrained transformers in depth, exactly, and measure whether it helped."""

__version__ = "0.1.0"

from .families import FAMILIES, SUPPORTED_FAMILIES, FamilySpec  # noqa: E402
from .growth import (  # noqa: E402
    GrowthConfig,
    build_block,
    bypass_new_blocks,
    grow_depth,
    growth_record,
    is_quantized,
    new_block_modules,
    new_block_parameters,
)
from .norms import NormInfo, norm_inventory  # noqa: E402
from .serialization import load_pretrained, save_pretrained  # noqa: E402

from_pretrained = load_pretrained  # the name peft users reach for

__all__ = [
    "FAMILIES",
    "SUPPORTED_FAMILIES",
    "FamilySpec",
    "GrowthConfig",
    "NormInfo",
    "build_block",
    "bypass_new_blocks",
    "grow_depth",
    "growth_record",
    "is_quantized",
    "new_block_modules",
    "new_block_parameters",
    "norm_inventory",
    "from_pretrained",
    "load_pretrained",
    "save_pretrained",
]
