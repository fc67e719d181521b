"""Argument checks shared by `grow_depth`, `build_block`, the probe and stepping stones.

Every check runs before a model is touched and raises one `ValueError` naming the problem, so a
rejected call leaves the model as it was.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .config import GrowthConfig
from .families import FamilySpec
from .quantized import bnb_mode


_TORCH_QUANTIZED = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")


def _torch_quantized_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    # torch's eager quantisation swaps modules in place and sets no config flag: find them by class.
    return next(((n, m) for n, m in model.named_modules() if type(m).__module__.startswith(_TORCH_QUANTIZED)), None)


def is_quantized(model: nn.Module) -> bool:
    """True where transformers flags the model as quantised (GGUF, bitsandbytes, ...) or torch quantised its modules.

    Example:
        ```python
        >>> is_quantized(tiny_model("llama"))
        False
        ```
    """
    config = getattr(model, "config", None)
    return bool(
        getattr(model, "is_quantized", False)
        or getattr(model, "hf_quantizer", None) is not None
        or (config is not None and getattr(config, "quantization_config", None))
        or _torch_quantized_module(model) is not None
    )


def check_not_quantized(model: nn.Module) -> None:
    """Refuse a quantised model other than a bitsandbytes one (4-bit or 8-bit, through `BitsAndBytesConfig`).

    A bitsandbytes base takes float new blocks exactly (`growth/quantized.py`); a GGUF-flagged model
    refuses saving and training in transformers, and torch's quantised modules have no float copy to train.

    Example:
        ```python
        >>> check_not_quantized(tiny_model("llama"))   # returns None, or raises ValueError
        ```
    """
    found = _torch_quantized_module(model)
    if found is not None:
        name, module = found
        raise ValueError(
            f"module `{name}` is a torch quantised {type(module).__module__}.{type(module).__name__}: the model cannot be "
            "grown or trained exactly; grow the float model and quantise afterwards."
        )
    if is_quantized(model) and bnb_mode(model) is None:
        raise ValueError(
            "the model is flagged as quantised (e.g. loaded with gguf_file= or a quantization_config) and cannot be "
            "grown or trained: make a float copy first (see hf_depthgrow.data.embedded for the GGUF case), or load the "
            "base with bitsandbytes (load_model(..., quantize='4bit' or '8bit'))."
        )


def check_not_peft_wrapped(model: nn.Module) -> None:
    """Refuse a peft `PeftModel`: its layer stack sits under the tuner, and the grown blocks would be hidden from peft.

    Found by class name so that peft need not be importable.
    """
    names = {c.__name__ for c in type(model).__mro__}
    if names & {"PeftModel", "PeftMixedModel"}:
        raise ValueError(
            f"the model is a peft {type(model).__name__}: grow the transformers model before wrapping it with peft, "
            "or merge the adapters first (model.merge_and_unload())."
        )


def check_not_partitioned(model: nn.Module) -> None:
    """Refuse a model whose weights are split over processes: ZeRO-3 partitioned or FSDP2-sharded.

    A ZeRO-3 parameter (loaded under `deepspeed.zero.Init`, e.g. `zero3_init_flag: true`) holds an
    empty local tensor of shape `[0]`, so a copied layer would be empty too; an FSDP2 shard is a
    `DTensor` whose copy `fully_shard` never registered. Growth goes before partitioning:
    `deepspeed.initialize` or `fully_shard` then split the grown model, new blocks included.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support: nothing can be sharded
        DTensor = ()
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            raise ValueError(
                f"parameter `{name}` is ZeRO-3 partitioned (the model was loaded under deepspeed.zero.Init, e.g. "
                "zero3_init_flag: true) and its local tensor is empty: load the model whole (zero3_init_flag: false), "
                "grow it, then let deepspeed.initialize partition the grown model."
            )
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter `{name}` is an FSDP shard (fully_shard was applied): grow the model before sharding it "
                "(hf_depthgrow.training.sharding.shard_grown_model shards the grown model)."
            )


def check_zeroable(module: nn.Module, where: str) -> None:
    """Refuse a residual output module that zeroing its own weights does not silence (a wrapper or quantised layer).

    A plain projection (`nn.Linear`, GPT-2's `Conv1D`) has no sub-modules and floating weights;
    a peft LoRA layer adds `lora_B(lora_A(x))` from sub-modules, a quantised layer keeps packed
    weights that are not parameters: zeroing what `parameters(recurse=False)` holds leaves both non-zero.
    """
    params = list(module.parameters(recurse=False))
    weight = getattr(module, "weight", None)
    plain = (
        not any(True for _ in module.children())
        and isinstance(weight, nn.Parameter)
        and all(p.is_floating_point() for p in params)
    )
    if not plain:
        cls = type(module)
        raise ValueError(
            f"cannot zero the residual output `{where}`: it is a {cls.__module__}.{cls.__name__} (a wrapper or quantised "
            "layer), so a native block copied from it would not start as the identity. Merge or remove the wrapper "
            "first (peft: merge_and_unload()), or use block='adapter'."
        )


def check_eps_representable(eps: float, dtype: torch.dtype) -> None:
    """Refuse an eps that rounds to 0 in the model's dtype: a norm with eps 0 returns NaN on an all-zero input.

    Example:
        ```python
        >>> check_eps_representable(1e-8, torch.float16)
        Traceback (most recent call last):
        ValueError: eps=1e-08 rounds to 0 in torch.float16 ...
        ```
    """
    if dtype.is_floating_point and float(torch.tensor(eps, dtype=dtype)) == 0.0:
        raise ValueError(
            f"eps={eps:g} rounds to 0 in {dtype} (smallest positive value {torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps:g}): "
            "a norm with eps 0 is singular at z = 0. Pass a larger eps with block='adapter', or grow the model in float32."
        )


def check_growable(model: nn.Module, stack: nn.ModuleList, config=None, count_key: str = "num_hidden_layers") -> None:
    """Refuse a layer stack `grow_depth` cannot renumber: heterogeneous per-layer configs, or a layer count at odds with the config.

    `config` is the config that describes the stack (default `model.config`; a tower's sub-config
    for a nested model) and `count_key` its layer-count key.

    Example:
        ```python
        >>> spec, stack, _ = resolve_family(model)
        >>> check_growable(model, stack)            # returns None, or raises ValueError
        ```
    """
    config = model.config if config is None else config
    if getattr(config, "is_heterogeneous", False):
        raise ValueError("heterogeneous per-layer configs are not supported by grow_depth yet.")
    count = getattr(config, count_key, None)
    if count != len(stack):
        raise ValueError(f"config.{count_key}={count} but the layer stack has {len(stack)} layers.")


def check_positions(positions, num_layers: int) -> list[int]:
    """The positions sorted, after checking each is an int in 0..num_layers; a `ValueError` names the bad one.

    Example:
        ```python
        >>> check_positions([4, 0, 2, 2], num_layers=4)
        [0, 2, 2, 4]
        ```
    """
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
    """`"native"` or `"adapter"` for `cfg.block` on this family (`auto`: native where that is exact).

    Example:
        ```python
        >>> resolve_block_kind(GrowthConfig(block="auto"), FAMILIES["bert"], bert.config)
        'adapter'
        ```
    """
    native_ok = spec.kind != "unknown" and spec.native_is_exact(config)
    if cfg.block == "auto":
        return "native" if native_ok else "adapter"
    if cfg.block == "native" and not native_ok:
        if spec.kind == "unknown":
            raise ValueError(f"model_type {spec.model_type!r} is not in the family table: only block='adapter' is available.")
        if spec.fallback_reason:  # an inferred row says why (post-norm, layer index in the maths, ...)
            raise ValueError(
                f"native blocks are not function-preserving for {spec.model_type} (inferred, not in the family table): "
                f"{spec.fallback_reason}. Use block='adapter' or 'auto'."
            )
        reason = (
            "it is post-norm (LN(z + 0) != z)"
            if spec.norm_style != "pre"
            else f"its config sets {[f for f in spec.inexact_if if getattr(config, f, False)]}, which ties the maths to layer indices"
        )
        raise ValueError(f"native blocks are not function-preserving for {spec.model_type}: {reason}. Use block='adapter' or 'auto'.")
    return cfg.block


def check_native_eps(kind: str, cfg: GrowthConfig, own_eps: float | None) -> None:
    """Refuse an eps for native blocks other than the config's: the family's norms read it from the config.

    Example:
        ```python
        >>> check_native_eps("native", GrowthConfig(eps=1e-3), own_eps=1e-5)
        Traceback (most recent call last):
        ValueError: native blocks use the family's norms with the config's eps (1e-05); ...
        ```
    """
    if kind == "native" and cfg.eps is not None and own_eps is not None and cfg.eps != own_eps:
        raise ValueError(
            f"native blocks use the family's norms with the config's eps ({own_eps}); a different eps ({cfg.eps}) would "
            "not survive save/load. Use block='adapter' for a block with its own eps."
        )
