"""`DepthGrowModel`: the peft tuner that grows a model in depth with `hf_depthgrow.grow_depth`.

What peft calls "injecting the adapter" is one `grow_depth` call: the new blocks become layers of
the model (native) or blocks hosted on original layers (adapter), and the grown model computes
exactly what the original did. The pieces of peft's tuner contract map onto the growth engine:

| peft | here |
|---|---|
| inject the adapter | `grow_depth(model, config.positions, config=config.growth_config())` |
| trainable parameters | `hf_depthgrow.new_block_parameters(model)`, nothing else |
| adapter state dict | every tensor under a new block's module, names unchanged |
| disable adapters | `hf_depthgrow.bypass_new_blocks(model)`, held open until re-enabled |
| merge and unload | the grown model itself (native blocks: a plain transformers checkpoint) |
| unload | the growth undone: the original layers, config and layer indices |

Loading replays the growth from `adapter_config.json` (same positions, seed and init) and then
loads the saved blocks over it, so a saved adapter needs no copy of the base weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from peft.tuners.tuners_utils import BaseTuner

from ...growth import adapter
from ...growth.bypass import bypass_new_blocks
from ...growth.engine import grow_depth, new_block_modules, new_block_parameters
from ...growth.towers import resolve_family
from ...growth import Snapshot
from ...growth.record import growth_record
from .layer import DepthGrowLayer
from .registry import PREFIX

_PEFT_PREFIX = "base_model.model."  # what PeftModel puts in front of the grown model's state-dict keys


class DepthGrowModel(BaseTuner):
    """Grow a transformers model in depth, exactly, as a peft method (`peft_type="DEPTHGROW"`).

    Made by `peft.get_peft_model(model, DepthGrowConfig(...))` or `PeftModel.from_pretrained`; not
    usually built directly. One growth per model: a second `depthgrow` adapter, a base that was
    already grown (its config holds `depth_growth`), and `low_cpu_mem_usage=True` are refused.

    Example:
        ```python
        >>> from peft import get_peft_model
        >>> from hf_depthgrow.integrations.peft_method import DepthGrowConfig
        >>> peft_model = get_peft_model(model, DepthGrowConfig(positions=[2]))   # a 4-layer Llama
        >>> peft_model.base_model.model.config.num_hidden_layers
        5
        >>> with peft_model.disable_adapter():
        ...     original_logits = peft_model(input_ids).logits
        >>> grown = peft_model.merge_and_unload()                                   # a plain LlamaForCausalLM
        ```
    """

    prefix: str = PREFIX
    tuner_layer_cls = DepthGrowLayer
    target_module_mapping: dict = {}

    # ------------------------------------------------------------------ growing

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: Optional[dict[str, torch.Tensor]] = None,
    ) -> None:
        """Grow `model` in place as `self.peft_config[adapter_name]` says, then train only the new blocks."""
        config = self.peft_config[adapter_name]
        others = [name for name in self.peft_config if name != adapter_name]
        if others:
            raise ValueError(
                f"this model already carries the depthgrow adapter {others[0]!r}: one growth per model. Call "
                "merge_and_unload() and wrap the grown model again to grow it a second time."
            )
        if growth_record(model) is not None:
            raise ValueError(
                "the model was already grown (its config holds depth_growth): DepthGrowConfig grows an ungrown base, "
                "so that disable_adapter() and unload() give that base back. Grow it with hf_depthgrow.grow_depth instead."
            )
        if low_cpu_mem_usage or nn.Linear(1, 1).weight.device.type == "meta":
            raise ValueError(
                "low_cpu_mem_usage=True is not supported by depthgrow: new blocks are copies of real layers and the "
                "growth is checked on a real forward pass. Load without low_cpu_mem_usage."
            )
        _, stack, _ = resolve_family(model)  # a model without a findable layer stack: one ValueError, untouched
        self._depthgrow_before = Snapshot.take(model, stack)
        grow_depth(model, config.positions, config=config.growth_config())
        self.add_module("depthgrow_layer", DepthGrowLayer(adapter_name, config.positions))
        self._depthgrow_bypass = None
        self._mark_only_adapters_as_trainable(model)
        if config.inference_mode:
            for _, param in new_block_parameters(model):
                param.requires_grad = False

    def _create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("depthgrow inserts blocks with hf_depthgrow.grow_depth; it replaces no module")

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        new = {id(param) for _, param in new_block_parameters(model)}
        for param in model.parameters():
            param.requires_grad = id(param) in new

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # New blocks are copies of the model's own layers and stay in its dtype: an fp32 upcast (what peft
        # does for LoRA weights) would make a native block differ from its neighbours and break the save.
        return None

    # ------------------------------------------------------------------ switching the blocks off and on

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        bypass = getattr(self, "_depthgrow_bypass", None)
        if not enabled and bypass is None:
            stack = contextlib.ExitStack()
            stack.enter_context(bypass_new_blocks(self.model))
            self._depthgrow_bypass = stack
        elif enabled and bypass is not None:
            bypass.close()
            self._depthgrow_bypass = None
        self.depthgrow_layer.enable_adapters(enabled)

    def disable_adapter_layers(self) -> None:
        """Run the original model: the new blocks are skipped (`bypass_new_blocks`), no weights copied."""
        self._enable_adapter_layers(False)

    def enable_adapter_layers(self) -> None:
        """Run the grown model again."""
        self._enable_adapter_layers(True)

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        unknown = [n for n in names if n not in self.peft_config]
        if unknown or len(names) != 1:
            raise ValueError(f"depthgrow has exactly one adapter, {sorted(self.peft_config)}; got {adapter_name!r}")
        for _, param in new_block_parameters(self.model):
            param.requires_grad = not inference_mode
        self.depthgrow_layer.set_adapter(names)
        self.active_adapter = names[0]

    def delete_adapter(self, adapter_name: str) -> None:
        raise ValueError("a depthgrow adapter cannot be deleted while wrapped: call unload() to undo the growth")

    # ------------------------------------------------------------------ leaving peft

    def _unload_and_optionally_merge(self, merge: bool = True, progressbar: bool = False, safe_merge: bool = False, adapter_names=None):
        self._enable_adapter_layers(True)  # a bypass left open would hand back a half-restored model
        if not merge:
            self._undo_growth()
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        return self.model

    def _undo_growth(self) -> None:
        # Adapter blocks come off their hosts (with their hooks); the snapshot taken before growing puts
        # back the layer list, num_hidden_layers, per-layer config lists, layer_idx and the growth record.
        _, stack, _ = resolve_family(self.model)
        for layer in stack:
            adapter.strip(layer)
        self._depthgrow_before.restore(self.model, stack)

    # ------------------------------------------------------------------ state dict (peft's save/load hooks)

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names) -> dict[str, torch.Tensor]:
        """Every tensor under a new block, with the model's own key names (no adapter name in them)."""
        keys = _block_keys(model, state_dict)
        return {key: state_dict[key] for key in keys}

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        return key  # the blocks are ordinary modules of the model: their keys never held an adapter name

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict) -> dict[str, torch.Tensor]:
        """Checkpoint keys as the model names them; refuse a checkpoint that is not exactly this growth's blocks."""
        expected = _block_keys(model, model.state_dict())
        prefix = _PEFT_PREFIX if any(k.startswith(_PEFT_PREFIX) for k in expected) else ""
        remapped = {k if k in expected else prefix + k.removeprefix(_PEFT_PREFIX): v for k, v in state_dict.items()}
        missing, unexpected = sorted(expected - set(remapped)), sorted(set(remapped) - expected)
        if missing or unexpected:
            raise ValueError(
                f"the depthgrow checkpoint does not hold this growth's blocks: missing {missing[:4]}, unexpected "
                f"{unexpected[:4]}. Load it onto the base model it was trained from (same family and depth)."
            )
        return remapped


def _grown_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model inside a `PeftModel` (with its key prefix) or the model itself."""
    base = getattr(model, "base_model", None)
    if isinstance(base, DepthGrowModel):
        if getattr(base, "_depthgrow_bypass", None) is not None:
            raise ValueError("the new blocks are switched off (inside disable_adapter()): save or load outside that context")
        return base.model, _PEFT_PREFIX
    return model, ""


def _block_keys(model: nn.Module, state_dict: dict) -> set[str]:
    grown, prefix = _grown_model(model)
    blocks = {id(m) for m in new_block_modules(grown)}
    roots = [prefix + name + "." for name, module in grown.named_modules() if id(module) in blocks]
    return {key for key in state_dict if key.startswith(tuple(roots))} if roots else set()
