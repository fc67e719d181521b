"""Growth together with LoRA, the way peft allows it: two stages, each a standard peft model.

peft does not put a `depthgrow` adapter and a LoRA adapter in one model:
- `PeftModel.add_adapter` refuses a second adapter of another type ("Cannot combine adapters with
  different peft types");
- `get_peft_model(..., mixed=True)` (`PeftMixedModel`) accepts only the types hard-coded in
  `peft.tuners.mixed.COMPATIBLE_TUNER_TYPES` (LoRA, LoHa, LoKr, AdaLoRA, OFT, SHiRA): its
  `MixedModel` dispatches on their config classes, so registering with `is_mixed_compatible=True`
  would not make it build a depth growth, and `PeftMixedModel` cannot save anyway.

What works is growth first, LoRA second: `merge_and_unload()` gives the grown transformers model,
and `lora_config_for_grown` makes the `LoraConfig` that puts LoRA on the original layers and trains
the grown blocks in full (`modules_to_save`), so one LoRA `PeftModel` trains and saves both.
"""

from __future__ import annotations

from torch import nn

from ...growth.engine import new_block_modules
from ...growth.record import growth_record


def lora_config_for_grown(model: nn.Module, **lora_kwargs):
    """A `peft.LoraConfig` for a grown model: LoRA on the original layers, the new blocks trained in full.

    Args:
        model: A grown transformers model (e.g. `get_peft_model(m, DepthGrowConfig(...)).merge_and_unload()`).
        lora_kwargs: Any `LoraConfig` argument (`r`, `target_modules`, `lora_alpha`, ...) except
            `layers_to_transform` and `modules_to_save`, which this sets from the growth record.

    Raises:
        ValueError: the model was not grown, or `lora_kwargs` sets a field this function owns.

    Example:
        ```python
        >>> grown = get_peft_model(model, DepthGrowConfig(positions=[2])).merge_and_unload()
        >>> lora_model = get_peft_model(grown, lora_config_for_grown(grown, r=8, target_modules=["q_proj", "v_proj"]))
        ```
    """
    from peft import LoraConfig

    record = growth_record(model)
    if record is None:
        raise ValueError("the model was not grown (no depth_growth in its config): grow it first, e.g. with DepthGrowConfig")
    owned = sorted({"layers_to_transform", "modules_to_save"} & set(lora_kwargs))
    if owned:
        raise ValueError(f"{owned} are set from the growth record (original layers, new blocks); leave them out")
    blocks = {id(m) for m in new_block_modules(model)}
    names = [name for name, module in model.named_modules() if id(module) in blocks]
    # Native blocks are layers of their own: keep LoRA off them, they train in full. Adapter blocks
    # take no slot, so every layer index is an original layer.
    return LoraConfig(layers_to_transform=list(record.old_indices), modules_to_save=names, **lora_kwargs)
