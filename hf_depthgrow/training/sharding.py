"""FSDP2 for grown models: shard the layer blocks, gather full state dicts, run `GrownTrainer` sharded on any device.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter on its first dimension as a
`DTensor`, one parameter at a time. A sharded unit may therefore mix frozen and trainable
parameters: a frozen parameter gets no gradient, nothing is reduce-scattered for it and the
optimizer holds no state for it. FSDP1 flattened each unit into one `FlatParameter` with a single
`requires_grad`, so a frozen base and a trainable new block had to sit in different units, or need
`use_orig_params=True` (which still allocates the gradient of the whole flat parameter).

The units used here: one per layer of the stack (original layers and new native blocks alike,
what accelerate's `TRANSFORMER_BASED_WRAP` picks for a grown model too, since a native block is
the family's own layer class) plus the root (embeddings, final norm, head). Only one layer's
weights are unsharded at a time, and each unit is uniformly frozen or trainable for
`trainable="new"`, which keeps the all-gathers of frozen units free of any gradient traffic.

Entry points:

- `shard_grown_model`: apply `fully_shard` yourself, for a custom training loop;
- `full_state_dict` / `load_full_state_dict`: gather full tensors from a sharded (or plain) model on
  every process, and put full tensors back into the shards;
- `fsdp2_plugin`: accelerate's FSDP2 plugin as `recipes/accelerate_configs/fsdp.yaml` builds it;
- `fsdp2_accelerator`: an `accelerate.Accelerator` on accelerate's FSDP2 path, also on CPU
  processes (gloo), so that `GrownTrainer` trains, checkpoints (sharded, via `save_state`),
  resumes and applies the fallback rule on a sharded model. accelerate 1.16 honours an FSDP
  plugin only for GPU-like device types and silently runs DDP on CPU processes;
- `launched_fsdp_accelerator`: what `GrownTrainer` uses when `accelerate launch --config_file fsdp.yaml`
  started it on CPU processes: `fsdp2_accelerator` with the plugin the launcher's `FSDP_*` variables
  describe, so that the launch shards for real instead of running DDP.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..growth.record import growth_record
from ..growth.towers import resolve_family
from .trainable import assign


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is an FSDP2 shard (a `DTensor`).

    Example:
        ```python
        >>> is_sharded(tiny_model("llama"))
        False
        ```
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_grown_model(
    model: nn.Module, *, mesh=None, reshard_after_forward: bool = True, mp_policy=None, offload_policy=None
) -> nn.Module:
    """Apply FSDP2's `fully_shard` to every layer of a grown model's stack, then to the model itself.

    Set `requires_grad` (e.g. only on `new_block_parameters(model)`) before or after; FSDP2 keeps it
    per parameter. Needs an initialised default process group (`torchrun` + `init_process_group`).

    Args:
        model: A transformers model, grown with native blocks (adapter blocks hang on an original
            layer through a forward hook and are refused here: untested under sharding).
        mesh: A 1-D `DeviceMesh`; default: all processes on the default device type.
        reshard_after_forward: Free the gathered weights after each unit's forward (ZeRO-3-like);
            `False` keeps them until the backward (ZeRO-2-like, more memory, fewer all-gathers).
        mp_policy: A `torch.distributed.fsdp.MixedPrecisionPolicy` (default: compute in the parameters' dtype).
        offload_policy: A `torch.distributed.fsdp.CPUOffloadPolicy` to keep shards on the CPU.

    Returns:
        The same model object, now an `FSDPModule` whose parameters are `DTensor` shards.

    Example:
        ```python
        >>> grow_depth(model, [2])
        >>> for _, p in new_block_parameters(model):
        ...     p.requires_grad_(True)
        >>> shard_grown_model(model)
        >>> is_sharded(model)
        True
        ```
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    record = growth_record(model)
    if record is not None and record.adapters:
        raise NotImplementedError("shard_grown_model supports native blocks; adapter blocks hang on hooks of the original layers")
    _, stack, _ = resolve_family(model)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    for layer in stack:  # bottom-up: inner units first, as fully_shard requires
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)  # the root unit: embeddings, final norm, head
    return model


def full_state_dict(model: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full CPU copies of the parameters of a sharded (or plain) model, on every process.

    A collective when the model is sharded: every process must call it, in the same order.
    Names are those of `model.named_parameters()` (FSDP2 shards in place and renames nothing).

    Args:
        model: The model, sharded by `shard_grown_model`, by accelerate's FSDP2, or not at all.
        trainable_only: Only parameters with `requires_grad` (what a checkpoint of `"new"` needs).

    Example:
        ```python
        >>> state = full_state_dict(model, trainable_only=True)
        >>> sorted(state)[:1]
        ['model.layers.2.input_layernorm.weight']
        ```
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()  # all-gather of the shards
        out[name] = value.to("cpu", copy=True)
    return out


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a sharded (or plain) model's parameters; each process keeps its own shard.

    The inverse of `full_state_dict`, e.g. to put a grown model back at its starting weights
    (`f_old` of the fallback rule). Names missing from `state` are left as they are.

    Example:
        ```python
        >>> start = full_state_dict(model, trainable_only=True)
        >>> ...  # train
        >>> load_full_state_dict(model, start)  # new blocks back at zero init
        ```
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                assign(param, state[name])


def fsdp2_plugin(*, reshard_after_forward: bool = True, state_dict_type: str = "SHARDED_STATE_DICT"):
    """accelerate's `FullyShardedDataParallelPlugin` as `recipes/accelerate_configs/fsdp.yaml` builds it.

    FSDP2, `TRANSFORMER_BASED_WRAP` (one unit per decoder layer, new native blocks included), no
    parameter offload, no RAM-efficient loading (every process grows its own copy); the test suite
    checks that the YAML, read the way `accelerate launch` reads it, gives the same plugin.

    Example:
        ```python
        >>> fsdp2_plugin().fsdp_version
        2
        ```
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=reshard_after_forward, auto_wrap_policy="transformer_based_wrap",
        state_dict_type=state_dict_type,
    )


def fsdp2_accelerator(
    *, mixed_precision: str = "no", reshard_after_forward: bool = True, state_dict_type: str = "SHARDED_STATE_DICT",
    timeout_s: int = 1800, plugin=None,
):
    """An `Accelerator` on accelerate's FSDP2 path, on GPUs and on CPU processes (gloo) alike.

    Pass it to `GrownTrainer(..., accelerator=...)` / `train(..., accelerator=...)` in a script started
    with `torchrun --nproc_per_node N` or `accelerate launch` (the process group comes from there).
    accelerate's `prepare` then shards the model with `fully_shard` (one unit per decoder layer,
    `TRANSFORMER_BASED_WRAP`), `save_state`/`load_state` write and read sharded checkpoints with
    `torch.distributed.checkpoint`, and `get_state_dict` gathers the final model.

    On GPUs this is what `accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml`
    builds. On CPU processes accelerate 1.16 ignores the FSDP plugin (its `AcceleratorState` sets
    `DistributedType.FSDP` only for GPU-like multi-device types) and would run DDP; everything on its
    FSDP2 path is device-agnostic, so the state is set to FSDP here after the process group is up.

    Args:
        mixed_precision: `"no"` (the CPU default; bf16 collectives on gloo are not exercised), `"bf16"`, `"fp16"`.
        reshard_after_forward: See `shard_grown_model`.
        state_dict_type: How `save_state` writes the model: `"SHARDED_STATE_DICT"` (one file per process) or `"FULL_STATE_DICT"`.
        timeout_s: Timeout of the process group's collectives.
        plugin: A ready `FullyShardedDataParallelPlugin` (FSDP2) instead of `fsdp2_plugin(...)`, e.g.
            `FullyShardedDataParallelPlugin()`, which reads the `FSDP_*` variables `accelerate launch` sets
            from a config file; `reshard_after_forward` and `state_dict_type` are then ignored.

    Raises:
        `ValueError` when the launch gave a single process (nothing to shard over).

    Example:
        ```python
        >>> # torchrun --nproc_per_node 2 my_script.py
        >>> acc = fsdp2_accelerator()
        >>> result = train(grown, rows, accelerator=acc, max_steps=20, prefix_cache="auto")  # cache off when sharded
        >>> result.num_processes
        2
        ```
    """
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    plugin = plugin or fsdp2_plugin(reshard_after_forward=reshard_after_forward, state_dict_type=state_dict_type)
    if plugin.fsdp_version != 2:
        raise ValueError("fsdp2_accelerator runs FSDP2 only (fsdp_version: 2)")
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))]
    # Without a GPU-like device, accelerate makes CPU processes a process group only when asked (cpu=True).
    cpu = not _gpu_like_available()
    acc = Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin, kwargs_handlers=handlers, cpu=cpu)
    if acc.distributed_type == DistributedType.FSDP:
        return acc  # GPUs: accelerate took the plugin itself
    if acc.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(
            f"fsdp2_accelerator needs several processes (torchrun --nproc_per_node N or accelerate launch), got {acc.distributed_type}"
        )
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    # Every later `AcceleratorState()` copies PartialState's fields over its own: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


def _gpu_like_available() -> bool:
    device = getattr(torch, "accelerator", None)  # torch >= 2.6; CUDA alone before
    return device.is_available() if device is not None else torch.cuda.is_available()


def launched_fsdp_accelerator(*, mixed_precision: str | None = None, timeout_s: int = 1800):
    """FSDP2 for a process that `accelerate launch` started with an FSDP config on CPU, else `None`.

    `accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml` tells its processes to shard through
    `ACCELERATE_USE_FSDP=true` and the `FSDP_*` variables. On GPUs accelerate builds that FSDP state itself
    (`None` here: nothing to do). On CPU processes accelerate 1.16 ignores it and runs DDP without a word; this
    returns `fsdp2_accelerator(plugin=FullyShardedDataParallelPlugin())` instead, whose plugin reads the same
    variables, so the launch shards as its config says.

    Args:
        mixed_precision: The run's setting; `None` takes the launcher's (`ACCELERATE_MIXED_PRECISION`, default `"no"`).
        timeout_s: Timeout of the process group's collectives.

    Raises:
        `ValueError`: the config asks for FSDP1 (`fsdp_version: 1`; this project ships FSDP2), or the launch
        gave a single process.

    Example:
        ```python
        >>> # accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml --use_cpu --num_processes 2 script.py
        >>> launched_fsdp_accelerator(mixed_precision="no").distributed_type
        <DistributedType.FSDP: 'FSDP'>
        ```
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or _gpu_like_available():
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables the launcher set
    if plugin.fsdp_version != 2:
        raise ValueError(f"the launch config asks for FSDP{plugin.fsdp_version}; on CPU processes hf_depthgrow shards "
                         "with FSDP2 only: set fsdp_version: 2 (recipes/accelerate_configs/fsdp.yaml)")
    if mixed_precision is None:
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return fsdp2_accelerator(mixed_precision=mixed_precision, timeout_s=timeout_s, plugin=plugin)
