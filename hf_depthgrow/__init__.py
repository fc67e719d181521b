"""hf_depthgrow: grow pretrained transformers in depth, exactly, and measure whether it helped."""

__version__ = "0.1.0"

import logging as _logging


def _not_the_cpu_kernel_notice(record) -> bool:
    # bitsandbytes (imported by peft and transformers whenever it is installed) logs, on CPUs with AVX512-BF16, that
    # it could not fetch an optional 4-bit kernel from the Hub. This package keeps 4-bit layers off that kernel
    # (it passes no gradient to its input), so the line is noise on every command's stderr: only it is dropped.
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_cpu_kernel_notice)

from .growth.families import FAMILIES, SUPPORTED_FAMILIES, FamilySpec  # noqa: E402
from .growth.engine import (  # noqa: E402
    GrowthConfig,
    build_block,
    bypass_new_blocks,
    grow_depth,
    growth_record,
    is_quantized,
    new_block_modules,
    new_block_parameters,
)
from .growth.norms import NormInfo, norm_inventory  # noqa: E402
from .hub.serialization import load_pretrained, save_pretrained  # noqa: E402

# Bound eagerly: these functions share their module's name, and a lazy binding would be
# replaced by the submodule the first time anything imports it.
from .probe.signal import ProbeResult, probe  # noqa: E402
from .probe.stepping_stone import stepping_stone  # noqa: E402

from_pretrained = load_pretrained  # the name peft users reach for

# Heavier pieces (accelerate, peft, matplotlib) load on first use, so `import hf_depthgrow` stays light.
_LAZY = {
    "train": "training",
    "GrownTrainer": "training",
    "TrainConfig": "training",
    "evaluate_delta": "evaluation",
    "compare_models": "evaluation",
    "push_to_hub": "hub",
    "push_model_to_hub": "hub",
    "render_model_card": "hub",
    "CardInfo": "hub",
    "run_pipeline": "pipeline",
    "load_model": "hub.loading",
    "RunConfig": "pipeline",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_depthgrow' has no attribute {name!r}")


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
    "probe",
    "ProbeResult",
    "stepping_stone",
    *_LAZY,
]
