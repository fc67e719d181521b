"""DeepSpeed ZeRO-2 / ZeRO-3 for `GrownTrainer`: the accelerator, the checks of its config, the step, gathering.

`GrownTrainer` computes an exact token-weighted loss over the global batch and does its own gradient
accumulation. Under DeepSpeed the engine owns the optimizer step, the clipping and the division of
the loss by its `gradient_accumulation_steps`, so:

- `check_deepspeed_config` makes the engine's config agree with the `TrainConfig` (filling `"auto"`
  values, refusing a mismatch or an unsupported setting with a one-line `ValueError`) before any work;
- `engine_backward` back-propagates each micro-batch without the engine's 1/accumulation scaling
  (the trainer's loss already is the global mean) and marks the last one as the accumulation
  boundary, where the engine reduces, clips with `gradient_clipping` and steps;
- `gathered` makes ZeRO-3's partitioned parameters whole where the fallback rule writes them back.

`deepspeed_accelerator` builds the accelerator. On GPUs that is accelerate's own DeepSpeed path; on
CPU processes accelerate 1.16 never selects DeepSpeed (with `cpu=True` it ignores the plugin, without
it the state keeps one process), while DeepSpeed's CPU accelerator runs ZeRO on gloo: the state is
switched to DeepSpeed after the process group is up, as `sharding.fsdp2_accelerator` does for FSDP2.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

ZERO_STAGES = (2, 3)
# Checkpoints hold the trainable set only (as without DeepSpeed): the frozen base is the starting model's.
SAVE_KWARGS = {"exclude_frozen_parameters": True}
LOAD_KWARGS = {"load_module_strict": False}


def disable_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend on plain gloo.

    On CPU, `deepspeed.comm` JIT-compiles a shared-memory all-reduce (`deepspeed_shm_comm`, a C++ build
    of about 10 minutes on first use); it only speeds up collectives.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _gpu_like() -> bool:
    device = getattr(torch, "accelerator", None)  # torch >= 2.6; CUDA alone before
    return device.is_available() if device is not None else torch.cuda.is_available()


def deepspeed_accelerator(*, plugin=None, mixed_precision: str | None = None, timeout_s: int = 1800):
    """An `Accelerator` on accelerate's DeepSpeed path, on GPUs and on CPU processes (gloo) alike.

    Under `accelerate launch --config_file recipes/accelerate_configs/deepspeed/zero2.yaml` (or `zero3.yaml`)
    `GrownTrainer` calls it itself. The plugin defaults to `DeepSpeedPlugin()`, which reads the
    `ACCELERATE_DEEPSPEED_*` variables the launcher sets from the config file.

    Args:
        plugin: A `DeepSpeedPlugin` (default: from the environment). On CPU a second call in the same
            process reuses the first one's plugin, as accelerate does for a second `Accelerator`.
        mixed_precision: `"no"` or `"bf16"`; default: `ACCELERATE_MIXED_PRECISION` or `"no"`.
        timeout_s: Timeout of the process group's collectives.

    Raises:
        `ValueError` when the launch gave a single process on CPU (nothing to partition over).

    Example:
        ```python
        >>> # DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 my_script.py
        >>> acc = deepspeed_accelerator(plugin=DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True))
        >>> result = train(grown, rows, accelerator=acc, max_steps=20)
        ```
    """
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

    disable_shm_comm()
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))]
    mixed_precision = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if _gpu_like():
        acc = Accelerator(mixed_precision=mixed_precision, deepspeed_plugin=plugin, kwargs_handlers=handlers)
    elif AcceleratorState._shared_state.get("distributed_type") == DistributedType.DEEPSPEED:
        # A second accelerator in this process (one engine each): accelerate keeps the first plugin.
        acc = Accelerator(cpu=True, kwargs_handlers=handlers)
    else:
        plugin = plugin or DeepSpeedPlugin()
        # bf16 goes to DeepSpeed's config, not to torch autocast: hence "no" here.
        acc = Accelerator(cpu=True, mixed_precision="no", deepspeed_plugin=plugin, kwargs_handlers=handlers)
        if acc.distributed_type != DistributedType.MULTI_CPU:
            raise ValueError(
                f"deepspeed_accelerator needs several processes on CPU (torchrun or accelerate launch), got {acc.distributed_type}"
            )
        plugin.set_mixed_precision(mixed_precision)
        plugin.select(_from_accelerator_state=True)
        acc.state.deepspeed_plugins = plugin
        acc.state.distributed_type = DistributedType.DEEPSPEED
        # Every later `AcceleratorState()` copies PartialState's fields over its own: set both.
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    if acc.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError(f"deepspeed_accelerator got {acc.distributed_type}, not DeepSpeed: is ACCELERATE_USE_DEEPSPEED set?")
    if not acc.state.deepspeed_plugin.zero3_init_flag:
        # accelerate registers its config with transformers even with zero3_init_flag false, and every
        # later `from_pretrained` in this process would then load partitioned placeholders (zero.Init),
        # which `grow_depth` cannot copy from.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return acc


def _is_auto(value) -> bool:
    return value is None or value == "auto"


def check_deepspeed_config(ds: dict, cfg, *, model: nn.Module, num_processes: int) -> None:
    """Fill the `"auto"` values of DeepSpeed config `ds` from `cfg`; refuse what `GrownTrainer` does not support.

    Called by `GrownTrainer` before any work (before `prepare`, which hands `ds` to `deepspeed.initialize`).
    Every refusal is a one-line `ValueError` that names the setting.

    Example:
        ```python
        >>> ds = {"gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}
        >>> check_deepspeed_config(ds, TrainConfig(gradient_accumulation_steps=2), model=grown, num_processes=2)
        ValueError: DeepSpeed gradient_accumulation_steps=1 but TrainConfig gives 2 (gradient_accumulation_steps): ...
        ```
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() != num_processes:
        # What a plain `Accelerator()` gives on CPU processes under a DeepSpeed launch: each would train alone.
        raise ValueError(f"accelerate counts {num_processes} process(es) but the process group has {torch.distributed.get_world_size()}: "
                         "on CPU let GrownTrainer build the accelerator (deepspeed_support.deepspeed_accelerator)")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        raise ValueError(f"DeepSpeed zero_stage={stage} is not supported by GrownTrainer (ZeRO-2 and ZeRO-3 are); use multi_gpu.yaml (DDP) instead")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device") or "none"
        if device != "none":
            raise ValueError(f"DeepSpeed {key}_device={device!r} is not supported by GrownTrainer (untested); set it to none")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"a DeepSpeed '{key}' section is not supported: GrownTrainer builds its own AdamW and learning-rate schedule")
    if (ds.get("tensor_parallel") or {}).get("autotp_size", 0) > 1:
        raise ValueError("DeepSpeed tensor_parallel.autotp_size > 1 is not supported by GrownTrainer")
    if (ds.get("fp16") or {}).get("enabled") in (True, "true", "auto"):
        raise ValueError("DeepSpeed fp16 (dynamic loss scaling, skipped steps) is not supported by GrownTrainer; use mixed_precision bf16 or no")
    if (ds.get("bf16") or {}).get("enabled") in (True, "true"):
        # DeepSpeed's bf16 casts the module itself: the frozen base would change (be rounded) too.
        wider = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.bfloat16})
        if wider:
            raise ValueError(f"DeepSpeed bf16 casts every weight to bf16, the frozen base included, but the model holds {wider}: "
                             "load it in bfloat16 (--dtype bfloat16) or use mixed_precision no")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("the model is already ZeRO-3 partitioned (zero3_init_flag: true / deepspeed.zero.Init): "
                         "grow_depth needs whole weights; load and grow it with zero3_init_flag: false")

    accum, micro = cfg.gradient_accumulation_steps, cfg.per_device_train_batch_size
    clip = float(cfg.max_grad_norm or 0.0)
    wanted = {
        "gradient_accumulation_steps": accum,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * accum * num_processes,
        "gradient_clipping": clip,
    }
    source = {"gradient_accumulation_steps": "gradient_accumulation_steps", "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
              "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x processes", "gradient_clipping": "max_grad_norm"}
    for key, value in wanted.items():
        if _is_auto(ds.get(key)):
            ds[key] = value
        elif float(ds[key]) != float(value):
            raise ValueError(f"DeepSpeed {key}={ds[key]} but TrainConfig gives {value} ({source[key]}): set them equal, or 'auto' in the DeepSpeed config")
    if stage == 3 and cfg.output_dir and cfg.save_final_model and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        raise ValueError("ZeRO-3 needs zero3_save_16bit_model: true (stage3_gather_16bit_weights_on_model_save) to write the final model; "
                         "set it, or save_final_model false")


def engine_backward(accelerator, loss: torch.Tensor, *, boundary: bool) -> None:
    """Back-propagate one micro-batch through the DeepSpeed engine; on the `boundary` (last) one, step.

    `loss` is already scaled to the global mean (times the process count, which the engine's
    averaging over processes cancels), so the engine's division by its accumulation steps is off.
    At the boundary the engine reduces the gradients, clips them to `gradient_clipping` and applies
    the optimizer (the trainer's `optimizer.step()` / `zero_grad()` are no-ops under accelerate's wrapper).
    """
    engine = accelerator.deepspeed_engine_wrapped.engine
    engine.set_gradient_accumulation_boundary(boundary)
    engine.backward(loss, scale_wrt_gas=False)
    if boundary:
        engine.step()


def grad_norm(accelerator) -> float | None:
    """The global gradient norm (before clipping) of the engine's last optimizer step."""
    norm = accelerator.deepspeed_engine_wrapped.get_global_grad_norm()
    return None if norm is None else float(norm)


def gathered(params, *, modifier_rank: int | None = 0):
    """A context in which ZeRO-3-partitioned `params` are whole; plain parameters get a null context.

    With `modifier_rank=0` what rank 0 writes into them is kept (and re-partitioned) on exit; every
    process must enter it (a collective).
    """
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


def weights_partitioned(accelerator) -> bool:
    """Whether the model's weights are split over the processes (FSDP, ZeRO-3): the final model must then be gathered.

    Under ZeRO-2 every process holds the whole model, which is saved as is (accelerate's gathered
    state dict would also write a tied head as a second copy).
    """
    kind = accelerator.distributed_type
    if kind == "DEEPSPEED":
        return accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    return kind == "FSDP"


def numel(param: torch.Tensor) -> int:
    """Elements of a parameter, also of a ZeRO-3-partitioned one (whose local tensor is empty)."""
    return getattr(param, "ds_numel", param.numel())
