"""The scaling study's cells on Ray Tune: each cell one Tune trial, the results equal to the serial engine's.

Built from compare's Ray engine (`comparison.ray_engine`): the same connection and resource checks
(`ray_cluster`: an unreachable address or more CPUs per cell than the cluster has is one line before any
work), the same quiet fit (Tune's tables on stderr), trial processes reused from cell to cell, a failed cell
run again from its start. The task data (every split of every task) goes into Ray's object store once
(`tune.with_parameters`), not to every cell. Each cell runs with the study's `threads` torch threads, as the
serial engine does, so on CPU fp32 its result is bit-identical to the serial one. The driver stores each cell
(`units.save_cell`) as it finishes, so an interrupted study keeps every finished cell and resumes.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
import warnings

import torch

from .tasks import cell_device, load_task_data
from .units import CellSpec, compute_cell, save_cell

__all__ = ["run_cells_ray"]


def run_cells_ray(config, specs: list[CellSpec], path_of, *, prepare=None, storage: str | None = None, max_failures: int = 2) -> None:
    """Run `specs` as Ray Tune trials with `config`'s Ray settings; each result stored at `path_of(spec)`.

    `prepare()` (the study's folder and config.json) is called once Ray has been joined and has the resources a
    cell asks for: a refused address or resources leave nothing written.

    Example:
        ```python
        >>> run_cells_ray(StudyConfig(..., engine="ray", max_concurrent_trials=2), study_cells(cfg), path_of)
        ```
    """
    from ..comparison.ray_engine import quiet_fit, ray_cluster

    with ray_cluster(config.ray_address, config.resources_per_trial) as resources:
        from ray import tune

        names = dict.fromkeys(spec.name for spec in specs)
        data = {name: load_task_data(config.tasks[name], config.seed) for name in names}
        if prepare is not None:
            prepare()
        collect = _collector(specs, path_of)
        trainable = tune.with_parameters(_trainable, specs=specs, data=data, threads=config.threads, gpus=resources.get("gpu", 0))
        with tempfile.TemporaryDirectory(prefix="hf_depthgrow-scaling-ray-") as tmp:
            tuner = tune.Tuner(
                tune.with_resources(trainable, resources),
                param_space={"index": tune.grid_search(list(range(len(specs))))},
                tune_config=tune.TuneConfig(max_concurrent_trials=config.max_concurrent_trials, reuse_actors=True),
                run_config=tune.RunConfig(name=f"hf_depthgrow-scaling-{uuid.uuid4().hex[:8]}", storage_path=_storage(storage) or tmp,
                                          failure_config=tune.FailureConfig(max_failures=max_failures), verbose=0, callbacks=[collect]),
            )  # fmt: skip
            grid = quiet_fit(tuner.fit)
    for r in grid:
        spec = specs[r.config["index"]]
        if spec.stem not in collect.done and r.error is not None:
            first = (str(r.error).strip().splitlines() or [type(r.error).__name__])[-1]
            raise RuntimeError(f"cell {spec.stem} failed under Ray ({max_failures} retries): {first}") from r.error
    missing = [s.stem for s in specs if s.stem not in collect.done]
    if missing:
        raise RuntimeError(f"Ray returned no result for {', '.join(missing)}")


def _storage(storage: str | None) -> str | None:
    """Tune's `storage_path`: a local folder made absolute (Tune wants one), a URI (`s3://...`) as it is."""
    return os.path.abspath(storage) if storage and "://" not in storage else storage


def _trainable(config: dict, specs: list[CellSpec], data: dict, threads: int, gpus: float) -> None:
    """One Tune trial: the cell at `config["index"]`, its result reported as JSON (floats read back bit for bit)."""
    from ray import tune

    torch.set_num_threads(threads)  # the serial engine's count: a reduction over other threads rounds differently
    if not gpus:
        # As in compare's engine: a trial that asked for no GPU would otherwise train on GPU 0 beside the others.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    spec = specs[config["index"]]
    row = compute_cell(spec, data[spec.name], cell_device())
    tune.report({"cell": json.dumps(row)})


def _collector(specs: list[CellSpec], path_of):
    """A Tune callback on the driver: each cell's result stored as it arrives."""
    from ray.tune import Callback

    class Collect(Callback):
        def __init__(self):
            self.done: set[str] = set()

        def on_trial_recover(self, iteration, trials, trial, **info):
            spec = specs[trial.config["index"]]
            warnings.warn(f"cell {spec.stem} failed ({trial.num_failures} time(s)): Ray runs it again from its start", stacklevel=2)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            spec = specs[trial.config["index"]]
            if "cell" in result and spec.stem not in self.done:
                save_cell(path_of(spec), json.loads(result["cell"]))
                self.done.add(spec.stem)

    return Collect()
