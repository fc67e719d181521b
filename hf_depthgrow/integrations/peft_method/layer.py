"""`DepthGrowLayer`: the peft tuner layer that stands for the grown blocks.

peft's other methods wrap each targeted module in a tuner layer. Depth growth wraps nothing: its
blocks are whole layers in the layer list (native) or blocks hosted on an original layer
(adapter), placed by `hf_depthgrow.grow_depth` so that the grown model stays an ordinary
transformers model. Wrapping them would change every parameter name and stop `merge_and_unload`
from returning a plain checkpoint. peft still needs one tuner layer to report on
(`get_model_status`, which `PeftModel.disable_adapter` calls), so the tuner holds this one: it
records which adapter is active and whether the blocks are switched off, and holds no weights.
"""

from __future__ import annotations

from torch import nn

from peft.tuners.tuners_utils import BaseTunerLayer


class DepthGrowLayer(nn.Module, BaseTunerLayer):
    """Status of one depth growth: the adapter's name, its positions, and whether it is switched off.

    The blocks themselves live in the model; `DepthGrowModel` switches them on and off with
    `hf_depthgrow.bypass_new_blocks` and keeps this layer's flags in step.

    Example:
        ```python
        >>> layer = peft_model.base_model.depthgrow_layer
        >>> layer.active_adapters, layer.disable_adapters
        (['default'], False)
        ```
    """

    # No per-adapter sub-modules: peft's own requires_grad bookkeeping has nothing to walk here.
    adapter_layer_names: tuple[str, ...] = ()
    other_param_names: tuple[str, ...] = ("depthgrow_positions",)

    def __init__(self, adapter_name: str, positions) -> None:
        super().__init__()
        self.depthgrow_positions = {adapter_name: positions}
        self._active_adapter = adapter_name
        self._disable_adapters = False
        self.merged_adapters = []

    def _get_available_adapters(self) -> set[str]:
        return set(self.depthgrow_positions)

    def enable_adapters(self, enabled: bool) -> None:
        """Record the switch; the tuner does the switching (it owns the model)."""
        self._disable_adapters = not enabled

    def set_adapter(self, adapter_names, inference_mode: bool = False) -> None:
        self._active_adapter = adapter_names

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        # The blocks already are layers of the model: there is nothing to fold into another weight.
        return None

    def unmerge(self) -> None:
        return None

    def forward(self, *args, **kwargs):
        raise RuntimeError("DepthGrowLayer holds no computation; the grown model runs the new blocks itself")

    def extra_repr(self) -> str:
        return f"positions={self.depthgrow_positions}, disabled={self._disable_adapters}"
