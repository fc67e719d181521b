"""The growth engine: insert zero-initialised residual blocks so the grown model computes exactly
what the original did (docs/theory.md §1).

Two kinds of block:
- native: the family's own layer, copied from its neighbour (LLaMA Pro) or freshly initialised,
  with its residual output projections zeroed. It takes a real slot in the layer list, so the
  grown model is an ordinary checkpoint of the same architecture that plain transformers loads.
- adapter: a generic normalized residual block hung on an original layer (see `adapter.py`),
  exact for every family, post-norm ones included.

This module holds `grow_depth` and what reads its result back (`new_block_modules`,
`new_block_parameters`, `reattach_adapters`). The pieces live by job: `config.py`
(`GrowthConfig`), `checks.py` (argument checks), `blocks.py` (building a block),
`layout.py` (the layer list and what is indexed by layer), `bypass.py` (`bypass_new_blocks`),
`record.py` (`GrowthRecord`).
"""

from __future__ import annotations

from dataclasses import asdict
import os
from typing import Iterator

import torch
from torch import nn

from . import adapter, verify
from ..utils import package_version
from .blocks import _hidden_size, _param_like, build_adapter_block, build_blocks, build_native_block
from .checks import (
    check_eps_representable,
    check_growable,
    check_native_eps,
    check_not_peft_wrapped,
    check_not_partitioned,
    check_not_quantized,
    check_positions,
    resolve_block_kind,
)
from .config import GrowthConfig
from .families import model_eps
from .layout import _insert_native, Snapshot
from .norms import check_norm_eps
from .placement import describe, resolve_positions
from .quantized import bnb_mode, prepare_quantized_base
from .record import AdapterEntry, GrowthRecord, GrowthStep, InvalidGrowthRecordError, growth_record, store_record
from .towers import resolve_family, resolve_target

__all__ = ["grow_depth", "build_block", "check_record_matches", "new_block_modules", "new_block_parameters", "reattach_adapters"]


def grow_depth(
    model: nn.Module, positions, *, config: GrowthConfig | None = None, probe_result=None, **kwargs
) -> nn.Module:
    """Insert one zero-initialised residual block at each position; the model stays function-identical.

    Position k counts the model's current layers: the new block sits between layers k-1 and k,
    so the block sees the residual stream entering layer k (k = 0: after the embeddings; k = L:
    after the last layer, before the final norm). A repeated position inserts several blocks there.
    Works in place and returns the same model, like peft's `inject_adapter_in_model`. Nothing is
    changed when an argument is rejected.

    Args:
        model: A transformers `PreTrainedModel`. Families in `hf_depthgrow.SUPPORTED_FAMILIES` are
            read from the table; any other family's layout is inferred from its layers
            (`hf_depthgrow.growth.inference`): native blocks where that is exact, adapter blocks
            (with a warning that says why) otherwise.
        positions: Insertion points, each an int with 0 <= k <= L; or a placement (see
            `hf_depthgrow.growth.placement.resolve_positions`): `"interleave:N"` (block j at
            `floor((j+1)*L/N + 1/2)`, LLaMA Pro spacing for any L), `"top:N"` (N blocks at L),
            `"probe:N"` (the N largest probe z-scores), a plan `[{"at": k, "copy_from": j}, ...]` or
            `{"plan": [...]}`, or a mergekit passthrough config that only duplicates layers.
        config: A `GrowthConfig`; or pass its fields as keyword arguments (`block`, `init`,
            `eps`, `seed`, `adapter_dim`, `adapter_act`, `verify`, `tower`). `tower="vision"` or
            `"text"` grows one tower of a model whose config nests sub-configs (CLIP, SigLIP,
            LLaVA); positions then count that tower's layers.
        probe_result: The `ProbeResult` that `"probe:N"` ranks by z (the probe is not run here).

    Raises:
        ValueError: a bad argument or a model that cannot be grown exactly (before any change).
        GrowthNotExactError: (a `ValueError`) the grown model's output moved on a probe input;
            the growth is rolled back first. Skipped with `verify=False`.

    Example:
        ```python
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_depthgrow import grow_depth
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        ...                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100))
        >>> grow_depth(model, [2], block="native", init="copy").config.num_hidden_layers
        5
        >>> grow_depth(model, [{"at": 5, "copy_from": 0}]).config.num_hidden_layers   # copy layer 0 to the top
        6
        >>> grow_depth(clip, [2], tower="vision").config.vision_config.num_hidden_layers  # a 3-layer CLIP vision tower
        4
        ```
    """
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    cfg = config or GrowthConfig(**kwargs)
    target, entries, kind, own_eps = _plan(model, positions, cfg, probe_result)
    spec, stack = target.spec, target.stack
    check_eps = cfg.eps if cfg.eps is not None else own_eps
    dtype = _param_like(stack[0]).dtype
    if check_eps is not None:
        # An eps the user picks must survive the model's dtype. The model's own eps is checked where its
        # norms compute it (torch upcasts half-precision norms to float32): a block that inherits it is
        # no worse than the model's existing norms, and an fp16 BERT (eps 1e-12) stays growable.
        check_eps_representable(check_eps, dtype if cfg.eps is not None else torch.promote_types(dtype, torch.float32))
        # Called from here, not from a helper: its warning's stacklevel points at our caller.
        check_norm_eps(check_eps, dtype)

    if bnb_mode(model) is not None:
        prepare_quantized_base(model)  # before the reference run: one 4-bit kernel for training and evaluation
    # Build every block before touching the model: a failure here leaves it as it was.
    new_blocks = build_blocks(model, stack, spec, kind, entries, cfg, stack_config=target.config)
    probe = _reference(model, target) if cfg.verify else None
    snapshot = Snapshot.take(model, stack, target)
    try:
        _place_blocks(model, stack, kind, entries, new_blocks, snapshot)
        placement = _placement_record(positions, entries)
        _update_record(model, stack, snapshot, kind, cfg, [e.at for e in entries], new_blocks, own_eps, placement, target.tower)
        if probe is not None:
            _check_exact(probe, dtype, target, bitwise=bnb_mode(model) is not None)
    except Exception:
        if kind == "adapter":
            for _, block in new_blocks:
                for layer in stack:
                    adapter.detach(layer, block)
        snapshot.restore(model, stack)
        raise
    return model


def _place_blocks(model: nn.Module, stack: nn.ModuleList, kind: str, entries, new_blocks, snapshot: Snapshot) -> None:
    """Native blocks into the layer list (and every per-layer list beside it); adapter blocks hung on their hosts."""
    if kind == "native":
        _insert_native(model, stack, new_blocks, snapshot)
        _per_layer_from_sources(model, stack, entries, new_blocks, snapshot)
        return
    old = list(stack)
    for k, block in new_blocks:
        adapter.attach(old[k] if k < len(old) else old[-1], block, "pre" if k < len(old) else "post")


def _plan(model: nn.Module, positions, cfg: GrowthConfig, probe_result) -> tuple:
    """What `grow_depth` builds, resolved and checked before anything changes: the stack it grows (`StackTarget`),
    the placement entries, the block kind and the model's own norm eps."""
    check_not_peft_wrapped(model)
    check_not_quantized(model)
    check_not_partitioned(model)
    target = resolve_target(model, cfg.tower)
    check_growable(model, target.stack, target.config, target.count_key)
    entries = resolve_positions(positions, len(target.stack), probe_result=probe_result, model=model)
    kind = resolve_block_kind(cfg, target.spec, target.config)
    custom = [e for e in entries if not e.is_default]
    if kind == "adapter" and custom:
        raise ValueError(
            f"plan entry {custom[0]} sets copy_from or init, which only native blocks have; this growth builds "
            "adapter blocks (use block='native' on a pre-norm family, or drop copy_from/init)."
        )
    own_eps = model_eps(target.spec, target.config)
    check_native_eps(kind, cfg, own_eps)
    return target, entries, kind, own_eps


def _adapter_entries(stack: nn.ModuleList) -> tuple[AdapterEntry, ...]:
    # Read back from the modules themselves, so the record lists every adapter the model carries.
    return tuple(
        AdapterEntry(
            host=i,
            where=where,
            dim=block.w_in.out_features,
            norm="rms" if isinstance(block.norm, nn.RMSNorm) else "layer",
            eps=block.norm.eps,
            act=next(n for n, c in adapter.ACTIVATIONS.items() if isinstance(block.act, c)),
        )
        for i, layer in enumerate(stack)
        for where, hosted in adapter.hosted_blocks(layer).items()
        for block in hosted
    )


def _per_layer_from_sources(model, stack, entries, new_blocks, snapshot: Snapshot) -> None:
    # `_insert_native` gives a new layer the per-layer config entries (e.g. `layer_types`) of layer
    # k-1; a block copied from another layer j must carry j's, or save/load would rebuild it differently.
    moved = {id(block): e.copy_from for e, (_, block) in zip(entries, new_blocks) if e.copy_from is not None}
    if not moved or not snapshot.per_layer:
        return
    for key, values in snapshot.per_layer.items():
        current = list(getattr(snapshot.configs[0], key))
        for i, layer in enumerate(stack):
            if id(layer) in moved:
                current[i] = values[moved[id(layer)]]
        for config in snapshot.configs:
            setattr(config, key, list(current))


def _placement_record(spec, entries) -> dict | None:
    # Stored only for a spec other than explicit positions, so those records stay exactly as before.
    planned = isinstance(spec, (str, os.PathLike, dict)) or (isinstance(spec, (list, tuple)) and any(isinstance(i, dict) for i in spec))
    if not planned:
        return None
    return {
        "spec": describe(spec),
        "positions": [e.at for e in entries],
        "copy_from": [e.source for e in entries],
        "init": [e.init for e in entries],
    }


def _check_exact(probe: tuple, dtype, target, *, bitwise: bool = False) -> None:
    try:
        verify.check_exact(*probe, dtype, bitwise=bitwise)
    except verify.GrowthNotExactError as err:
        if target.tower is None:
            raise
        # In a nested model the usual cause is the model reading the tower's layers by index.
        raise verify.GrowthNotExactError(
            f"{err} In a {target.tower!r} tower the model may also read hidden states by layer index (LLaVA's "
            "vision_feature_layer=-2 takes the output below the top layer): grow below the layer it reads."
        ) from None


def _reference(model: nn.Module, target) -> tuple | None:
    """`(runner, inputs, output)` for the exactness check: the whole model, or for a tower the tower's own module
    where the whole model cannot be run on inputs built from its config alone."""
    if target.tower is None:
        found = verify.reference(model)
        return (model, *found) if found is not None else None
    # The whole model first: its head may read a tower's layers by index (LLaVA's vision_feature_layer).
    found = verify.reference(model, warn=False)
    if found is not None:
        return (model, *found)
    found = verify.reference(target.root)
    return (target.root, *found) if found is not None else None


def _update_record(
    model, stack, snapshot: Snapshot, kind, cfg: GrowthConfig, positions, new_blocks, own_eps, placement=None, tower=None
) -> None:
    # Cumulative: a second growth keeps the base layer count, the earlier native layers (at their
    # new indices) and the history, and appends this call as one more step.
    before = GrowthRecord.from_dict(snapshot.record) if snapshot.record else None
    old_index = {id(layer): i for i, layer in enumerate(snapshot.layers)}
    new_native = {id(b) for _, b in new_blocks} if kind == "native" else set()
    prior_native = set(before.native_indices) if before else set()
    native = tuple(
        i for i, layer in enumerate(stack) if id(layer) in new_native or old_index.get(id(layer), -1) in prior_native
    )
    step = GrowthStep(
        positions=tuple(positions),
        num_layers_before=len(snapshot.layers),
        block=kind,
        init=cfg.init if kind == "native" else "random",
        eps=cfg.eps if cfg.eps is not None else own_eps,
        seed=cfg.seed,
        # `verify` says how the growth was checked, not how a block is built; a placement other than explicit
        # positions goes into this free-form dict, so records written before still load unchanged.
        config={k: v for k, v in asdict(cfg).items() if k != "verify" and not (k == "tower" and v is None)}
        | ({"placement": placement} if placement else {}),
    )
    record = GrowthRecord(
        base_num_layers=before.base_num_layers if before else len(snapshot.layers),
        num_layers=len(stack),
        native_indices=native,
        adapters=_adapter_entries(stack),
        history=(*(before.history if before else ()), step),
        hf_depthgrow_version=package_version(),
        tower=tower,
    )
    store_record(model.config, record)


def new_block_modules(model: nn.Module) -> list[nn.Module]:
    """Every block inserted by `grow_depth`, native layers first (in layer order), then adapters.

    Example:
        ```python
        >>> grow_depth(model, [2], block="native")
        >>> len(new_block_modules(model))
        1
        ```
    """
    record = growth_record(model)
    if not record:
        return []
    _, stack, _ = resolve_family(model)
    modules = [stack[i] for i in record.native_indices]
    for layer in stack:
        for hosted in adapter.hosted_blocks(layer).values():
            modules.extend(hosted)
    return modules


def new_block_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of every inserted block, names as in `model.named_parameters()`.

    Example:
        ```python
        >>> grow_depth(model, [4], block="adapter")
        >>> [name for name, _ in new_block_parameters(model)][:1]
        ['model.layers.3.depthgrow_post.0.norm.weight']
        ```
    """
    ids = {id(p) for m in new_block_modules(model) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in ids:
            yield name, param


def reattach_adapters(model: nn.Module, record: GrowthRecord) -> list[adapter.NormalizedResidualBlock]:
    """Rebuild the adapter blocks a record lists, on the layers it names (weights to be loaded afterwards).

    Example:
        ```python
        >>> blocks = reattach_adapters(base_model, growth_record(base_model))
        >>> # then load depthgrow_adapters.safetensors into them
        ```
    """
    target = resolve_target(model, record.tower)
    stack = target.stack
    like = _param_like(stack[0])
    hidden = _hidden_size(model, stack[0], target.config)
    built = []
    for entry in record.adapters:
        block = adapter.NormalizedResidualBlock(hidden, entry.dim, norm=entry.norm, eps=entry.eps, act=entry.act)
        block = block.to(dtype=like.dtype, device=like.device).train(model.training)
        adapter.attach(stack[entry.host], block, entry.where)
        built.append(block)
    return built


def build_block(
    model: nn.Module, position: int, config: GrowthConfig | None = None, *, repeat: int = 0, **kwargs
) -> tuple[str, nn.Module]:
    """Build, without inserting, the block `grow_depth(model, [position], ...)` would insert.

    Returns `(kind, module)`; the probe uses it to reason about exactly that block.

    Example:
        ```python
        >>> kind, block = build_block(model, 2, GrowthConfig(block="auto"))
        >>> kind
        'native'
        ```
    """
    cfg = config or GrowthConfig(**kwargs)
    target = resolve_target(model, cfg.tower)
    check_positions([position], len(target.stack))
    kind = resolve_block_kind(cfg, target.spec, target.config)
    builder = build_native_block if kind == "native" else build_adapter_block
    return kind, builder(model, target.stack, target.spec, position, cfg, repeat, stack_config=target.config)


def check_record_matches(model, record: GrowthRecord, adapter_state: dict | None = None) -> None:
    """Refuse a record that does not describe these weights, as far as the weights can tell.

    Checked: the stack holds `base_num_layers + len(native_indices)` layers; every adapter's host
    exists (a `post` adapter only on the last layer); adapters already hosted on the model, and
    those in `adapter_state` (the saved adapter tensors, by parameter name), have the record's
    count per host and the shapes its `dim` and the hidden size give. Native blocks cannot be told
    from original layers by their weights once trained, so their indices are checked by count only.

    Raises:
        InvalidGrowthRecordError: naming the first mismatch.
    """
    target = resolve_target(model, record.tower)  # the base of an adapters-only save has no record to name it
    stack, path = target.stack, target.path
    record.validate(num_layers=len(stack))
    hidden = _hidden_size(model, stack[0], target.config)
    expected: dict[tuple[int, str], list[AdapterEntry]] = {}
    for entry in record.adapters:
        if entry.where == "post" and entry.host != len(stack) - 1:
            raise InvalidGrowthRecordError(f"growth record: a post adapter hangs on layer {entry.host}, not on the last layer {len(stack) - 1}")
        expected.setdefault((entry.host, entry.where), []).append(entry)
    for i, layer in enumerate(stack):
        for where, hosted in adapter.hosted_blocks(layer).items():
            if hosted and len(hosted) != len(expected.get((i, where), [])):
                raise InvalidGrowthRecordError(
                    f"growth record lists {len(expected.get((i, where), []))} {where} adapters on layer {i}, the model hosts {len(hosted)}"
                )
    if adapter_state is not None:
        _check_adapter_shapes(adapter_state, expected, hidden, f"{path}." if path else "")


def _check_adapter_shapes(state: dict, expected: dict, hidden: int, prefix: str) -> None:
    from .adapter import POST, PRE  # see check_record_matches

    for (host, where), entries in expected.items():
        for j, entry in enumerate(entries):
            base = f"{prefix}{host}.{PRE if where == 'pre' else POST}.{j}."
            for name, shape in (("w_in.weight", (entry.dim, hidden)), ("w_out.weight", (hidden, entry.dim)), ("norm.weight", (hidden,))):
                tensor = state.get(base + name)
                if tensor is not None and tuple(tensor.shape) != shape:
                    raise InvalidGrowthRecordError(
                        f"growth record: adapter {base}{name} has shape {tuple(tensor.shape)}, but the record's dim {entry.dim} "
                        f"and hidden size {hidden} give {shape}"
                    )
