"""Building one new block, native or adapter, without inserting it.

`grow_depth` builds every block here before it touches the model (so a failure leaves the model
as it was), and the probe builds the very same block through `build_block` to reason about it.
Every random draw is seeded from `(seed, position, repeat)` only, which is what makes the two
agree.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect

import torch
from torch import nn

from . import adapter
from .checks import check_zeroable
from .config import GrowthConfig
from .families import FamilySpec, model_eps, residual_output_targets
from .quantized import float_linears


def _block_seed(seed: int, position: int, repeat: int) -> int:
    # Depends on the position, not on the other positions of the same call, so a block grown
    # alone at k equals the one grown at k together with others (and the probe's candidate).
    return (seed * 1_000_003 + position * 10_007 + repeat) % (2**63 - 1)


def _hidden_size(model: nn.Module, layer: nn.Module, config=None) -> int:
    # `config`: the config of the stack (a tower's sub-config in a nested model); default the model's.
    config = model.config if config is None else config
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    for module in layer.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
            return module.normalized_shape[-1]
    raise ValueError(f"Cannot tell the hidden size of {type(model).__name__}.")


def _param_like(layer: nn.Module) -> torch.Tensor:
    # A new block takes the dtype and device of the layer's floating-point weights.
    return next(p for p in layer.parameters() if p.is_floating_point())


def _construct_layer(layer_cls: type, config, index: int) -> nn.Module:
    # Layer constructors differ across families: (config, layer_idx=i), (config, i) or (config).
    params = inspect.signature(layer_cls.__init__).parameters
    if "layer_idx" in params:
        return layer_cls(config, layer_idx=index)
    if len(params) >= 3 and list(params)[2] not in ("args", "kwargs"):
        return layer_cls(config, index)
    return layer_cls(config)


def zero_residual_outputs(spec: FamilySpec, layer: nn.Module, where: str) -> None:
    """Zero, in place, what `layer` adds to the residual stream (`spec.residual_outputs`), after checking it can be.

    A projection must be a plain layer (`check_zeroable`: no wrapper, no quantised weights); a
    parameter entry (a fused MoE expert bank's `down_proj`) must be a floating-point tensor.

    Example:
        ```python
        >>> zero_residual_outputs(FAMILIES["llama"], block, "layer 2")
        >>> float(block.mlp.down_proj.weight.abs().max())
        0.0
        ```
    """
    targets = residual_output_targets(spec, layer)
    for entry, module, params in targets:
        # A projection's entry holds its `weight`; a wrapper (peft's LoRA) holds none of its own.
        if not params or any(p is getattr(module, "weight", None) for p in params):
            check_zeroable(module, f"{where}: {entry}")
        elif not all(p.is_floating_point() for p in params):
            raise ValueError(f"cannot zero the residual output `{where}: {entry}`: it is not a floating-point tensor.")
    with torch.no_grad():
        for _, _, params in targets:
            for param in params:
                param.zero_()


def build_native_block(
    model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig, repeat: int = 0,
    source: int | None = None, stack_config=None,
) -> nn.Module:
    """The family's own layer for insertion at `position`, its residual output projections zeroed.

    `cfg.init="copy"` deep-copies the layer below the position (layer 0 for k = 0, as LLaMA Pro
    does), or layer `source` where given (a plan's `copy_from`, as mergekit duplicates any layer);
    `"random"` builds a fresh layer with the model's `_init_weights` under the block seed, from
    `stack_config` (the config of the stack: a tower's sub-config in a nested model; default the model's).

    Example:
        ```python
        >>> spec, stack, _ = resolve_family(model)
        >>> block = build_native_block(model, stack, spec, 2, GrowthConfig(block="native"))
        ```
    """
    index = max(position - 1, 0) if source is None else source
    src = stack[index]
    if cfg.init == "copy":
        block = copy.deepcopy(src)
        adapter.strip(block)  # a copied host layer must not carry the host's adapters
        float_linears(block, _param_like(src).dtype)  # a copy of a quantised layer trains in float: never quantised
    else:
        like = _param_like(src)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(cfg.seed, position, repeat))
            block = _construct_layer(type(src), model.config if stack_config is None else stack_config, index)
            init_fn = getattr(model, "_init_weights", None)
            if init_fn is not None:
                block.apply(init_fn)
        block.to(dtype=like.dtype, device=like.device)
        # Copy the attention-type attributes the family set from the config (sliding windows).
        for attr in ("attention_type", "is_sliding", "sliding_window"):
            if hasattr(src, attr):
                setattr(block, attr, getattr(src, attr))
    zero_residual_outputs(spec, block, f"layer {index}")
    # A new block follows the model's mode: a train-mode block in an eval-mode model would drop out at evaluation.
    return block.train(model.training)


def build_adapter_block(
    model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig, repeat: int = 0,
    stack_config=None,
) -> adapter.NormalizedResidualBlock:
    """A normalized residual block for `position`: `W_out = 0`, `W_in` drawn from the block seed.

    Example:
        ```python
        >>> spec, stack, _ = resolve_family(model)
        >>> block = build_adapter_block(model, stack, spec, 4, GrowthConfig(block="adapter"))
        >>> bool(block.w_out.weight.abs().sum() == 0)
        True
        ```
    """
    host = stack[min(position, len(stack) - 1)]
    like = _param_like(host)
    config = model.config if stack_config is None else stack_config
    hidden = _hidden_size(model, host, config)
    eps = cfg.eps if cfg.eps is not None else (model_eps(spec, config) or 1e-6)
    generator = torch.Generator().manual_seed(_block_seed(cfg.seed, position, repeat))
    block = adapter.NormalizedResidualBlock(
        hidden, cfg.adapter_dim or hidden, norm=spec.norm, eps=eps, act=cfg.adapter_act, generator=generator
    )
    return block.to(dtype=like.dtype, device=like.device).train(model.training)


def build_blocks(
    model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, kind: str, positions: list, cfg: GrowthConfig,
    stack_config=None,
) -> list[tuple[int, nn.Module]]:
    """`(position, block)` for each of the sorted `positions`; a repeated position counts its repeats.

    An item is a position k or a `PlacementEntry` (its `copy_from` and `init` override the default
    rule and `cfg.init` for native blocks; `grow_depth` refuses them for adapters).

    Example:
        ```python
        >>> spec, stack, _ = resolve_family(model)
        >>> [k for k, _ in build_blocks(model, stack, spec, "adapter", [1, 1, 3], GrowthConfig())]
        [1, 1, 3]
        ```
    """
    builder = build_native_block if kind == "native" else build_adapter_block
    repeats: dict[int, int] = {}
    built = []
    for item in positions:
        k = getattr(item, "at", item)
        r = repeats.get(k, 0)
        repeats[k] = r + 1
        copy_from, init = getattr(item, "copy_from", None), getattr(item, "init", None)
        if kind == "native" and (copy_from is not None or init is not None):
            own = cfg if init is None else dataclasses.replace(cfg, init=init)
            built.append((k, build_native_block(model, stack, spec, k, own, r, source=copy_from, stack_config=stack_config)))
        else:
            built.append((k, builder(model, stack, spec, k, cfg, r, stack_config=stack_config)))
    return built
