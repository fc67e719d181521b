"""A trial that spans processes: under `--engine ray --workers-per-trial N`, each Tune trial is a Ray Train
`TorchTrainer` of N workers, every one running the package's own `run_trial` on the same spec.

Ray Train sets up the torch process group (gloo on CPU workers, NCCL when the workers ask for GPUs) and the
torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `ACCELERATE_TORCH_DEVICE`) before the
worker function runs, so the `Accelerator` that `GrownTrainer` builds finds a multi-process state: DDP, the
data order split by rank (`DataOrder`), gradients all-reduced every optimizer step. The trial's batch stays the
global batch: each of the N workers takes `batch_size / N` rows of it per step, and the trainer's loss is the
global token-weighted mean, so the optimizer step is the 1-worker step up to float reassociation.
Every rank evaluates; rank 0's `TrialResult` is the trial's (reported to Tune, stored by the driver), and rank
0's checkpoints are the trial's Tune checkpoints: a trial whose worker (or Tune trial) dies is run again by Tune
from the latest, on every worker, and ends as the uninterrupted trial does (`run_on_workers`).

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

import torch

from ..utils import check_int
from .trial import TrialSpec, run_trial

__all__ = ["check_workers", "launch_env", "run_on_workers"]

# The Tune trial itself only waits for its TorchTrainer, so it asks for no CPU: N workers of one CPU each then fit
# on N CPUs (any CPU share for it would leave the workers one short). A placement group bundle may not be empty,
# hence one byte of memory.
DRIVER_RESOURCES = {"cpu": 0, "memory": 1}


def check_workers(cfg) -> None:
    """`workers_per_trial` of a `CompareConfig`, checked before any work: an int >= 1, above 1 only on Ray, dividing the batch."""
    n = cfg.workers_per_trial
    check_int("workers_per_trial", n, 1)
    if n > 1 and cfg.engine != "ray":
        raise ValueError(f"workers_per_trial {n} needs engine 'ray' (a trial spans processes as a Ray Train TorchTrainer), but engine is {cfg.engine!r}")
    if cfg.batch_size % n:
        raise ValueError(f"batch_size {cfg.batch_size} does not split over {n} workers per trial: each worker takes batch_size / {n} rows per step")
    path = getattr(cfg, "accelerate_config", None)
    if path is not None:
        if n < 2:
            raise ValueError(f"accelerate_config {path} sets up the workers of a multi-process trial: it needs workers_per_trial >= 2, got {n}")
        sharded = _sharding(launch_env(path, n)) is not None
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


def run_on_workers(spec: TrialSpec, shipped: list, resources: dict, workers: int, launch: dict | None, *, start, checkpoint) -> str:
    """Run `spec` as a TorchTrainer of `workers` processes of `resources` each; rank 0's packed `TrialResult` back.

    Every worker starts from the `TrialCheckpoint` `start` (or from the trial's start), and rank 0's checkpoints (which
    continue every rank of a DDP trial, `comparison.trial_checkpoint`) are handed to `checkpoint` here, in the Tune
    trial, as they come. `launch`: an accelerate config's variables.
    """
    import threading

    import ray
    from ray import train
    from ray.train.torch import TorchTrainer

    # Rank 0 hands its checkpoints and result to this actor: Ray Train would keep a worker's metrics only with a
    # checkpoint of its own, in storage shared across nodes (no CPU: the workers hold them all).
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
    failed: list[BaseException] = []
    try:
        trainer = TorchTrainer(
            _worker, train_loop_config={"spec": spec, "shipped": shipped, "threads": cpus, "mailbox": mailbox, "sharding": _sharding(env),
                                        "start": start},
            scaling_config=train.ScalingConfig(num_workers=workers, use_gpu=bool(gpus), resources_per_worker=per_worker),
            # A worker that dies fails the trial; Tune's FailureConfig runs it again from its latest checkpoint.
            run_config=train.RunConfig(name=f"{spec.name}".replace("@", "_"), storage_path=storage, worker_runtime_env={"env_vars": env},
                                       failure_config=train.FailureConfig(max_failures=0)),
        )
        # fit() blocks until the workers end: in a thread, so that rank 0's checkpoints reach Tune as they come.
        fit = threading.Thread(target=lambda: _catch(trainer.fit, failed), daemon=True)
        fit.start()
        running = True
        while running:
            fit.join(timeout=0.2)
            running = fit.is_alive()  # read before taking: the last take comes after the workers' last put
            for taken in ray.get(mailbox.take_checkpoints.remote()):
                checkpoint(taken)
        if failed:
            raise failed[0]
        return ray.get(mailbox.take.remote())
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        ray.kill(mailbox)


def _catch(fn, failed: list) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - raised again in the trial's own thread
        failed.append(err)


def _sharding(env: dict) -> str | None:
    """The `DistributedType` value an accelerate config's variables ask for, where it shards (else `None`: DDP)."""
    if env.get("ACCELERATE_USE_FSDP") == "true":
        return "FSDP"
    return "DEEPSPEED" if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else None


class _Mailbox:
    """Holds rank 0's checkpoints (until the trial's driver reports them to Tune) and its packed `TrialResult`."""

    def __init__(self):
        self.packed, self.checkpoints = None, []

    def put(self, packed: str) -> None:
        self.packed = packed

    def put_checkpoint(self, checkpoint) -> None:
        self.checkpoints.append(checkpoint)

    def take_checkpoints(self) -> list:
        out, self.checkpoints = self.checkpoints, []
        return out

    def take(self) -> str:
        if self.packed is None:
            raise RuntimeError("the trial's workers finished without rank 0's result")
        return self.packed


def _worker(config: dict) -> None:
    """One of the trial's processes: `run_trial` on its share of every global batch; rank 0 reports the result."""
    import ray
    from ray import train

    from .trial_record import result_text

    torch.set_num_threads(config["threads"])
    context = train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    mailbox = config["mailbox"]
    # The trial's batch is the global one: TrainConfig's per-device batch is its share (DataOrder gives rank r
    # the r-th slice of the same seeded global batch), so N workers step as one process with the whole batch.
    inputs = received(config["shipped"])
    inputs = dataclasses.replace(inputs, batch_size=inputs.batch_size // world)
    keep = (lambda taken: ray.get(mailbox.put_checkpoint.remote(taken))) if rank == 0 else None
    result = run_trial(config["spec"], inputs, checkpoint=keep, resume=config["start"])
    from accelerate.state import AcceleratorState, PartialState

    seen = PartialState().num_processes
    ran = getattr(AcceleratorState._shared_state.get("distributed_type"), "value", None)  # what the trial's Accelerator ran
    if seen != world:  # each worker would have trained alone on its share: a different trial, refused
        raise RuntimeError(f"Accelerate ran {seen} process(es) in a trial of {world} Ray Train workers: the process group was not picked up")
    if config["sharding"] is not None and config["sharding"] != ran:  # e.g. accelerate running DDP for an FSDP plugin on CPU
        raise RuntimeError(f"the trial's accelerate_config asks for {config['sharding']}, but its workers ran {ran}")
    if rank == 0:  # every rank holds the same trained model and scores; rank 0's is the trial's
        ray.get(mailbox.put.remote(result_text(result)))


_RECEIVED: dict = {}  # this process's copy of a sweep's shared inputs, by object reference


def received(shipped: list):
    """The value `tune_units` put into Ray's object store, read once per process: every later trial a reused trial
    process runs gets the same object (trials only read their inputs), not another copy deserialised from the store."""
    import ray

    key = shipped[0].hex()
    if key not in _RECEIVED:
        _RECEIVED.clear()  # one sweep's inputs at a time
        _RECEIVED[key] = ray.get(shipped[0])
    return _RECEIVED[key]


def check_resources(ray, resources: dict, workers: int = 1) -> None:
    """A trial (of `workers` processes of `resources` each) the cluster cannot place would wait forever: refused up
    front, naming what is missing."""
    have = ray.cluster_resources()
    for k, v in resources.items():
        total, what = have.get(k.upper(), 0), k.upper()
        if v * workers > total:
            ask = f"asks {v:g} {what} per trial" if workers == 1 else f"{workers} workers per trial with {v:g} {what} each need {v * workers:g} {what}"
            raise ValueError(f"{'resources_per_trial ' if workers == 1 else ''}{ask}, but the Ray cluster has {total:g}")
