"""Trials on Ray Tune: the same results as the serial engine, several trials at once, on one machine or a cluster.

`run_ray(specs, inputs)` has `run_serial`'s contract (results in the specs' order, each what `run_trial` gives:
bit-identical per-example losses on CPU fp32 at the same number of torch threads). Each spec is one Tune trial
(`tune_units`: the `TrialInputs` shipped once per sweep, a trial whose process dies run again from its last
checkpoint) that runs `run_trial` in its own process or, with `workers_per_trial` above 1, on a Ray Train
`TorchTrainer` of that many (`comparison.ray_workers`). A trial reports a Tune checkpoint
(`comparison.trial_checkpoint`) after each budget and rung it scores, so a retried trial ends bit-identical to the
uninterrupted one on CPU fp32. With a `TrialStore` the driver stores each trial as it finishes
(`store.stored_or_run`) and keeps each unfinished trial's latest checkpoint under `trials_dir`, so that
`compare --resume` after the driver itself died continues it from there.

Successive halving stays serial-only: Ray's ASHA decides a trial at a rung against the trials that reached
that rung before it, so its choice depends on which trial finishes first; the serial halving ranks all of an
arm's rates at each rung together (Tune's synchronous HyperBand, keeping `n / eta` of a bracket and pausing trials
through checkpoints, is another rule again). Under Ray, halving is refused with one line rather than made different.

Ray stays optional: nothing here imports it until a trial runs (`pip install "hf_depthgrow[ray]"`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import socket
import tempfile
import uuid
import warnings

import torch

from ..utils import check_int
from .ray_workers import DRIVER_RESOURCES, check_resources, launch_env, received, run_on_workers
from .trial import TrialInputs, TrialResult, TrialSpec, run_trial
from .trial_record import result_from_text, result_text

logger = logging.getLogger(__name__)

__all__ = ["ENGINES", "RAY_EXTRA", "check_engine", "quiet_fit", "ray_cluster", "run_ray", "trial_process", "tune_units"]

ENGINES = ("serial", "ray", "stored")
RAY_EXTRA = 'pip install "hf_depthgrow[ray]"'
HALVING_REFUSED = (
    "successive_halving runs on the serial engine only: Ray's ASHA stops a trial against the trials that reached "
    "its rung first, so it would not reproduce the serial choice (drop --successive-halving or use --engine serial)"
)
_CONNECT_TIMEOUT_S = 5.0
_MEMORY_KILL = "killed due to the node running low on memory"  # Ray's memory monitor, in the error Tune raises


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def check_engine(cfg) -> None:
    """`CompareConfig`'s (or `StudyConfig`'s) engine settings, checked before any work (Ray is looked for, not imported)."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {cfg.engine!r}")
    if cfg.max_concurrent_trials is not None:
        check_int("max_concurrent_trials", cfg.max_concurrent_trials, 1)
        # As ray_address: a Ray Tune setting that the serial engine would silently ignore (one trial at a time).
        if cfg.engine != "ray":
            raise ValueError(f"max_concurrent_trials is a Ray Tune setting, but engine is {cfg.engine!r} (one trial at a time, "
                             "here): use engine='ray' or drop it")
    check_int("resources_per_trial", cfg.resources_per_trial, 1)
    if cfg.ray_address is not None:
        if cfg.engine != "ray":
            raise ValueError(f"ray_address is for engine 'ray', but engine is {cfg.engine!r}")
        _parse_address(cfg.ray_address)
    if cfg.engine == "ray":
        if not ray_available():
            raise ValueError(f"engine 'ray' needs Ray, which is not installed: {RAY_EXTRA}")
        if getattr(cfg, "successive_halving", False):  # the scaling study has no halving
            raise ValueError(HALVING_REFUSED)


def run_ray(
    specs: list[TrialSpec],
    inputs: TrialInputs,
    *,
    halving: bool = False,
    bar=None,
    address: str | None = None,
    max_concurrent_trials: int | None = None,
    resources_per_trial: int | dict | None = None,
    storage: str | None = None,
    store=None,
    max_failures: int = 2,
    workers_per_trial: int = 1,
    accelerate_config: str | None = None,
) -> list[TrialResult]:
    """Run `specs` as Ray Tune trials; results in the specs' order, equal to `run_serial`'s.

    Args:
        specs, inputs: As for `run_serial`.
        halving: Refused (see the module docstring): successive halving is serial-only.
        bar: A tqdm bar, advanced as each trial finishes.
        address: The Ray cluster (`host:port`, `ray://host:port` or `auto`); `None`: a local instance (or
            `RAY_ADDRESS`). A Ray already initialised in this process is used as it is.
        max_concurrent_trials: Trials at once (`None`: as many as the resources allow).
        resources_per_trial: CPUs per trial (an int, default 1; also the trial's torch threads), or a dict
            such as `{"cpu": 4, "gpu": 1}`.
        storage: Tune's `storage_path` (a shared folder or `s3://...` on a multi-node cluster); `None`: a
            temporary folder, removed after the run (the results are returned, and stored with `store`).
        store: A `TrialStore`: stored trials are reused, and each new one is stored as it finishes.
        max_failures: Times a failed trial (its process killed, say) is run again from its last checkpoint.
        workers_per_trial: Processes per trial: above 1, each trial is a Ray Train `TorchTrainer` of that many
            workers, each with `resources_per_trial` (`comparison.ray_workers`).
        accelerate_config: With `workers_per_trial` above 1, an accelerate config file (FSDP2, DeepSpeed ZeRO) the
            workers are set up by, as `accelerate launch --config_file` would (`ray_workers.launch_env`); default DDP.

    Example:
        ```python
        >>> results = run_ray([TrialSpec(arm, lr, 0, (20,)) for lr in (1e-3, 3e-3)], inputs, max_concurrent_trials=2)
        >>> [r.spec.learning_rate for r in results]
        [0.001, 0.003]
        ```
    """
    if halving:
        raise ValueError(HALVING_REFUSED)
    if accelerate_config is not None and workers_per_trial < 2:
        raise ValueError(f"accelerate_config {accelerate_config} sets up the workers of a multi-process trial: it needs workers_per_trial >= 2")
    from .store import stored_or_run

    resources = _resources(resources_per_trial)
    use_store = store if store is not None and store.enabled else None

    def tune(todo):
        with ray_cluster(address, resources, workers_per_trial):
            return _tune(todo, inputs, resources, max_concurrent_trials, storage, max_failures, use_store, bar, workers_per_trial,
                         accelerate_config).values()

    return stored_or_run(use_store, specs, tune, bar=bar)


# --------------------------------------------------------------------------- the cluster


def _parse_address(address) -> tuple[str, int] | None:
    """`(host, port)` of `host:port` / `ray://host:port`; `None` for `auto`; anything else is refused."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"ray_address must be host:port, ray://host:port or auto, got {address!r}")
    if address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ray_address must be host:port, ray://host:port or auto, got {address!r}")
    return host, int(port)


def _connect(ray, address: str | None) -> bool:
    """Join (or start) Ray; `True` when this call started it (then the caller shuts it down)."""
    where = _parse_address(address) if address is not None else None
    if where is not None:
        # ray.init retries an unreachable head for a minute or more; a plain TCP connect says it in seconds.
        try:
            socket.create_connection(where, timeout=_CONNECT_TIMEOUT_S).close()
        except OSError as err:
            raise ValueError(f"ray_address {address}: no Ray cluster reachable there ({err.strerror or err})") from None
    if ray.is_initialized():  # the caller's own ray.init (a notebook, the tests) is used as it is
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception when its node times out starting up
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if address is None:
            raise ValueError(f"Ray could not start a local instance ({first})") from None
        raise ValueError(f"ray_address {address}: could not join the Ray cluster ({first})") from None
    return True


@contextlib.contextmanager
def ray_cluster(address: str | None, resources_per_trial=None, workers: int = 1):
    """Ray joined (or started: then shut down at the end), yielding the resources per trial (per worker of a trial of
    `workers` processes) it was checked to give.

    What every sweep on Ray does first (`run_ray`, the scaling study's cells): an unreachable address or
    resources the cluster cannot give are a `ValueError` naming them, before any trial starts.

    Example:
        ```python
        >>> with ray_cluster(None, 1) as resources:
        ...     resources
        {'cpu': 1}
        ```
    """
    import ray

    resources = _resources(resources_per_trial)
    started = _connect(ray, address)
    try:
        check_resources(ray, resources, workers)
        yield resources
    finally:
        if started:
            ray.shutdown()


def _resources(resources_per_trial) -> dict:
    if resources_per_trial is None:
        return {"cpu": 1}
    if isinstance(resources_per_trial, dict):
        out = {str(k).lower(): v for k, v in resources_per_trial.items()}
        out.setdefault("cpu", 1)
    else:
        out = {"cpu": resources_per_trial}
    for k, v in out.items():
        if k not in ("cpu", "gpu") or not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (k == "cpu" and v < 1):
            raise ValueError(f"resources_per_trial: {k}={v!r} is not a count of CPUs (>= 1) or GPUs (>= 0)")
    return out


# --------------------------------------------------------------------------- the trials


def _trial(spec: TrialSpec, shipped: list, *, workers: int = 1, resources: dict | None = None, launch: dict | None = None,
           resume: dict | None = None) -> dict:
    """One trial (`tune_units`' work): `run_trial` on `spec`, in this process or on `workers` processes (a Ray Train
    `TorchTrainer`, `ray_workers.run_on_workers`), reporting a Tune checkpoint after each budget and rung either way.

    It starts from Tune's checkpoint (a retry after its process died), else from `resume[name]` (`--resume`).
    """
    from ray import tune

    restored = tune.get_checkpoint()
    start = _loaded(restored) if restored is not None else (resume or {}).get(spec.name)
    report = functools.partial(_report_checkpoint, tune)
    if workers > 1:
        packed = run_on_workers(spec, shipped, resources, workers, launch, start=start, checkpoint=report)
    else:
        packed = result_text(run_trial(spec, received(shipped), checkpoint=report, resume=start))
    return {"trial": packed, "resumed_from": start.step if start is not None else 0}


def _loaded(checkpoint):
    """A Tune checkpoint's folder read into memory as a `TrialCheckpoint` (its digest checked)."""
    from .trial_checkpoint import TrialCheckpoint

    with checkpoint.as_directory() as folder:
        return TrialCheckpoint.load(folder)


def _report_checkpoint(tune, checkpoint) -> None:
    """Hand a `TrialCheckpoint` to Tune, which copies its folder into the experiment's storage before this returns."""
    with tempfile.TemporaryDirectory(prefix="hf_depthgrow-ckpt-") as tmp:
        folder = checkpoint.save(os.path.join(tmp, "trial"))
        tune.report({"checkpoint_step": checkpoint.step}, checkpoint=tune.Checkpoint.from_directory(str(folder)))


def _shippable(inputs: TrialInputs) -> TrialInputs:
    """The inputs as a trial sees them elsewhere: a relative tracker folder made absolute (Tune moves into the trial's
    folder), and rows whose tensors view a larger storage (blocks cut from one token stream by `view`) made compact:
    pickling a view writes its whole storage, so 38,702 such rows of one 40 MB stream would have shipped 1.5 TB."""
    tracking = dict(inputs.tracking)
    if tracking.get("logging_dir"):
        tracking["logging_dir"] = os.path.abspath(tracking["logging_dir"])
    rows = {k: _compact(getattr(inputs, k)) for k in ("train_rows", "eval_rows", "test_rows", "retention_rows")}
    return dataclasses.replace(inputs, tracking=tracking, **rows)


def _compact(rows):
    """`rows` (a list of row dicts) with every tensor that views a larger storage cloned; a tensor shared by several
    rows stays shared (one clone). Anything else is returned as it is."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return rows
    clones: dict[int, torch.Tensor] = {}

    def compact(value):
        if not torch.is_tensor(value) or value.untyped_storage().nbytes() <= value.nbytes:
            return value
        if id(value) not in clones:
            clones[id(value)] = value.clone()
        return clones[id(value)]

    out = [{k: compact(v) for k, v in row.items()} for row in rows]
    return out if clones else rows


def _tune(specs, inputs, resources, max_concurrent, storage, max_failures, store, bar, workers=1, accelerate_config=None) -> dict[str, TrialResult]:
    # --resume: each unfinished trial's checkpoint, read on the driver and shipped (no shared folder needed).
    resume = {s.name: c for s in specs if store is not None and (c := store.resume_point(s)) is not None}
    launch, threads, trial_resources = None, max(1, int(resources["cpu"])), resources
    if workers > 1:  # the Tune trial only waits for its TorchTrainer's workers (comparison.ray_workers)
        launch = launch_env(accelerate_config, workers) if accelerate_config is not None else {}
        threads, trial_resources = 1, dict(DRIVER_RESOURCES)
    work = functools.partial(_trial, workers=workers, resources=resources, launch=launch, resume=resume)

    def keep(index, reported):
        spec = specs[index]
        done = result_from_text(spec, reported["trial"])
        if reported.get("resumed_from"):
            logger.info("trial %s continued from its checkpoint at step %d", spec.name, reported["resumed_from"])
        if store is not None:
            store.keep(done)
        if bar is not None:
            bar.set_postfix_str(spec.name)
            bar.update(1)
        return done

    def checkpointed(index, checkpoint):
        if store is None:
            return
        try:  # kept beside the stored trials, for --resume; a failure here must not stop Tune registering it
            store.save_checkpoint(specs[index], _loaded(checkpoint))
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"trial {specs[index].name}: its checkpoint was not kept under {store.root} ({err}); --resume would start it over", stacklevel=2)

    done = tune_units(work, specs, _shippable(inputs), trial_resources, [s.name for s in specs], what="trial", keep=keep, threads=threads,
                      max_concurrent=max_concurrent, storage=storage, max_failures=max_failures, on_checkpoint=checkpointed)
    return {specs[i].name: result for i, result in done.items()}


def tune_units(work, units: list, shared, resources: dict, names: list[str], *, what: str, keep, threads: int = 1, max_concurrent=None,
               storage=None, max_failures=2, on_checkpoint=None) -> dict:
    """Every sweep's Tune driver (compare's trials, the scaling study's cells): one Tune trial per unit, each returning
    `work(units[i], shipped)` to Tune as its final report, which holds the unit's result under the key `what`.

    `shared` (the model, the rows, the task data) goes into Ray's object store once (`shipped`, a list holding its
    reference: `received(shipped)` reads it); a trial process, reused from unit to unit, reads it once for them all.
    Each trial has `resources`, `threads` torch threads, and CUDA hidden unless it asks for a GPU (`trial_process`).
    On the driver, `keep(index, metrics)` takes each unit's final report as it arrives (storing it, so an interrupted
    sweep keeps every finished unit) and `on_checkpoint(index, checkpoint)` each checkpoint a unit reports; a unit
    whose process dies runs again from its last checkpoint (its start before one), at most `max_failures` times.
    Tune prints nothing (`quiet_fit`). Returns `{index: what keep returned}`; a unit that failed every retry is a
    `RuntimeError` naming it.
    """
    import ray
    from ray import tune

    # In a list, so that Tune hands each trial the reference, not the value: `received` reads it once per process.
    trainable = tune.with_parameters(_trainable, work=work, units=units, shipped=[ray.put(shared)], threads=threads,
                                     gpus=resources.get("gpu", 0))
    collect = _collector(names, what, keep, on_checkpoint)
    if storage and "://" not in storage:  # Tune wants a local folder absolute; a URI (`s3://...`) stays as it is
        storage = os.path.abspath(storage)
    with tempfile.TemporaryDirectory(prefix="hf_depthgrow-ray-") as tmp:
        tuner = tune.Tuner(
            tune.with_resources(trainable, resources),
            param_space={"index": tune.grid_search(list(range(len(names))))},
            # A trial process spends ~15 s importing torch and transformers: reused for the next unit, not restarted.
            tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent, reuse_actors=True),
            run_config=tune.RunConfig(
                name=f"hf_depthgrow-{uuid.uuid4().hex[:8]}", storage_path=storage or tmp,
                failure_config=tune.FailureConfig(max_failures=max_failures), verbose=0, callbacks=[collect],
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),  # a retry needs only the latest
            ),
        )
        try:
            grid = quiet_fit(tuner.fit)
        except Exception as err:  # noqa: BLE001 - Tune re-raises a kill by Ray's memory monitor as a bare RuntimeError
            if _MEMORY_KILL not in str(err):
                raise
            first = " ".join(str(err).split()).removeprefix("Caught unexpected exception: ").split(". Memory on the node")[0]
            # Tune gives up on the whole run here, retries left or not.
            raise MemoryError(f"{first}: run fewer {what}s at once (max_concurrent_trials) or give each more CPUs (resources_per_trial); "
                              f"with a trials folder every {what} that finished is kept, and a resume goes on from there") from None
    done = collect.done
    for r in grid:
        index = r.config["index"]
        if index not in done and r.error is not None:
            first = (str(r.error).strip().splitlines() or [type(r.error).__name__])[-1]
            raise RuntimeError(f"{what} {names[index]} failed under Ray ({max_failures} retries): {first}") from r.error
        if index not in done and what in (r.metrics or {}):
            done[index] = keep(index, r.metrics)
    missing = [n for i, n in enumerate(names) if i not in done]
    if missing:
        raise RuntimeError(f"Ray returned no result for {', '.join(missing)}")
    return done


def _trainable(config: dict, work, units: list, shipped: list, threads: int, gpus: float) -> None:
    """The one Tune trainable: `work` on the unit at `config["index"]`, its return value the trial's final report."""
    from ray import tune

    trial_process(threads, gpus)
    tune.report(work(units[config["index"]], shipped))


def trial_process(threads: int, gpus: float) -> None:
    """What every Tune trial does first: `threads` torch threads (the serial engine's count: a reduction over other
    threads rounds differently), and, without a GPU asked for, CUDA hidden: Ray leaves CUDA_VISIBLE_DEVICES alone
    for such a trial, which would then train on GPU 0 beside every other one."""
    torch.set_num_threads(threads)
    if not gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _collector(names: list[str], what: str, keep, on_checkpoint=None):
    """`tune_units`' Tune callback on the driver: each unit's final report handed to `keep` as it arrives."""
    from ray.tune import Callback

    class Collect(Callback):
        def __init__(self):
            self.done: dict = {}
            self.checkpointed: dict[int, int] = {}  # the step of each unit's latest checkpoint

        def on_trial_recover(self, iteration, trials, trial, **info):
            index = trial.config["index"]
            step = self.checkpointed.get(index)
            where = f"its checkpoint at step {step}" if step is not None else "its start"
            warnings.warn(f"{what} {names[index]} failed ({trial.num_failures} time(s)): Ray runs it again from {where}", stacklevel=2)

        def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
            if on_checkpoint is not None and trial.config["index"] not in self.done:
                on_checkpoint(trial.config["index"], checkpoint)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            index = trial.config["index"]
            if result.get("checkpoint_step") is not None:
                self.checkpointed[index] = result["checkpoint_step"]
            if what in result and index not in self.done:
                self.done[index] = keep(index, result)

    return Collect()


def _not_the_snapshot_advice(record) -> bool:
    # Tune snapshots its state whenever a trial checkpoints past `num_to_keep`; with 1 (all a retry needs) it does
    # so at every budget of every trial and, each time within 5 s of another, advises fewer checkpoints.
    return not record.getMessage().startswith("Experiment state snapshotting has been triggered")


# Tune's new output engine prints, even at verbose 0, where its results are and a TensorBoard command for them: a
# temporary folder here, removed after the run. Its legacy engine at verbose 0 prints nothing. (Its per-trial result
# files stay: the result grid reads them back, and warns, naming the folder, where they are missing.)
_TUNE_OUTPUT = "RAY_AIR_NEW_OUTPUT"


def quiet_fit(fit):
    """`fit()` with Tune's printing off (anything it still prints goes to stderr) and its info logs off: the command's
    stdout is its report, and its stderr names no folder that is gone when the run ends."""
    import sys

    tune_log, snapshots = logging.getLogger("ray.tune"), logging.getLogger("ray.tune.execution.experiment_state")
    level, output = tune_log.level, os.environ.get(_TUNE_OUTPUT)
    tune_log.setLevel(logging.WARNING)
    snapshots.addFilter(_not_the_snapshot_advice)
    os.environ[_TUNE_OUTPUT] = "0"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return fit()
    finally:
        tune_log.setLevel(level)
        snapshots.removeFilter(_not_the_snapshot_advice)
        if output is None:
            os.environ.pop(_TUNE_OUTPUT, None)
        else:
            os.environ[_TUNE_OUTPUT] = output
