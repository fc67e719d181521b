"""The layer list and everything indexed by layer: what a native insertion or a bypass rewrites.

A native block takes a real slot in the layer list, so three things follow the list: the
modules' `layer_idx` (KV-cache slots), `config.num_hidden_layers`, and every config list with
one entry per layer (`layer_types` for sliding/full attention). `Snapshot` records all of them
(and the growth record) so that a failed growth or the end of a bypass restores them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from . import adapter
from .record import store_record, stored_record

# Config lists of the layer count's length that are not one-entry-per-layer.
_NOT_PER_LAYER = {"architectures", "stage_names", "out_features", "out_indices", "bad_words_ids", "suppress_tokens"}


def _per_layer_keys(config, num_layers: int) -> list[str]:
    # A list as long as the stack is taken as per-layer (one layer: too ambiguous to tell),
    # except for known keys that only happen to have that length; `layer_types` always is.
    return [
        key
        for key, value in config.to_dict().items()
        if key not in _NOT_PER_LAYER and isinstance(value, (list, tuple)) and len(value) == num_layers and num_layers > 1
        or (key == "layer_types" and isinstance(value, (list, tuple)))
    ]


def _set_layers(stack: nn.ModuleList, layers: list[nn.Module]) -> None:
    # In place, so every reference to the stack (the model's own loop) sees the new layers.
    stack._modules.clear()
    for i, layer in enumerate(layers):
        stack._modules[str(i)] = layer


def _renumber(layers: list[nn.Module], attrs: tuple[str, ...] = ("layer_idx",)) -> None:
    # Adapter blocks have no KV-cache slot of their own; every other `layer_idx` follows the list
    # (and any other index attribute the family keeps its cache slot in: GPT-Neo's `layer_id`).
    for i, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(module, adapter.NormalizedResidualBlock):
                continue
            for attr in attrs:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, i)


def _use_layers(
    model: nn.Module, stack: nn.ModuleList, layers: list[nn.Module], per_layer: dict[str, list], origin: list[int],
    configs: list | None = None, count_key: str = "num_hidden_layers", index_attrs: tuple[str, ...] = ("layer_idx",),
) -> None:
    """Make `layers` the stack; layer i takes the per-layer config entries of old layer `origin[i]`.

    `configs` are the config objects that describe the stack (default: `model.config`; a tower's
    sub-config for a nested model), `count_key` the key of their layer count, `index_attrs` the
    module attributes that hold a layer's index (`FamilySpec.index_attrs`).
    """
    _set_layers(stack, layers)
    for config in configs if configs is not None else [model.config]:
        setattr(config, count_key, len(layers))
        for key, values in per_layer.items():
            setattr(config, key, [values[j] for j in origin])
    _renumber(layers, index_attrs)


@dataclass
class Snapshot:
    """What a growth or a bypass changes, to restore it exactly."""

    layers: list[nn.Module]
    num_layers: int
    per_layer: dict[str, list]
    layer_idx: list[tuple[nn.Module, str, int]]
    record: dict | None
    configs: list = field(default_factory=list)
    count_key: str = "num_hidden_layers"
    index_attrs: tuple[str, ...] = ("layer_idx",)

    @classmethod
    def take(cls, model, stack, target=None) -> "Snapshot":
        """Snapshot `stack`; `target` (a `towers.StackTarget`) names the config(s) that describe it (default: `model.config`)."""
        configs = target.configs if target is not None else [model.config]
        count_key = target.count_key if target is not None else "num_hidden_layers"
        config = configs[0]
        keys = _per_layer_keys(config, len(stack))
        attrs = tuple(target.spec.index_attrs) if target is not None and target.spec is not None else ("layer_idx",)
        idx = [
            (m, a, getattr(m, a)) for layer in stack for m in layer.modules() for a in attrs
            if isinstance(getattr(m, a, None), int) and not isinstance(getattr(m, a), bool)
        ]
        record = stored_record(model.config)  # the record lives in the top config, the one config.json stores
        per_layer = {k: list(getattr(config, k)) for k in keys}
        return cls(list(stack), getattr(config, count_key), per_layer, idx, record, list(configs), count_key, attrs)

    def use(self, model, stack, layers: list[nn.Module], origin: list[int]) -> None:
        """`_use_layers` on the snapshot's configs: `layers` become the stack, layer i taking old layer `origin[i]`'s entries."""
        _use_layers(model, stack, layers, self.per_layer, origin, self.configs or None, self.count_key, self.index_attrs)

    def restore(self, model, stack) -> None:
        _set_layers(stack, self.layers)
        for config in self.configs or [model.config]:
            setattr(config, self.count_key, self.num_layers)
            for key, value in self.per_layer.items():
                setattr(config, key, list(value))
        for module, attr, idx in self.layer_idx:
            setattr(module, attr, idx)
        store_record(model.config, self.record)


def _insert_native(model, stack, new_blocks, snapshot: Snapshot) -> None:
    """Insert `(k, block)` pairs (sorted by k) into the stack the snapshot was taken of."""
    old = snapshot.layers
    source_of = lambda k: max(k - 1, 0)  # noqa: E731 -- the copy source, and so the config entries
    layers, origin = [], []  # origin[i]: index of the old layer whose per-layer config entries layer i takes
    for i in range(len(old) + 1):
        for k, block in new_blocks:
            if k == i:
                layers.append(block)
                origin.append(source_of(k))
        if i < len(old):
            layers.append(old[i])
            origin.append(i)
    snapshot.use(model, stack, layers, origin)
