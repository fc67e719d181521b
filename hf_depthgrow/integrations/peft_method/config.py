"""`DepthGrowConfig`: depth growth as a peft `PeftConfig`, saved as `adapter_config.json`.

Every field but `positions` is a field of `hf_depthgrow.GrowthConfig` and takes its help text
from there (written once); validation is `GrowthConfig`'s own, so the PEFT method and
`grow_depth` refuse exactly the same values with the same messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from peft.config import PeftConfig

from ...growth.config import GrowthConfig
from ...growth.placement import load_plan, resolve_positions
from .registry import peft_type

_PRESET = re.compile(r"^\s*(interleave|top)\s*:\s*\d+\s*$")
_DRY_RUN_LAYERS = 1 << 20  # a depth no model reaches: checks a plan's syntax before the model is known


def _help(name: str) -> dict:
    return {"help": GrowthConfig.__dataclass_fields__[name].metadata["help"]}


@dataclass
class DepthGrowConfig(PeftConfig):
    """Configuration of the `depthgrow` PEFT method: insert zero-initialised residual blocks.

    `get_peft_model(model, DepthGrowConfig(...))` grows the model in place with
    `hf_depthgrow.grow_depth`, so the grown model computes exactly what the original did; only the
    new blocks train, and `save_pretrained` writes only them.

    Args:
        positions (`list[int]`, `str` or `list[dict]`):
            Where the blocks go, as for `grow_depth`: insertion points `0 <= k <= L` (the block sees
            the residual stream entering original layer k), `"interleave:N"`, `"top:N"`, or a plan
            `[{"at": k, "copy_from": j}, ...]`. A plan file (`.yaml`/`.json`) is read here and stored
            inline, so `adapter_config.json` alone says what was grown. `"probe:N"` needs a probe
            result: resolve it first (`hf_depthgrow.growth.resolve_positions`) and pass the positions.
        block (`str`, defaults to `"auto"`): `"native"`, `"adapter"` or `"auto"` (native where exact).
        init (`str`, defaults to `"copy"`): `"copy"` (LLaMA Pro) or `"random"`, for native blocks.
        eps (`float`, *optional*): Epsilon of an adapter block's norm; `None` takes the model's.
        seed (`int`, defaults to 0): Seeds every random part of a block.
        adapter_dim (`int`, *optional*): Adapter width; `None` takes the hidden size.
        adapter_act (`str`, defaults to `"gelu"`): Adapter activation.
        verify (`bool`, defaults to `True`): Check exactness on a tiny input after growing.

    Raises:
        ValueError: a field out of range, naming the field (the model is not touched).

    Example:
        ```python
        >>> from peft import get_peft_model
        >>> from hf_depthgrow.integrations.peft_method import DepthGrowConfig
        >>> peft_model = get_peft_model(model, DepthGrowConfig(positions=[2], block="native", init="copy"))
        >>> peft_model.print_trainable_parameters()
        ```
    """

    positions: list | str | dict | None = field(
        default=None,
        metadata={
            "help": "Insertion points 0 <= k <= L (a list of ints), 'interleave:N', 'top:N', or a plan "
            "[{'at': k, 'copy_from': j}, ...] (a plan file is read and stored inline)."
        },
    )
    block: str = field(default="auto", metadata=_help("block"))
    init: str = field(default="copy", metadata=_help("init"))
    eps: float | None = field(default=None, metadata=_help("eps"))
    seed: int = field(default=0, metadata=_help("seed"))
    adapter_dim: int | None = field(default=None, metadata=_help("adapter_dim"))
    adapter_act: str = field(default="gelu", metadata=_help("adapter_act"))
    verify: bool = field(default=True, metadata=_help("verify"))

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = peft_type()
        self.growth_config()  # GrowthConfig validates every shared field and names the bad one
        self.positions = _checked_positions(self.positions)

    def growth_config(self) -> GrowthConfig:
        """The `GrowthConfig` that `grow_depth` builds the blocks with.

        Example:
            ```python
            >>> DepthGrowConfig(positions=[2], block="adapter").growth_config().block
            'adapter'
            ```
        """
        # Only the fields declared here: a GrowthConfig field this config does not expose keeps its default.
        own = {f.name for f in fields(DepthGrowConfig)} & {f.name for f in fields(GrowthConfig)}
        return GrowthConfig(**{name: getattr(self, name) for name in sorted(own)})


def _checked_positions(spec):
    """The placement in JSON form (lists, not tuples; a plan file read inline), or one ValueError."""
    if spec is None:
        raise ValueError("positions is required: insertion points (e.g. [2]), 'interleave:N', 'top:N' or a plan")
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.strip().lower().endswith((".yaml", ".yml", ".json"))):
        spec = load_plan(spec)  # stored inline: a saved adapter must not depend on a file beside the script
    if isinstance(spec, str):
        if spec.strip().lower().startswith("probe"):
            raise ValueError(
                f"positions={spec!r} ranks a probe result, which a saved adapter cannot replay: resolve it first, e.g. "
                "positions=[e.at for e in resolve_positions('probe:2', L, probe_result=probe(model, data))]"
            )
        if not _PRESET.match(spec):
            raise ValueError(f"positions must be a list of ints, 'interleave:N', 'top:N' or a plan, got {spec!r}")
        return spec.strip()
    if isinstance(spec, tuple):
        spec = list(spec)
    if isinstance(spec, list) and spec and all(isinstance(k, int) and not isinstance(k, bool) for k in spec):
        negative = [k for k in spec if k < 0]
        if negative:
            raise ValueError(f"positions must be >= 0 (insertion points 0..L), got {negative[0]}")
        return spec
    if not isinstance(spec, (list, dict)) or not spec:
        raise ValueError(f"positions must be a non-empty list of ints, 'interleave:N', 'top:N' or a plan, got {spec!r}")
    try:  # a plan or mergekit config: its syntax is checked now, its range against the model when growing
        resolve_positions(spec, _DRY_RUN_LAYERS)
    except ValueError as err:
        raise ValueError(f"positions: {err}") from None
    return spec
