"""A trial that spans processes: under `--engine ray --workers-per-trial N`, each Tune trial is a Ray Train
`TorchTrainer` of N workers, every one running the package's own `run_trial` on the same spec.

Ray Train sets up the torch process group (gloo on CPU workers, NCCL when the workers ask for GPUs) and the
torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `ACCELERATE_TORCH_DEVICE`) before the
worker function runs, so the `Accelerator` that `GrownTrainer` builds finds a multi-process state: DDP, the
data order split by rank (`DataOrder`), gradients all-reduced every optimizer step. The trial's batch stays the
global batch: each of the N workers takes `batch_size / N` rows of it per step, and the trainer's loss is the
global token-weighted mean, so the optimizer step is the 1-worker step up to float reassociation.
Every rank evaluates; rank 0's `TrialResult` is the trial's (reported to Tune, stored by the driver).

The inputs (base model, rows) go into Ray's object store once per sweep; the Tune trial (a small driver that
only starts the `TorchTrainer`) passes their reference on, and each worker reads them from there once
(benchmarks/bench_ray_workers.py measures what that costs per worker).

Example:
    ```python
    >>> results = run_ray(specs, inputs, workers_per_trial=2)  # every trial: 2 gloo processes, DDP
    ```
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time

import torch

from .trial import TrialInputs, TrialSpec, run_trial

__all__ = ["check_workers", "worker_trainable"]

# The Tune trial itself only waits for its TorchTrainer, so it asks for no CPU: N workers of one CPU each then fit
# on N CPUs (any CPU share for it would leave the workers one short). A placement group bundle may not be empty,
# hence one byte of memory.
DRIVER_RESOURCES = {"cpu": 0, "memory": 1}


def check_workers(cfg) -> None:
    """`workers_per_trial` of a `CompareConfig`, checked before any work: an int >= 1, above 1 only on Ray, dividing the batch."""
    n = cfg.workers_per_trial
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"workers_per_trial must be an int >= 1, got {n!r}")
    if n > 1 and cfg.engine != "ray":
        raise ValueError(f"workers_per_trial {n} needs engine 'ray' (a trial spans processes as a Ray Train TorchTrainer), but engine is {cfg.engine!r}")
    if cfg.batch_size % n:
        raise ValueError(f"batch_size {cfg.batch_size} does not split over {n} workers per trial: each worker takes batch_size / {n} rows per step")
    path = getattr(cfg, "accelerate_config", None)
    if path is not None:
        if n < 2:
            raise ValueError(f"accelerate_config {path} sets up the workers of a multi-process trial: it needs workers_per_trial >= 2, got {n}")
        env = launch_env(path, n)
        sharded = env.get("ACCELERATE_USE_FSDP") == "true" or env.get("ACCELERATE_USE_DEEPSPEED") == "true"
        lora = [c for c in cfg.controls if str(c).split(":")[0] == "lora"]
        if sharded and lora:
            raise ValueError(f"accelerate_config {path} shards the model, and the trainer trains LoRA ({', '.join(lora)}) only unsharded: "
                             "drop those controls or use a DDP config")


def launch_env(path, workers: int) -> dict[str, str]:
    """The `ACCELERATE_*` / `FSDP_*` variables `accelerate launch --config_file path --num_processes workers` gives its
    processes, read by accelerate's own launcher code (the same parsing and defaults), minus what Ray Train sets itself
    (ranks, addresses, threads). `ValueError` (one line) for a missing or unreadable file, or one for a single process.

    Example:
        ```python
        >>> launch_env("recipes/accelerate_configs/fsdp.yaml", 2)["FSDP_VERSION"]
        '2'
        ```
    """
    import contextlib
    import io
    import os

    from ..utils import kind_of, read_structured

    if not os.path.isfile(path):
        raise ValueError(f"accelerate_config {path}: no such file")
    # Read here first: accelerate's loader gives a traceback for a file that is not a mapping (`'str' object has no attribute 'get'`).
    expected = "a mapping of accelerate settings (`accelerate config` writes one)"
    data = read_structured(path, expected=expected, label="accelerate_config")
    if not isinstance(data, dict) or not data:
        raise ValueError(f"accelerate_config {path}: expected {expected}, got {kind_of(data) if data != {} else 'an empty mapping'}")
    # `_validate_launch_command` is private, but it is where accelerate turns a config file into launch arguments (its
    # defaults, the FSDP/DeepSpeed fields); a hand-written reader would drift from what `accelerate launch` does.
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", str(path), "--num_processes", str(workers), "--num_machines", "1", "--main_process_port", "0", "trial.py"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the launcher's notes
            args, defaults, precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
            if args.use_deepspeed:  # as accelerate's launch_command hands the config's DeepSpeed fields on
                fields = list(defaults.deepspeed_config) if defaults else []
                args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if precision_from_config else []))
                env = prepare_deepspeed_cmd_env(args)[1]
            elif args.use_fsdp or args.multi_gpu or args.cpu:
                env = prepare_multi_gpu_env(args)
            else:
                raise ValueError("it sets up a single process (distributed_type NO)")
    except (ValueError, KeyError, TypeError, OSError, SystemExit) as err:
        raise ValueError(f"accelerate_config {path}: not a multi-process accelerate config ({str(err).strip() or type(err).__name__})") from None
    # Ray Train owns the process group and the threads; the config's mixed precision and sharding are what it adds.
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v and k != "ACCELERATE_USE_CPU"}


def worker_trainable(specs: list[TrialSpec], inputs: TrialInputs, resources: dict, workers: int, accelerate_config=None):
    """`(trainable, trial resources)` for Tune: a trial that runs `specs[config["index"]]` as a TorchTrainer of `workers` processes.

    `resources` are each worker's (`{"cpu": c}`, optionally `"gpu"`); the trial itself asks `DRIVER_RESOURCES`.
    `accelerate_config`: a config file whose launch variables (`launch_env`, read here on the driver) every worker gets.
    """
    import ray
    from ray import tune

    check_resources(ray, resources, workers)
    # In a list, so that Tune hands the trial the reference and not the model: only the workers read it.
    shipped = [ray.put(inputs)]
    launch = launch_env(accelerate_config, workers) if accelerate_config is not None else {}
    trainable = tune.with_parameters(_trial, specs=specs, shipped=shipped, resources=dict(resources), workers=workers, launch=launch)
    return trainable, dict(DRIVER_RESOURCES)


def _trial(config: dict, specs: list[TrialSpec], shipped: list, resources: dict, workers: int, launch: dict | None = None) -> None:
    """One Tune trial: a TorchTrainer of `workers` processes on one spec; rank 0's packed result reported to Tune."""
    import ray
    from ray import train, tune
    from ray.train.torch import TorchTrainer

    spec = specs[config["index"]]
    # Ray Train keeps a worker's metrics only with a checkpoint; rank 0 hands its result to this actor instead
    # (no CPU: the workers hold them all; no storage shared across nodes needed).
    mailbox = ray.remote(num_cpus=0)(_Mailbox).remote()
    cpus, gpus = max(1, int(resources["cpu"])), resources.get("gpu", 0)
    per_worker = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    # OMP_NUM_THREADS: else Accelerate sets a CPU worker's threads to the node's cores / workers. On CPU workers,
    # ACCELERATE_USE_CPU (what `accelerate launch --cpu` sets): without it Accelerate sees no accelerator and runs each
    # worker as a lone process (DistributedType.NO) despite the process group; and CUDA_VISIBLE_DEVICES hidden from
    # the start, since Ray leaves it alone for a worker that asked for no GPU (every CPU trial would use GPU 0).
    env = {**(launch or {}), "OMP_NUM_THREADS": str(cpus)}  # an accelerate config's FSDP / DeepSpeed set-up first
    if not gpus:
        env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
    storage = tempfile.mkdtemp(prefix="hf_depthgrow-train-")  # Ray Train's run state; nothing is checkpointed there
    started = time.perf_counter()
    try:
        trainer = TorchTrainer(
            _worker, train_loop_config={"spec": spec, "shipped": shipped, "threads": cpus, "mailbox": mailbox, "sharding": _sharding(env)},
            scaling_config=train.ScalingConfig(num_workers=workers, use_gpu=bool(gpus), resources_per_worker=per_worker),
            # A worker that dies fails the trial; Tune's FailureConfig runs the whole trial again (it is deterministic).
            run_config=train.RunConfig(name=f"{spec.name}".replace("@", "_"), storage_path=storage, worker_runtime_env={"env_vars": env},
                                       failure_config=train.FailureConfig(max_failures=0)),
        )
        trainer.fit()
        packed = ray.get(mailbox.take.remote())
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        ray.kill(mailbox)
    tune.report({"trial": packed, "seconds": time.perf_counter() - started, "workers": workers})


def _sharding(env: dict) -> str | None:
    """The `DistributedType` value an accelerate config's variables ask for, where it shards (else `None`: DDP)."""
    if env.get("ACCELERATE_USE_FSDP") == "true":
        return "FSDP"
    return "DEEPSPEED" if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else None


class _Mailbox:
    """Holds rank 0's packed `TrialResult` until the trial's driver takes it."""

    def __init__(self):
        self.packed = None

    def put(self, packed: str) -> None:
        self.packed = packed

    def take(self) -> str:
        if self.packed is None:
            raise RuntimeError("the trial's workers finished without rank 0's result")
        return self.packed


def _worker(config: dict) -> None:
    """One of the trial's processes: `run_trial` on its share of every global batch; rank 0 reports the result."""
    import ray
    from ray import train

    from .trial import result_text

    torch.set_num_threads(config["threads"])
    context = train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    inputs = ray.get(config["shipped"][0])
    # The trial's batch is the global one: TrainConfig's per-device batch is its share (DataOrder gives rank r
    # the r-th slice of the same seeded global batch), so N workers step as one process with the whole batch.
    inputs = dataclasses.replace(inputs, batch_size=inputs.batch_size // world)
    result = run_trial(config["spec"], inputs)
    from accelerate.state import AcceleratorState, PartialState

    seen = PartialState().num_processes
    ran = getattr(AcceleratorState._shared_state.get("distributed_type"), "value", None)  # what the trial's Accelerator ran
    if seen != world:  # each worker would have trained alone on its share: a different trial, refused
        raise RuntimeError(f"Accelerate ran {seen} process(es) in a trial of {world} Ray Train workers: the process group was not picked up")
    if config["sharding"] is not None and config["sharding"] != ran:  # e.g. accelerate running DDP for an FSDP plugin on CPU
        raise RuntimeError(f"the trial's accelerate_config asks for {config['sharding']}, but its workers ran {ran}")
    if rank == 0:  # every rank holds the same trained model and scores; rank 0's is the trial's
        ray.get(config["mailbox"].put.remote(result_text(result)))


def check_resources(ray, resources: dict, workers: int = 1) -> None:
    """A trial (of `workers` processes of `resources` each) the cluster cannot place would wait forever: refused up
    front, naming what is missing."""
    have = ray.cluster_resources()
    for k, v in resources.items():
        total, what = have.get(k.upper(), 0), k.upper()
        if v * workers > total:
            ask = f"asks {v:g} {what} per trial" if workers == 1 else f"{workers} workers per trial with {v:g} {what} each need {v * workers:g} {what}"
            raise ValueError(f"{'resources_per_trial ' if workers == 1 else ''}{ask}, but the Ray cluster has {total:g}")
