"""`GrowthConfig`: how `grow_depth` builds each new block, checked when it is made.

The field metadata carries the help text: the CLI parses this dataclass directly (`hf-depthgrow
grow --block ... --eps ...`), so each option's help is written once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..utils import is_int
from .adapter import ACTIVATIONS

BLOCK_KINDS = ("auto", "native", "adapter")
INITS = ("copy", "random")


@dataclass
class GrowthConfig:
    """How `grow_depth` builds each new block.

    Args:
        block: `"native"` (the family's own layer, residual outputs zeroed; exact for pre-norm
            families), `"adapter"` (a generic normalized residual block, exact for every family),
            or `"auto"` (native where that is exact, adapter otherwise).
        init: For native blocks, `"copy"` the layer below the insertion point (layer 0 for k = 0),
            as LLaMA Pro does, or `"random"` with the family's own initializer. Adapter blocks
            always draw `W_in` at random and zero `W_out`.
        eps: Epsilon of the new block's own norm; `None` takes the model's. Must be > 0.
        seed: Seeds every random part. The block for position k depends only on (seed, k, and
            how many blocks were already asked for at k), so `probe` and `grow_depth` build the
            same block.
        adapter_dim: Hidden width of an adapter block; `None` takes the model's hidden size.
        adapter_act: Activation of an adapter block (`gelu`, `silu`, `relu`, `tanh`).
        verify: After growing, run the model once on a tiny input with and without the new blocks
            and roll the growth back if the outputs differ (see `hf_depthgrow.growth.verify`).
            `False` skips the two forward passes, for models too large to run twice.
        tower: For a model whose config nests sub-configs (CLIP/SigLIP dual encoders, vision-language
            models), which tower's layer stack to grow: the sub-config's key without `_config`
            (`"vision"`, `"text"`). `None` takes the only tower that has a layer stack (an error
            lists the towers when there are several) or, for a grown model, the tower its growth
            record names. Must be `None` for a model with a flat config.

    Raises:
        ValueError: a field is out of range; the message names the field and the value.

    Example:
        ```python
        >>> GrowthConfig(block="adapter", eps=1e-5).block
        'adapter'
        >>> GrowthConfig(tower="vision").tower          # grow a CLIP model's vision encoder
        'vision'
        ```
    """

    block: str = field(default="auto", metadata={"help": "native, adapter or auto (native where exact)."})
    init: str = field(default="copy", metadata={"help": "copy (LLaMA Pro) or random, for native blocks."})
    eps: float | None = field(default=None, metadata={"help": "Epsilon of the new block's norm; None: the model's."})
    seed: int = field(default=0, metadata={"help": "Seed for every random part of a new block.", "flag": "--growth-seed", "deprecated": ["--seed"]})
    adapter_dim: int | None = field(default=None, metadata={"help": "Adapter hidden width; None: hidden size."})
    adapter_act: str = field(default="gelu", metadata={"help": "Adapter activation: gelu, silu, relu or tanh."})
    verify: bool = field(
        default=True,
        metadata={"help": "Check the grown model against the original on a tiny input and roll back if it differs; "
                  "False skips the check (huge models)."},
    )

    tower: str | None = field(
        default=None,
        metadata={"help": "Nested models (CLIP, SigLIP, LLaVA, ...): the tower to grow, e.g. vision or text; "
                  "None: the only tower with a layer stack."},
    )

    def __post_init__(self):
        # Strings are checked for type first: `in` on a tuple would accept an equal non-str, and
        # a bool is an int to Python, so bool-as-number is refused explicitly everywhere.
        for name, allowed in (("block", BLOCK_KINDS), ("init", INITS), ("adapter_act", sorted(ACTIVATIONS))):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps):
                raise ValueError(f"eps must be a finite positive number or None, got {self.eps!r}")
            if not self.eps > 0:
                raise ValueError(
                    f"eps must be > 0, got {self.eps}: a norm without epsilon is singular at z = 0 (docs/theory.md §6)."
                )
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.adapter_dim is not None and not (is_int(self.adapter_dim) and self.adapter_dim >= 1):
            raise ValueError(f"adapter_dim must be a positive int or None, got {self.adapter_dim!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        # Which towers exist depends on the model, so the name is checked against it in `grow_depth`;
        # here only its form: a sub-config key without `_config` is a plain identifier.
        if self.tower is not None and (not isinstance(self.tower, str) or not self.tower.isidentifier()):
            raise ValueError(f"tower must be None or a tower name such as 'vision' or 'text', got {self.tower!r}")
