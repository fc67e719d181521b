"""Trainable sets (`"new"`, `"new+lora"`, `"full"`, and the controls `"layers"`, `"lora"`), the modules in train mode, AdamW groups.

Frozen modules run in eval mode (dropout off): that makes the frozen prefix a fixed function, so the
cached and uncached paths compute the same thing. Only modules that own trainable weights (the new
blocks, LoRA layers; everything with `trainable="full"`) run in train mode.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..growth.record import growth_record
from ..growth.engine import new_block_modules, new_block_parameters
from ..growth.towers import resolve_family
from .config import TrainConfig


def _linear_names(stack: nn.Module, path: str, indices, suffixes: Sequence[str] | None) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    names = []
    for i in indices:
        for name, module in stack[i].named_modules():
            if ".depthgrow_" in f".{name}" or not isinstance(module, (nn.Linear, Conv1D)):
                continue
            if suffixes and not any(name == s or name.endswith("." + s) for s in suffixes):
                continue
            names.append(f"{path}.{i}.{name}")
    return names


def lora_target_names(model: nn.Module, suffixes: Sequence[str] | None = None) -> list[str]:
    """Full names of the linear layers LoRA adapts in `"new+lora"`: original layers above the lowest insertion.

    New blocks (native layers and adapters) are excluded: they train in full. A model that was not
    grown (the `"lora"` control) gets every layer of its stack.

    Example:
        ```python
        >>> grown = grow_depth(tiny_model("llama"), [2])
        >>> lora_target_names(grown, ["q_proj"])
        ['model.layers.3.self_attn.q_proj', 'model.layers.4.self_attn.q_proj']
        ```
    """
    _, stack, path = resolve_family(model)
    record = growth_record(model)
    if record is None:
        return _linear_names(stack, path, range(len(stack)), suffixes)
    native = set(record.native_indices)
    # Original layers from the lowest insertion point up sit above a new block.
    indices = [i for i in range(record.lowest_insertion_point, len(stack)) if i not in native]
    return _linear_names(stack, path, indices, suffixes)


def layer_parameters(model: nn.Module, indices: Sequence[int]) -> list[tuple[str, nn.Parameter]]:
    """`(full name, parameter)` of the existing layers `indices` of the model's stack (what `"layers"` trains).

    Example:
        ```python
        >>> [n for n, _ in layer_parameters(tiny_model("llama"), [1])][:1]
        ['model.layers.1.self_attn.q_proj.weight']
        ```
    """
    _, stack, path = resolve_family(model)
    bad = [i for i in indices if not 0 <= i < len(stack)]
    if bad:
        raise ValueError(f"trainable_layers {bad} out of range: the model has {len(stack)} layers (0..{len(stack) - 1})")
    return [(f"{path}.{i}.{n}", p) for i in indices for n, p in stack[i].named_parameters()]


def no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and norm weights get no weight decay."""
    return param.ndim < 2 or "norm" in name.lower()


@dataclass
class TrainableSet:
    """What trains: named parameters, the modules that run in train mode, and the PEFT wrapper (or `None`)."""

    named: list
    train_modules: list
    peft_model: object = None


def _inject_lora(model: nn.Module, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    targets = lora_target_names(model, cfg.lora_target_modules)
    if not targets:
        where = "of an original layer above the lowest insertion" if cfg.trainable == "new+lora" else "in the layer stack"
        raise ValueError(f"trainable={cfg.trainable!r} found no linear layer {where} (lora_target_modules={cfg.lora_target_modules})")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets, bias="none")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*task_type.*")
        # Injects into `model` in place (it stays the module we run); the wrapper is kept for merging.
        return get_peft_model(model, lora)


def setup_trainable(model: nn.Module, cfg: TrainConfig) -> TrainableSet:
    """Set `requires_grad` for `cfg.trainable` (injecting LoRA for `"new+lora"` and `"lora"`) and return the set.

    Example:
        ```python
        >>> trainable = setup_trainable(grow_depth(tiny_model("llama"), [2]), TrainConfig())
        >>> all("layers.2." in n for n, _ in trainable.named)
        True
        ```
    """
    mode = cfg.trainable
    full = mode == "full"
    for param in model.parameters():
        param.requires_grad_(full)
    peft_model = _inject_lora(model, cfg) if mode in ("new+lora", "lora") else None
    if mode in ("new", "new+lora"):
        for _, param in new_block_parameters(model):
            param.requires_grad_(True)
    if mode == "layers":
        for _, param in layer_parameters(model, cfg.trainable_layers):
            param.requires_grad_(True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("nothing to train: the trainable set is empty")
    # Modules that run in train mode; everything else stays in eval mode (see module docstring).
    if full:
        modules = [model]
    elif mode == "layers":
        stack = resolve_family(model)[1]
        modules = [stack[i] for i in cfg.trainable_layers]
    else:
        modules = list(new_block_modules(model))
        if peft_model is not None:
            from peft.tuners.lora import LoraLayer

            modules += [m for m in model.modules() if isinstance(m, LoraLayer)]
    return TrainableSet(named, modules, peft_model)


def set_train_mode(model: nn.Module, train_modules: Sequence[nn.Module], training: bool) -> None:
    """Everything in eval mode, then (when `training`) only `train_modules` back in train mode."""
    model.eval()
    if training:
        for module in train_modules:
            module.train()


def make_optimizer(named: Sequence[tuple[str, nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only, biases and norm weights without weight decay.

    Example:
        ```python
        >>> make_optimizer(trainable.named, TrainConfig()).param_groups[0]["weight_decay"]
        0.0
        ```
    """
    decay = [p for n, p in named if not no_decay(n, p)]
    kept = [p for n, p in named if no_decay(n, p)]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": kept, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)


def assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param.copy_(value)` for plain and FSDP2-sharded (DTensor) parameters alike."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device_mesh.device_type, param.dtype), param.device_mesh, param.placements)
    param.copy_(value.to(param.device, param.dtype) if not hasattr(value, "placements") else value)
