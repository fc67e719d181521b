"""The growth engine: insert zero-initialised residual blocks so the grown model computes exactly
what the original did (THEORY §1).

Two kinds of block:
- native: the family's own layer, copied from its neighbour (LLaMA Pro) or freshly initialised,
  with its residual output projections zeroed. It takes a real slot in the layer list, so the
  grown model is an ordinary checkpoint of the same architecture that plain transformers loads.
- adapter: a generic normalized residual block hung on an original layer (see `blocks.py`),
  exact for every family, post-norm ones included.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

from . import adapter as _blocks
from ..utils import package_version
from .record import AdapterEntry, GrowthRecord, GrowthStep, growth_record, store_record, stored_record
from .families import FamilySpec, model_eps, resolve_family, residual_output_modules

BLOCK_KINDS = ("auto", "native", "adapter")
INITS = ("copy", "random")
# Config lists of the layer count's length that are not one-entry-per-layer.
_NOT_PER_LAYER = {"architectures", "stage_names", "out_features", "out_indices", "bad_words_ids", "suppress_tokens"}


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

    Example:
        ```python
        >>> GrowthConfig(block="adapter", eps=1e-5).block
        'adapter'
        ```
    """

    block: str = field(default="auto", metadata={"help": "native, adapter or auto (native where exact)."})
    init: str = field(default="copy", metadata={"help": "copy (LLaMA Pro) or random, for native blocks."})
    eps: float | None = field(default=None, metadata={"help": "Epsilon of the new block's norm; None: the model's."})
    seed: int = field(default=0, metadata={"help": "Seed for every random part of a new block."})
    adapter_dim: int | None = field(default=None, metadata={"help": "Adapter hidden width; None: hidden size."})
    adapter_act: str = field(default="gelu", metadata={"help": "Adapter activation: gelu, silu, relu or tanh."})

    def __post_init__(self):
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
                raise ValueError(f"eps must be a positive number or None, got {self.eps!r}")
            if not self.eps > 0:
                raise ValueError(
                    f"eps must be > 0, got {self.eps}: a norm without epsilon is singular at z = 0 (THEORY §6)."
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.adapter_dim is not None and (not isinstance(self.adapter_dim, int) or self.adapter_dim < 1):
            raise ValueError(f"adapter_dim must be a positive int or None, got {self.adapter_dim!r}")
        if self.adapter_act not in _blocks.ACTIVATIONS:
            raise ValueError(f"adapter_act must be one of {sorted(_blocks.ACTIVATIONS)}, got {self.adapter_act!r}")


# --------------------------------------------------------------------------- checks


def is_quantized(model: nn.Module) -> bool:
    """True where transformers flags the model as quantised (GGUF, bitsandbytes, ...)."""
    config = getattr(model, "config", None)
    return bool(
        getattr(model, "is_quantized", False)
        or getattr(model, "hf_quantizer", None) is not None
        or (config is not None and getattr(config, "quantization_config", None))
    )


def check_positions(positions, num_layers: int) -> list[int]:
    """The positions sorted, after checking each is an int in 0..num_layers; a `ValueError` names the bad one."""
    if isinstance(positions, (int, str, bytes)) or not isinstance(positions, Iterable):
        raise ValueError(f"positions must be a list of ints, got {positions!r}")
    positions = list(positions)
    if not positions:
        raise ValueError("positions is empty: give at least one insertion point k (0 <= k <= number of layers).")
    for k in positions:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"positions must be ints, got {k!r} ({type(k).__name__})")
        if not 0 <= k <= num_layers:
            raise ValueError(f"position {k} is out of range: the model has {num_layers} layers, so 0 <= k <= {num_layers}.")
    return sorted(positions)


def resolve_block_kind(cfg: GrowthConfig, spec: FamilySpec, config) -> str:
    """`"native"` or `"adapter"` for `cfg.block` on this family (`auto`: native where that is exact)."""
    native_ok = spec.kind != "unknown" and spec.native_is_exact(config)
    if cfg.block == "auto":
        return "native" if native_ok else "adapter"
    if cfg.block == "native" and not native_ok:
        if spec.kind == "unknown":
            raise ValueError(f"model_type {spec.model_type!r} is not in the family table: only block='adapter' is available.")
        reason = (
            "it is post-norm (LN(z + 0) != z)"
            if spec.norm_style != "pre"
            else f"its config sets {[f for f in spec.inexact_if if getattr(config, f, False)]}, which ties the maths to layer indices"
        )
        raise ValueError(f"native blocks are not function-preserving for {spec.model_type}: {reason}. Use block='adapter' or 'auto'.")
    return cfg.block


# --------------------------------------------------------------------------- building blocks


def _block_seed(seed: int, position: int, repeat: int) -> int:
    # Depends on the position, not on the other positions of the same call, so a block grown
    # alone at k equals the one grown at k together with others (and the probe's candidate).
    return (seed * 1_000_003 + position * 10_007 + repeat) % (2**63 - 1)


def _hidden_size(model: nn.Module, layer: nn.Module) -> int:
    config = model.config
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    for module in layer.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
            return module.normalized_shape[-1]
    raise ValueError(f"Cannot tell the hidden size of {type(model).__name__}.")


def _param_like(layer: nn.Module) -> torch.Tensor:
    return next(p for p in layer.parameters() if p.is_floating_point())


def _construct_layer(layer_cls: type, config, index: int) -> nn.Module:
    params = inspect.signature(layer_cls.__init__).parameters
    if "layer_idx" in params:
        return layer_cls(config, layer_idx=index)
    if len(params) >= 3 and list(params)[2] not in ("args", "kwargs"):
        return layer_cls(config, index)
    return layer_cls(config)


def build_native_block(model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig, repeat: int = 0) -> nn.Module:
    """The family's own layer for insertion at `position`, residual outputs zeroed."""
    source = stack[max(position - 1, 0)]
    if cfg.init == "copy":
        block = copy.deepcopy(source)
        _blocks.strip(block)  # a copied host layer must not carry the host's adapters
    else:
        like = _param_like(source)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(cfg.seed, position, repeat))
            block = _construct_layer(type(source), model.config, max(position - 1, 0))
            init_fn = getattr(model, "_init_weights", None)
            if init_fn is not None:
                block.apply(init_fn)
        block.to(dtype=like.dtype, device=like.device)
        # Copy the attention-type attributes the family set from the config (sliding windows).
        for attr in ("attention_type", "is_sliding", "sliding_window"):
            if hasattr(source, attr):
                setattr(block, attr, getattr(source, attr))
    with torch.no_grad():
        for module in residual_output_modules(spec, block):
            for param in module.parameters(recurse=False):
                param.zero_()
    return block


def build_adapter_block(model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig, repeat: int = 0) -> _blocks.NormalizedResidualBlock:
    """A normalized residual block for `position`, `W_out = 0`, `W_in` drawn from the seed."""
    host = stack[min(position, len(stack) - 1)]
    like = _param_like(host)
    hidden = _hidden_size(model, host)
    eps = cfg.eps if cfg.eps is not None else (model_eps(spec, model.config) or 1e-6)
    generator = torch.Generator().manual_seed(_block_seed(cfg.seed, position, repeat))
    block = _blocks.NormalizedResidualBlock(
        hidden, cfg.adapter_dim or hidden, norm=spec.norm, eps=eps, act=cfg.adapter_act, generator=generator
    )
    return block.to(dtype=like.dtype, device=like.device)


def build_block(model: nn.Module, position: int, config: GrowthConfig | None = None, *, repeat: int = 0, **kwargs) -> tuple[str, nn.Module]:
    """Build, without inserting, the block `grow_depth(model, [position], ...)` would insert.

    Returns `(kind, module)`; the probe uses it to reason about exactly that block.
    """
    cfg = config or GrowthConfig(**kwargs)
    spec, stack, _ = resolve_family(model)
    check_positions([position], len(stack))
    kind = resolve_block_kind(cfg, spec, model.config)
    builder = build_native_block if kind == "native" else build_adapter_block
    return kind, builder(model, stack, spec, position, cfg, repeat)


# --------------------------------------------------------------------------- layout surgery


def _per_layer_keys(config, num_layers: int) -> list[str]:
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
    for i, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(module, _blocks.NormalizedResidualBlock):
                continue
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = i


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


# --------------------------------------------------------------------------- public API


def grow_depth(model: nn.Module, positions: Iterable[int], *, config: GrowthConfig | None = None, **kwargs) -> nn.Module:
    """Insert one zero-initialised residual block at each position; the model stays function-identical.

    Position k counts the model's current layers: the new block sits between layers k-1 and k,
    so the block sees the residual stream entering layer k (k = 0: after the embeddings; k = L:
    after the last layer, before the final norm). A repeated position inserts several blocks there.
    Works in place and returns the same model, like peft's `inject_adapter_in_model`. Nothing is
    changed when an argument is rejected.

    Args:
        model: A transformers `PreTrainedModel` of a family in `hf_depthgrow.SUPPORTED_FAMILIES`
            (others: adapter blocks, where the layer stack can be found).
        positions: Insertion points, each an int with 0 <= k <= L.
        config: A `GrowthConfig`; or pass its fields as keyword arguments (`block`, `init`,
            `eps`, `seed`, `adapter_dim`, `adapter_act`).

    Example:
        ```python
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_depthgrow import grow_depth
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        ...                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100))
        >>> grow_depth(model, [2], block="native", init="copy").config.num_hidden_layers
        5
        ```
    """
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    cfg = config or GrowthConfig(**kwargs)
    if is_quantized(model):
        raise ValueError(
            "the model is flagged as quantised (e.g. loaded with gguf_file= or a quantization_config) and cannot be "
            "grown or trained: make a float copy first (see hf_depthgrow.data.embedded for the GGUF case)."
        )
    spec, stack, _ = resolve_family(model)
    config_ = model.config
    if getattr(config_, "is_heterogeneous", False):
        raise ValueError("heterogeneous per-layer configs are not supported by grow_depth yet.")
    num_layers = len(stack)
    if config_.num_hidden_layers != num_layers:
        raise ValueError(f"config.num_hidden_layers={config_.num_hidden_layers} but the layer stack has {num_layers} layers.")
    sorted_positions = check_positions(positions, num_layers)
    kind = resolve_block_kind(cfg, spec, config_)
    own_eps = model_eps(spec, config_)
    if kind == "native" and cfg.eps is not None and own_eps is not None and cfg.eps != own_eps:
        raise ValueError(
            f"native blocks use the family's norms with the config's eps ({own_eps}); a different eps ({cfg.eps}) would "
            "not survive save/load. Use block='adapter' for a block with its own eps."
        )
    check_eps = cfg.eps if cfg.eps is not None else own_eps
    if check_eps is not None:
        from .norms import check_norm_eps

        check_norm_eps(check_eps, _param_like(stack[0]).dtype)

    # Build every block before touching the model: a failure here leaves it as it was.
    repeats: dict[int, int] = {}
    new_blocks = []
    builder = build_native_block if kind == "native" else build_adapter_block
    for k in sorted_positions:
        r = repeats.get(k, 0)
        repeats[k] = r + 1
        new_blocks.append((k, builder(model, stack, spec, k, cfg, r)))

    snapshot = _Snapshot.take(model, stack)
    try:
        if kind == "native":
            _insert_native(model, stack, new_blocks, snapshot)
        else:
            old = list(stack)
            for k, block in new_blocks:
                _blocks.attach(old[k] if k < num_layers else old[-1], block, "pre" if k < num_layers else "post")
        _update_record(model, stack, snapshot, kind, cfg, sorted_positions, new_blocks, own_eps)
    except Exception:
        for k, block in new_blocks:
            if kind == "adapter":
                _detach(block, stack)
        snapshot.restore(model, stack)
        raise
    return model


def _detach(block: nn.Module, stack: nn.ModuleList) -> None:
    for layer in stack:
        for name in (_blocks.PRE, _blocks.POST):
            hosted = getattr(layer, name, None)
            if hosted is not None:
                keep = [b for b in hosted if b is not block]
                if len(keep) != len(hosted):
                    layer._modules[name] = nn.ModuleList(keep)


def _insert_native(model, stack, new_blocks, snapshot: _Snapshot) -> None:
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
    _set_layers(stack, layers)
    model.config.num_hidden_layers = len(layers)
    for key, values in snapshot.per_layer.items():
        setattr(model.config, key, [values[j] for j in origin])
    _renumber(layers)


def _update_record(model, stack, snapshot: _Snapshot, kind, cfg: GrowthConfig, positions, new_blocks, own_eps) -> None:
    before = GrowthRecord.from_dict(snapshot.record) if snapshot.record else None
    old_index = {id(layer): i for i, layer in enumerate(snapshot.layers)}
    new_native = {id(b) for _, b in new_blocks} if kind == "native" else set()
    prior_native = set(before.native_indices) if before else set()
    native = tuple(
        i for i, layer in enumerate(stack) if id(layer) in new_native or old_index.get(id(layer), -1) in prior_native
    )
    adapters = tuple(
        AdapterEntry(
            host=i,
            where=where,
            dim=block.w_in.out_features,
            norm="rms" if isinstance(block.norm, nn.RMSNorm) else "layer",
            eps=block.norm.eps,
            act=next(n for n, c in _blocks.ACTIVATIONS.items() if isinstance(block.act, c)),
        )
        for i, layer in enumerate(stack)
        for where, hosted in _blocks.hosted_blocks(layer).items()
        for block in hosted
    )
    step = GrowthStep(
        positions=tuple(positions),
        num_layers_before=len(snapshot.layers),
        block=kind,
        init=cfg.init if kind == "native" else "random",
        eps=cfg.eps if cfg.eps is not None else own_eps,
        seed=cfg.seed,
        config=asdict(cfg),
    )
    record = GrowthRecord(
        base_num_layers=before.base_num_layers if before else len(snapshot.layers),
        num_layers=len(stack),
        native_indices=native,
        adapters=adapters,
        history=(*(before.history if before else ()), step),
        hf_depthgrow_version=package_version(),
    )
    store_record(model.config, record)


def new_block_modules(model: nn.Module) -> list[nn.Module]:
    """Every block inserted by `grow_depth`, native layers first (in layer order), then adapters."""
    record = growth_record(model)
    if not record:
        return []
    _, stack, _ = resolve_family(model)
    modules = [stack[i] for i in record.native_indices]
    for layer in stack:
        for hosted in _blocks.hosted_blocks(layer).values():
            modules.extend(hosted)
    return modules


def new_block_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of every inserted block, names as in `model.named_parameters()`."""
    ids = {id(p) for m in new_block_modules(model) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in ids:
            yield name, param


@contextlib.contextmanager
def bypass_new_blocks(model: nn.Module):
    """Run a grown model as the original: new blocks are skipped, no weights are copied.

    Inside the context the layer list, layer count, per-layer config lists and KV-cache
    slots are those of the original model; everything is restored on exit, also on error.

    Example:
        ```python
        >>> with bypass_new_blocks(grown):
        ...     old_logits = grown(input_ids).logits
        ```
    """
    record = growth_record(model)
    if not record:
        yield model
        return
    _, stack, _ = resolve_family(model)
    snapshot = _Snapshot.take(model, stack)
    adapters = [b for layer in stack for hosted in _blocks.hosted_blocks(layer).values() for b in hosted]
    keep = list(record.old_indices)
    try:
        layers = [stack[i] for i in keep]
        _set_layers(stack, layers)
        model.config.num_hidden_layers = len(layers)
        for key, values in snapshot.per_layer.items():
            setattr(model.config, key, [values[i] for i in keep])
        _renumber(layers)
        for block in adapters:
            block.enabled = False
        yield model
    finally:
        for block in adapters:
            block.enabled = True
        snapshot.restore(model, stack)


def reattach_adapters(model: nn.Module, record: GrowthRecord) -> list[_blocks.NormalizedResidualBlock]:
    """Rebuild the adapter blocks a record lists (weights to be loaded afterwards)."""
    _, stack, _ = resolve_family(model)
    like = _param_like(stack[0])
    hidden = _hidden_size(model, stack[0])
    built = []
    for entry in record.adapters:
        block = _blocks.NormalizedResidualBlock(hidden, entry.dim, norm=entry.norm, eps=entry.eps, act=entry.act)
        block = block.to(dtype=like.dtype, device=like.device)
        _blocks.attach(stack[entry.host], block, entry.where)
        built.append(block)
    return built
