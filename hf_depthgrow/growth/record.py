"""The growth record: one typed description of what `grow_depth` inserted, and where.

It travels in `config.json` under `depth_growth` (a plain dict there, so any JSON reader and
plain transformers keep working) and is the single source of the new and old layer indices,
the insertion points, the block kinds and their eps. Every module that needs to know what was
grown reads it through `growth_record(model)`, never the raw dict.

For a model whose config nests sub-configs (CLIP, LLaVA), `tower` names the tower whose layer
stack was grown (`"vision"`, `"text"`); the indices below count that tower's layers. Flat models
have no `tower` key, as before.

Index conventions (stack indices count the layers of the *grown* model):
- a native block is a layer of its own at stack index `i` (`native_indices`);
- an adapter hangs on an original layer `host`, before it (`where="pre"`: it sees that layer's
  input) or after it (`where="post"`, used only after the last layer).
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from dataclasses import asdict, dataclass, field

RECORD_KEY = "depth_growth"
ADAPTER_NORMS = ("rms", "layer")
ADAPTER_PLACES = ("pre", "post")


class InvalidGrowthRecordError(ValueError):
    """A growth record that contradicts itself or the model it claims to describe."""


def _int(value, name: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidGrowthRecordError(f"growth record: {name} must be an integer in {span}, got {value!r}")
    return value


def _eps(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidGrowthRecordError(f"growth record: {name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter block: the original layer it hangs on and how it is built."""

    host: int = field(metadata={"help": "Stack index of the layer the block hangs on."})
    where: str = field(metadata={"help": "'pre' (sees the host's input) or 'post' (sees its output; last layer only)."})
    dim: int = field(metadata={"help": "Bottleneck width of the block."})
    norm: str = field(metadata={"help": "'rms' or 'layer'."})
    eps: float = field(metadata={"help": "The block's own normalisation eps."})
    act: str = field(metadata={"help": "Activation name (see hf_depthgrow.growth.adapter.ACTIVATIONS)."})

    @property
    def insertion_point(self) -> int:
        """Stack index whose input the block sees (one past the host for a post block)."""
        return self.host + (self.where == "post")


@dataclass(frozen=True)
class GrowthStep:
    """One call of `grow_depth`: what was asked for, with the settings that built the blocks."""

    positions: tuple[int, ...]
    num_layers_before: int
    block: str
    init: str
    eps: float | None
    seed: int
    config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GrowthRecord:
    """What was grown, in one place: layer counts, new and old indices, adapters and the growth history.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth, growth_record
        >>> grow_depth(model, [2])                    # a 4-layer model
        >>> record = growth_record(model)
        >>> record.native_indices, record.old_indices, record.lowest_changed_layer
        ((2,), (0, 1, 3, 4), 2)
        ```
    """

    base_num_layers: int
    num_layers: int
    native_indices: tuple[int, ...] = ()
    adapters: tuple[AdapterEntry, ...] = ()
    history: tuple[GrowthStep, ...] = ()
    hf_depthgrow_version: str | None = None
    tower: str | None = None

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived indices

    @property
    def old_indices(self) -> tuple[int, ...]:
        """Stack indices of the original layers, in order (`old_indices[j]` is original layer j)."""
        native = set(self.native_indices)
        return tuple(i for i in range(self.num_layers) if i not in native)

    @property
    def insertion_points(self) -> tuple[int, ...]:
        """For every new block, the stack index whose input it sees (sorted, with repeats)."""
        return tuple(sorted([*self.native_indices, *(a.insertion_point for a in self.adapters)]))

    @property
    def lowest_changed_layer(self) -> int | None:
        """The lowest stack layer that is new or hosts a new block: everything below it computes as before.

        Its input is the frozen prefix that the trainer caches and the evaluator shares.
        """
        changed = [*self.native_indices, *(a.host for a in self.adapters)]
        return min(changed) if changed else None

    @property
    def lowest_insertion_point(self) -> int | None:
        """The lowest stack index whose input a new block sees; original layers from here up sit above new blocks."""
        points = self.insertion_points
        return points[0] if points else None

    @property
    def block_kinds(self) -> tuple[str, ...]:
        """`"native"` and/or `"adapter"`, as present."""
        return tuple(k for k, present in (("native", self.native_indices), ("adapter", self.adapters)) if present)

    def num_original_below(self, index: int) -> int:
        """How many original layers sit below stack index `index` (that layer's index inside a bypass)."""
        return index - sum(1 for i in self.native_indices if i < index)

    # ------------------------------------------------------------------ checks and (de)serialisation

    def validate(self, num_layers: int | None = None) -> None:
        """Refuse a record that contradicts itself, or (with `num_layers`) the model's layer count."""
        _int(self.base_num_layers, "base_num_layers", 1)
        _int(self.num_layers, "num_layers", 1)
        for i in self.native_indices:
            _int(i, "native_indices entries", 0, self.num_layers - 1)
        if len(set(self.native_indices)) != len(self.native_indices):
            raise InvalidGrowthRecordError(f"growth record: native_indices repeat an index: {list(self.native_indices)}")
        if self.num_layers != self.base_num_layers + len(self.native_indices):
            raise InvalidGrowthRecordError(
                f"growth record: num_layers {self.num_layers} != base_num_layers {self.base_num_layers} "
                f"+ {len(self.native_indices)} native blocks"
            )
        for a in self.adapters:
            _int(a.host, "adapter host", 0, self.num_layers - 1)
            _int(a.dim, "adapter dim", 1)
            _eps(a.eps, "adapter eps")
            if a.where not in ADAPTER_PLACES or a.norm not in ADAPTER_NORMS:
                raise InvalidGrowthRecordError(f"growth record: adapter where/norm must be {ADAPTER_PLACES}/{ADAPTER_NORMS}, got {a.where!r}/{a.norm!r}")
        for step in self.history:
            if step.eps is not None:
                _eps(step.eps, "history eps")
        if self.tower is not None and (not isinstance(self.tower, str) or not self.tower.isidentifier()):
            raise InvalidGrowthRecordError(f"growth record: tower must be null or a tower name such as 'vision', got {self.tower!r}")
        if num_layers is not None and num_layers != self.num_layers:
            raise InvalidGrowthRecordError(
                f"growth record says {self.num_layers} layers but the model has {num_layers}: the record does not describe these weights"
            )

    def to_dict(self) -> dict:
        """A plain JSON-able dict, the form stored in `config.json`.

        `tower` is written only for a grown tower of a nested model, so a flat model's record is
        exactly what earlier versions wrote.
        """
        data = json.loads(json.dumps(asdict(self)))  # tuples -> lists: exactly what config.json holds
        if data.get("tower") is None:
            data.pop("tower", None)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "GrowthRecord":
        """Read a stored record (every version this package wrote), validating it.

        Records written before `num_layers` was stored get it as `base_num_layers + len(native_indices)`.
        """
        if isinstance(data, GrowthRecord):
            return data
        if not isinstance(data, dict):
            raise InvalidGrowthRecordError(f"growth record must be a dict, got {type(data).__name__}")
        data = copy.deepcopy(data)
        known = {"base_num_layers", "num_layers", "native_indices", "adapters", "history", "hf_depthgrow_version", "tower"}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"growth record: ignoring keys {unknown} (written by a newer hf_depthgrow?)", stacklevel=2)
        if "base_num_layers" not in data:
            raise InvalidGrowthRecordError("growth record: base_num_layers is missing")
        base = _int(data["base_num_layers"], "base_num_layers", 1)
        native = tuple(data.get("native_indices") or ())
        try:
            adapters = tuple(AdapterEntry(**a) for a in data.get("adapters") or ())
            history = tuple(GrowthStep(**{**s, "positions": tuple(s.get("positions") or ())}) for s in data.get("history") or ())
        except TypeError as err:
            raise InvalidGrowthRecordError(f"growth record: malformed adapter or history entry ({err})") from err
        return cls(
            base_num_layers=base,
            num_layers=data.get("num_layers", base + len(native)),
            native_indices=native,
            adapters=adapters,
            history=history,
            hf_depthgrow_version=data.get("hf_depthgrow_version"),
            tower=data.get("tower"),  # absent in records of flat models and in those written before towers
        )


def stored_record(config) -> dict | None:
    """The raw dict under `config.depth_growth` (a deep copy), or `None`."""
    record = getattr(config, RECORD_KEY, None)
    return copy.deepcopy(record) if record else None


def store_record(config, record: GrowthRecord | dict | None) -> None:
    """Write `record` into `config` (as a plain dict), or remove it with `None`."""
    if record is None:
        if hasattr(config, RECORD_KEY):
            delattr(config, RECORD_KEY)
        return
    setattr(config, RECORD_KEY, record.to_dict() if isinstance(record, GrowthRecord) else copy.deepcopy(record))


def growth_record(model) -> GrowthRecord | None:
    """The model's growth record, or `None` if it was not grown.

    The record is checked for consistency with itself; loaders also check it against the weights
    (`GrowthRecord.validate(num_layers=...)`), which inside `bypass_new_blocks` would not hold.

    Raises:
        InvalidGrowthRecordError: the stored record contradicts itself.
    """
    raw = stored_record(model.config)
    return GrowthRecord.from_dict(raw) if raw is not None else None
