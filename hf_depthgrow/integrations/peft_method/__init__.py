"""Depth growth as a registered PEFT method, laid out like a method inside `peft/tuners/`.

Importing this package registers `depthgrow` with peft (`peft.utils.register_peft_method`), after
which peft's own entry points work with it:

- `get_peft_model(model, DepthGrowConfig(positions=[2]))`: grown in place, exact at init, only the
  new blocks trainable;
- `peft_model.save_pretrained(folder)`: `adapter_config.json` and the new blocks only (safetensors);
- `PeftModel.from_pretrained(base, folder)`: the growth replayed and the saved blocks loaded;
- `with peft_model.disable_adapter():` the original model, no weights copied;
- `peft_model.merge_and_unload()`: the grown model, for native blocks a plain transformers model;
- `lora_config_for_grown(grown, ...)`: LoRA on the original layers of a grown model with the new
  blocks trained in full, the combination peft allows (see `combine.py` for why not one model).

Registering is idempotent (re-importing or reloading this package is harmless). `PeftConfig`
loading needs the registration, so import this package before `PeftModel.from_pretrained`.

Example:
    ```python
    >>> import hf_depthgrow.integrations.peft_method  # registers "depthgrow" with peft
    >>> from peft import PeftModel
    >>> peft_model = PeftModel.from_pretrained(base, "grown-adapter")
    ```
"""

from .combine import lora_config_for_grown
from .config import DepthGrowConfig
from .layer import DepthGrowLayer
from .model import DepthGrowModel
from .registry import NAME, PREFIX, peft_type, register

register(DepthGrowConfig, DepthGrowModel)

__all__ = [
    "DepthGrowConfig",
    "DepthGrowLayer",
    "DepthGrowModel",
    "NAME",
    "PREFIX",
    "lora_config_for_grown",
    "peft_type",
    "register",
]
