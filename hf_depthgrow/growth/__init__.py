"""The growth engine: where a block goes, what it is, and the record of what was grown.

- `engine`: `grow_depth`, `bypass_new_blocks`, block construction;
- `families`: the family table keyed by `config.model_type`;
- `adapter`: the generic normalised residual block and its hooks;
- `norms`: normalisation inventory and eps checks;
- `prefix`: running a grown model from (or up to) its lowest new block.
"""

from .engine import (
    BLOCK_KINDS,
    INITS,
    GrowthConfig,
    build_block,
    bypass_new_blocks,
    grow_depth,
    growth_record,
    is_quantized,
    new_block_modules,
    new_block_parameters,
)
from .families import FAMILIES, SUPPORTED_FAMILIES, FamilySpec, resolve_family
from .norms import NormInfo, norm_inventory
