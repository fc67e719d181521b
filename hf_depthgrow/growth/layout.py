"""The layer list and everything indexed by layer: what a native insertion or a bypass rewrites.

A native block takes a real slot in the layer list, so three things follow the list: the
modules' `layer_idx` (KV-cache slots), `config.num_hidden_layers`, and every config list with
one entry per layer (`layer_types` for sliding/full attention). `_Snapshot` records all of them
(and the growth record) so that a failed growth or the end of a bypass restores them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _renumber(layers: list[nn.Module]) -> None:
    # Adapter blocks have no KV-cache slot of their own; every other `layer_idx` follows the list.
    for i, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(module, adapter.NormalizedResidualBlock):
                continue
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = i


def _use_layers(model: nn.Module, stack: nn.ModuleList, layers: list[nn.Module], per_layer: dict[str, list], origin: list[int]) -> None:
    """Make `layers` the stack; layer i takes the per-layer config entries of old layer `origin[i]`."""
    _set_layers(stack, layers)
    model.config.num_hidden_layers = len(layers)
    for key, values in per_layer.items():
        setattr(model.config, key, [values[j] for j in origin])
    _renumber(layers)


@dataclass
class _Snapshot:
    """What a growth or a bypass changes, to restore it exactly."""

    layers: list[nn.Module]
    num_layers: int
    per_layer: dict[str, list]
    layer_idx: list[tuple[nn.Module, int]]
    record: dict | None

    @classmethod
    def take(cls, model, stack) -> "_Snapshot":
        config = model.config
        keys = _per_layer_keys(config, len(stack))
        idx = [(m, m.layer_idx) for layer in stack for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        record = stored_record(config)
        return cls(list(stack), config.num_hidden_layers, {k: list(getattr(config, k)) for k in keys}, idx, record)

    def restore(self, model, stack) -> None:
        _set_layers(stack, self.layers)
        model.config.num_hidden_layers = self.num_layers
        for key, value in self.per_layer.items():
            setattr(model.config, key, value)
        for module, idx in self.layer_idx:
            module.layer_idx = idx
        store_record(model.config, self.record)


def _insert_native(model, stack, new_blocks, snapshot: _Snapshot) -> None:
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
    _use_layers(model, stack, layers, snapshot.per_layer, origin)
