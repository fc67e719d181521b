"""The growth engine: where a block goes, what it is, and the record of what was grown.

- `engine`: `grow_depth`, `build_block` (one block, built without inserting it), `new_block_modules`/`new_block_parameters`,
  `reattach_adapters`, `check_record_matches`;
- `config`: `GrowthConfig` (how each block is built), `BLOCK_KINDS`, `INITS`;
- `placement`: presets, plans and mergekit passthrough configs as explicit entries (`resolve_positions`);
- `checks`: argument checks shared with the probe (`check_positions`, `resolve_block_kind`, ...);
- `blocks`: the native and adapter block builders for a known family and stack (`build_blocks`);
- `layout`: the layer list and everything indexed by layer (per-layer config lists, `layer_idx`);
- `bypass`: `bypass_new_blocks`, running a grown model as the original;
- `record`: the typed `GrowthRecord` stored under `config.depth_growth`;
- `families`: the family table keyed by `config.model_type`, and the rows inferred in this process (`known_spec`);
- `inference`: a family row inferred for a `model_type` the table does not name (`infer_spec`);
- `layer_probe`: running one layer on its own, as the inference does to find a family's residual outputs;
- `trial`: the native growth trial that decides whether an inferred family grows natively;
- `towers`: which layer stack to grow, the model's own or one tower of a nested config, and its family row
  (`resolve_target`, `resolve_family`);
- `adapter`: the generic normalised residual block and its hooks;
- `norms`: normalisation inventory and eps checks;
- `prefix`: running a grown model from (or up to) its lowest new block;
- `quantized`: a frozen base quantised by bitsandbytes (4-bit or 8-bit);
- `verify`: the exactness post-check `grow_depth` runs on a tiny probe input (`GrowthNotExactError`).
"""

from .bypass import bypass_new_blocks
from .checks import check_positions, is_quantized, resolve_block_kind
from .quantized import QUANTIZE_MODES, bnb_mode, dequantized_copy
from .config import BLOCK_KINDS, INITS, GrowthConfig
from .engine import build_block, check_record_matches, grow_depth, new_block_modules, new_block_parameters, reattach_adapters
from .layout import Snapshot
from .families import FAMILIES, SUPPORTED_FAMILIES, FamilySpec
from .towers import resolve_family
from .towers import StackTarget, Tower, find_towers, resolve_target
from .norms import NormInfo, norm_inventory
from .placement import PlacementEntry, resolve_positions
from .record import GrowthRecord, InvalidGrowthRecordError, growth_record
from .verify import GrowthNotExactError

__all__ = [
    "BLOCK_KINDS",
    "INITS",
    "FAMILIES",
    "SUPPORTED_FAMILIES",
    "FamilySpec",
    "StackTarget",
    "Tower",
    "GrowthConfig",
    "GrowthNotExactError",
    "GrowthRecord",
    "InvalidGrowthRecordError",
    "NormInfo",
    "PlacementEntry",
    "Snapshot",
    "build_block",
    "bypass_new_blocks",
    "check_record_matches",
    "check_positions",
    "find_towers",
    "grow_depth",
    "growth_record",
    "is_quantized",
    "QUANTIZE_MODES",
    "bnb_mode",
    "dequantized_copy",
    "new_block_modules",
    "new_block_parameters",
    "norm_inventory",
    "reattach_adapters",
    "resolve_block_kind",
    "resolve_family",
    "resolve_positions",
    "resolve_target",
]
