"""A frozen base quantised by bitsandbytes (4-bit NF4 or 8-bit, loaded through transformers' `BitsAndBytesConfig`).

Such a base can be grown: the new blocks are float modules (never quantised) whose residual outputs
are zero, so the grown model adds exactly 0 to the residual stream and computes bit for bit what the
quantised original did. A native block copied from a quantised layer gets that layer's weights
dequantised into plain `nn.Linear` modules first. Saving writes a dequantised (full-precision)
copy: a quantised checkpoint would quantise the trained blocks again when it is loaded.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

QUANTIZE_MODES = ("4bit", "8bit")
_BNB_LINEARS = ("Linear4bit", "Linear8bitLt")


def _quant_method(config) -> str | None:
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def bnb_mode(model: nn.Module) -> str | None:
    """`"4bit"` or `"8bit"` for a model transformers loaded with a `BitsAndBytesConfig`, else `None`.

    Example:
        ```python
        >>> bnb_mode(load_model("smollm2", quantize="4bit")[0]), bnb_mode(tiny_model("llama"))
        ('4bit', None)
        ```
    """
    config = getattr(model, "config", None)
    if config is None or _quant_method(config) != "bitsandbytes":
        return None
    qc = config.quantization_config
    four = qc.get("load_in_4bit") if isinstance(qc, dict) else getattr(qc, "load_in_4bit", False)
    return "4bit" if four else "8bit"


def is_bnb_linear(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes quantised linear layer (found by class, so bitsandbytes need not be importable)."""
    cls = type(module)
    return cls.__module__.startswith("bitsandbytes") and cls.__name__ in _BNB_LINEARS


def _unpack_cpu_format(module: nn.Module) -> None:
    # bitsandbytes repacks a 4-bit weight in place for its AVX512-BF16 CPU kernel on the first eval-mode
    # forward; its own state-dict hook packs it back into the standard layout, which dequantisation reads.
    state = getattr(module.weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        module.state_dict()


def prepare_quantized_base(model: nn.Module) -> int:
    """Give every 4-bit layer one kernel for training and evaluation; returns how many layers there are.

    On a CPU with AVX512-BF16, bitsandbytes switches a 4-bit layer's eval-mode forward to a bf16 kernel
    (repacking its weight in place), while training mode keeps dequantise-then-matmul: the trained and
    the evaluated function would differ, and no gradient flows through the bf16 kernel. Turning that
    switch off keeps the standard path everywhere (GPUs never take it). Called by `load_model(quantize=...)`
    and `grow_depth`; harmless to call again.
    """
    layers = [m for m in model.modules() if is_bnb_linear(m) and type(m).__name__ == "Linear4bit"]
    for module in layers:
        _unpack_cpu_format(module)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return len(layers)


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The float weight a bitsandbytes linear layer computes with (its dequantised packed weight)."""
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    _unpack_cpu_format(module)
    state = getattr(module, "state", None) if type(module).__name__ == "Linear8bitLt" else None
    return dequantize_bnb_weight(module.weight, state).detach()


def float_linears(root: nn.Module, dtype: torch.dtype) -> int:
    """Replace, in place, every bitsandbytes linear layer under `root` by an `nn.Linear` of `dtype` holding its
    dequantised weight; returns how many were replaced.

    Example:
        ```python
        >>> block = copy.deepcopy(quantised.model.layers[1])
        >>> float_linears(block, torch.float32)
        7
        ```
    """
    found = [(name, module) for name, module in root.named_modules() if is_bnb_linear(module)]
    for name, module in found:
        weight = dequantized_weight(module)
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device=weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.to(dtype))
            if module.bias is not None:
                linear.bias.copy_(module.bias.detach().to(dtype))
        linear.train(module.training)
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, linear)
    return len(found)


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's float (unquantised) parameters: what new blocks and a dequantised copy use."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def dequantized_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A full-precision copy of a bitsandbytes-quantised model (the model itself is left as it is).

    The copy holds every quantised linear layer dequantised to `dtype` (default the float dtype of
    the model's other parameters) and no `quantization_config`: plain `from_pretrained` loads what
    it saves as an ordinary float checkpoint.

    Example:
        ```python
        >>> merged = dequantized_copy(grown_4bit)
        >>> bnb_mode(merged) is None
        True
        ```
    """
    dtype = dtype or float_dtype(model)
    quantizer = getattr(model, "hf_quantizer", None)
    model.hf_quantizer = None  # not deep-copied: the copy drops it below anyway
    try:
        merged = copy.deepcopy(model)
    finally:
        model.hf_quantizer = quantizer
    float_linears(merged, dtype)
    # What transformers' own `remove_quantization_config` undoes, so the copy saves and loads as a float model.
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        merged.__dict__.pop(attr, None)
    merged.is_quantized = merged.is_loaded_in_4bit = merged.is_loaded_in_8bit = False
    if hasattr(merged.config, "quantization_config"):
        del merged.config.quantization_config
    merged.config.dtype = dtype
    return merged
