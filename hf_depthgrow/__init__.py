"""hf_depthgrow: grow pretrained transformers in depth, exactly, and measure whether it helped."""

import importlib
import logging
import sys
import types

from .utils import __version__ as __version__  # written once, in utils; no torch imported


def _not_the_cpu_kernel_notice(record) -> bool:
    # bitsandbytes (imported by peft and transformers whenever it is installed) asks the `kernels` package, on CPUs
    # with AVX512-BF16, for an optional 4-bit kernel from the Hub, and both log when it cannot be had (offline, or
    # unverified). This package keeps 4-bit layers off that kernel (it passes no gradient to its input), so the two
    # lines are noise on every command's stderr: only they are dropped.
    message = str(record.msg)
    return not (message.startswith("Failed to load CPU gemm_4bit_forward")
                or message.startswith("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"))


for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_name).addFilter(_not_the_cpu_kernel_notice)

# Everything loads on first use, so that `import hf_depthgrow` (and `hf-depthgrow --help`) imports no torch.
_LAZY = {
    "FAMILIES": "growth.families",
    "SUPPORTED_FAMILIES": "growth.families",
    "FamilySpec": "growth.families",
    "GrowthConfig": "growth.config",
    "build_block": "growth.engine",
    "bypass_new_blocks": "growth.bypass",
    "grow_depth": "growth.engine",
    "growth_record": "growth.record",
    "is_quantized": "growth.checks",
    "new_block_modules": "growth.engine",
    "new_block_parameters": "growth.engine",
    "NormInfo": "growth.norms",
    "norm_inventory": "growth.norms",
    "load_pretrained": "hub.loading",
    "save_pretrained": "hub.serialization",
    "ProbeResult": "probe.signal",
    "stepping_stone": "probe.stepping_stone",
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
_ALIASES = {"from_pretrained": "load_pretrained"}  # the name peft users reach for


def __getattr__(name):
    if name in _ALIASES:
        return __getattr__(_ALIASES[name])
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_depthgrow' has no attribute {name!r}")


class _Package(types.ModuleType):
    """`hf_depthgrow.probe` is the probe function, though a subpackage shares its name.

    Importing the subpackage binds its module to this attribute; the property keeps the function there.
    """

    @property
    def probe(self):
        from .probe.signal import probe

        return probe

    @probe.setter
    def probe(self, module):  # the import system binding the subpackage: the name stays the function
        pass


sys.modules[__name__].__class__ = _Package

__all__ = ["probe", "from_pretrained", *_LAZY]
