"""Where the layer stack to grow lives: the model itself, or one tower of a model whose config nests others.

A CLIP or SigLIP dual encoder keeps its text and vision encoders under `config.text_config` and
`config.vision_config`; a vision-language model (LLaVA, PaliGemma, Idefics3, ...) keeps a vision
tower and a language model the same way. The top config then has no `num_hidden_layers`: each
*tower* (a sub-config and the module built from it) has its own layer stack. `resolve_target`
picks the stack: the model's own for a flat config, else the tower named by `tower=` (or by the
growth record of an already grown model), or the only tower that has a layer stack.

Everything indexed by layer then follows that tower's config: its layer count (under whatever key
the family uses: `num_hidden_layers`, `depth`, ...) and its per-layer lists. The growth record
stays in the top config (that is what `config.json` stores) and names the tower, so a save
reloads and re-grows the right stack.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from .families import FAMILIES, SUPPORTED_FAMILIES, FamilySpec, _get_submodule, _guess_layer_stack, _join, _module_path
from .record import stored_record

# Keys a config may use for its layer count, in the order they are tried.
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "depth", "n_layer", "n_layers", "encoder_layers")


@dataclass(frozen=True)
class Tower:
    """One sub-config of a nested config and the module built from it.

    Args:
        name: The sub-config's key without `_config` (`"vision"`, `"text"`, `"audio"`, ...).
        config: The sub-config object (`model.config.<name>_config`).
        module: The module built from it (`None` where none is found).
        path: That module's path in the model (`"vision_model"`, `"model.vision_tower"`, ...).
    """

    name: str
    config: object
    module: nn.Module | None
    path: str


@dataclass
class StackTarget:
    """The layer stack one growth works on, with everything that describes it.

    Args:
        spec: The family row (from the table, or inferred).
        stack: The `nn.ModuleList` of layers.
        path: The stack's full path in the model (`"model.layers"`, `"vision_model.encoder.layers"`).
        tower: The tower's name, or `None` for a flat model.
        root: The module the stack belongs to: the model, or the tower's module (runs on its own inputs).
        config: The config that describes the stack (the model's, or the tower's sub-config).
        mirrors: Other config objects that must follow `config` (a tower module holding its own copy).
        layers: The stack's path relative to `root.base_model` (a family row's `layers`).
    """

    spec: FamilySpec
    stack: nn.ModuleList
    path: str
    tower: str | None
    root: nn.Module
    config: object
    mirrors: list = field(default_factory=list)
    layers: str = ""

    @property
    def configs(self) -> list:
        """`config` and its mirrors: every config object a change of layer count is written to."""
        return [self.config, *self.mirrors]

    @property
    def count_key(self) -> str:
        """The config key holding the layer count (`num_hidden_layers` through an attribute map where aliased)."""
        return layer_count_key(self.config, len(self.stack))


def layer_count_key(config, num_layers: int | None = None) -> str:
    """The key of `config` that holds its layer count: the first of `LAYER_COUNT_KEYS` set (to `num_layers` when given).

    Example:
        ```python
        >>> layer_count_key(Qwen2VLVisionConfig(depth=4), 4)
        'depth'
        ```
    """
    present = [k for k in LAYER_COUNT_KEYS if isinstance(getattr(config, k, None), int) and not isinstance(getattr(config, k), bool)]
    matching = [k for k in present if num_layers is None or getattr(config, k) == num_layers]
    return (matching or present or ["num_hidden_layers"])[0]


def _is_config(value) -> bool:
    # transformers' PretrainedConfig, found by duck typing so this module needs no transformers import.
    return hasattr(value, "to_dict") and hasattr(value, "model_type") and hasattr(value, "sub_configs")


def find_towers(model: nn.Module) -> list[Tower]:
    """Every sub-config of `model.config` (`text_config`, `vision_config`, ...) with the module built from it.

    The module is the outermost one whose `.config` is the sub-config (or an equal copy of it).
    A flat config gives `[]`.

    Example:
        ```python
        >>> [t.name for t in find_towers(clip_model)]
        ['text', 'vision']
        ```
    """
    config = getattr(model, "config", None)
    towers = []
    for key, value in sorted(vars(config).items()) if config is not None else ():
        if not (key.endswith("_config") and _is_config(value)):
            continue
        module, path = _tower_module(model, value)
        towers.append(Tower(key[: -len("_config")], value, module, path))
    return towers


def _tower_module(model: nn.Module, sub) -> tuple[nn.Module | None, str]:
    named = [(n, m) for n, m in model.named_modules() if n]
    for name, module in named:
        if getattr(module, "config", None) is sub:
            return module, name
    # A tower built with a deep copy of its sub-config: the outermost module whose config equals it.
    wanted = sub.to_dict()
    for name, module in named:
        own = getattr(module, "config", None)
        if own is not None and type(own) is type(sub) and own.to_dict() == wanted:
            return module, name
    return None, ""


def _record_tower(model: nn.Module) -> str | None:
    raw = stored_record(model.config)
    return raw.get("tower") if isinstance(raw, dict) else None


def _stack_in(root: nn.Module, config) -> tuple[nn.Module, str, nn.ModuleList, FamilySpec | None] | None:
    """`(base, path, stack, spec)` of the table row for `config.model_type`, or the stack found by shape (spec None)."""
    base = getattr(root, "base_model", root)
    spec = FAMILIES.get(getattr(config, "model_type", None))
    if spec is not None:
        stack = _get_submodule(base, spec.layers)
        if isinstance(stack, nn.ModuleList):
            return base, spec.layers, stack, spec
        raise ValueError(
            f"model_type {spec.model_type!r} is listed but `{spec.layers}` is not a layer list on {type(base).__name__}; "
            "this transformers version may lay it out differently."
        )
    count = getattr(config, layer_count_key(config), None)
    found = _guess_layer_stack(base, count)
    if found is None:
        return None
    return base, found[0], found[1], None


def _pick_tower(model: nn.Module, towers: list[Tower], tower: str | None) -> Tower:
    names = [t.name for t in towers]
    if tower is not None:
        if not isinstance(tower, str) or tower not in names:
            raise ValueError(f"tower={tower!r} is not a tower of {type(model).__name__}; its towers are {names}.")
        chosen = next(t for t in towers if t.name == tower)
        if chosen.module is None or _stack_in(chosen.module, chosen.config) is None:
            raise ValueError(f"tower {tower!r} of {type(model).__name__} has no layer stack to grow; its towers are {names}.")
        return chosen
    growable = [t for t in towers if t.module is not None and _stack_in(t.module, t.config) is not None]
    if len(growable) == 1:
        return growable[0]
    if not growable:
        raise ValueError(f"Cannot find a layer stack in any tower of {type(model).__name__} (towers {names}).")
    raise ValueError(
        f"{type(model).__name__} has several towers with a layer stack: {[t.name for t in growable]}. "
        f"Pass tower= to say which one to grow (e.g. tower={growable[0].name!r})."
    )


def resolve_target(model: nn.Module, tower: str | None = None) -> StackTarget:
    """The layer stack to grow, its family row and the config(s) that describe it.

    `tower=None` takes the tower named by the model's growth record, or, for an ungrown model
    with a nested config, the only tower that has a layer stack. A model whose own config has no
    sub-config is flat: `tower` must then be `None`.

    Raises:
        ValueError: no layer stack; an unknown tower; several towers and none named (the
            message lists them); a tower other than the one the model was already grown in.

    Example:
        ```python
        >>> target = resolve_target(clip_model, tower="vision")
        >>> target.path, target.count_key
        ('vision_model.encoder.layers', 'num_hidden_layers')
        ```
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `.config`: hf_depthgrow grows Hugging Face `PreTrainedModel`s.")
    grown_in = _record_tower(model)
    if tower is not None and grown_in is not None and tower != grown_in:
        raise ValueError(
            f"the model was grown in its {grown_in!r} tower; growing a second tower ({tower!r}) is not supported."
        )
    tower = tower if tower is not None else grown_in
    towers = find_towers(model)
    flat = not towers or (tower is None and _stack_in(model, config) is not None and hasattr(config, layer_count_key(config)))
    if flat and tower is None:
        return _target(model, model, config, "", None)
    if not towers:
        raise ValueError(f"tower={tower!r}: {type(model).__name__} has no towers (its config nests no sub-configs); drop tower=.")
    chosen = _pick_tower(model, towers, tower)
    mirrors = [c for c in [getattr(chosen.module, "config", None)] if c is not None and c is not chosen.config]
    return _target(model, chosen.module, chosen.config, chosen.path, chosen.name, mirrors)


def resolve_family(model: nn.Module, tower: str | None = None) -> tuple[FamilySpec, nn.ModuleList, str]:
    """Find the family row, the layer stack and its full path for a model.

    A family the table does not name gets a row inferred from its layers
    (`hf_depthgrow.growth.inference`): native blocks where they are exact, else adapter blocks
    only, with a warning that says why. A model whose config nests sub-configs (CLIP, LLaVA)
    grows one tower: `tower=` names it, else the growth record does, else the only tower with a
    layer stack (`hf_depthgrow.growth.towers`). A model without a findable stack raises a
    `ValueError` naming the supported families.

    Example:
        ```python
        >>> spec, stack, path = resolve_family(tiny_model("llama"))
        >>> spec.model_type, len(stack), path
        ('llama', 4, 'model.layers')
        ```
    """
    target = resolve_target(model, tower)
    return target.spec, target.stack, target.path


def _target(model, root, config, root_path, tower, mirrors=()) -> StackTarget:
    found = _stack_in(root, config)
    model_type = getattr(config, "model_type", None)
    if found is None:
        raise ValueError(
            f"Cannot find a layer stack in {type(model).__name__} (model_type {model_type!r}). "
            f"Supported families: {', '.join(SUPPORTED_FAMILIES)}."
        )
    base, rel, stack, spec = found
    path = _join(root_path, _join(_module_path(root, base), rel))
    target = StackTarget(spec, stack, path, tower, root, config, list(mirrors), rel)
    if spec is None:
        from .inference import infer_spec  # imported here: inference builds and runs blocks, which import this module

        target.spec = infer_spec(model, target)
        if target.spec.fallback_reason:
            warnings.warn(
                f"model_type {model_type!r} is not in hf_depthgrow's family table; using the layer stack `{path}` found by "
                f"shape. Only adapter blocks are available for it: {target.spec.fallback_reason}.",
                stacklevel=5,
            )
    return target
