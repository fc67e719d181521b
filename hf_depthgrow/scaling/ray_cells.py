"""The scaling study's cells on Ray Tune: each cell one Tune trial, the results equal to the serial engine's.

Run by compare's Ray driver (`comparison.ray_engine`): `ray_cluster`'s connection and resource checks before any
work, `tune_units`' Tune driver and trainable, with the task data (every split of every task) as what every cell
shares. Each cell runs with the study's `threads` torch threads, as the serial engine does, so on CPU fp32 its
result is bit-identical to the serial one. The driver stores each cell (`units.save_cell`) as it finishes, so an
interrupted study keeps every finished cell and resumes.
"""

from __future__ import annotations

import json

from .tasks import cell_device, load_task_data
from .units import CellSpec, compute_cell, save_cell

__all__ = ["run_cells_ray"]


def run_cells_ray(config, specs: list[CellSpec], path_of, *, prepare=None) -> None:
    """Run `specs` as Ray Tune trials with `config`'s Ray settings; each result stored at `path_of(spec)`.

    `prepare()` (the study's folder and config.json) is called once Ray has been joined and has the resources a
    cell asks for: a refused address or resources leave nothing written.

    Example:
        ```python
        >>> run_cells_ray(StudyConfig(..., engine="ray", max_concurrent_trials=2), study_cells(cfg), path_of)
        ```
    """
    from ..comparison.ray_engine import ray_cluster, tune_units

    with ray_cluster(config.ray_address, config.resources_per_trial) as resources:
        names = dict.fromkeys(spec.name for spec in specs)
        data = {name: load_task_data(config.tasks[name], config.seed) for name in names}
        if prepare is not None:
            prepare()
        tune_units(_cell, specs, data, resources, [s.stem for s in specs], what="cell", threads=config.threads,
                   keep=lambda i, reported: save_cell(path_of(specs[i]), json.loads(reported["cell"])),
                   max_concurrent=config.max_concurrent_trials)


def _cell(spec: CellSpec, shipped: list) -> dict:
    """One Tune trial's work: the cell's result as JSON (floats read back bit for bit)."""
    from ..comparison.ray_workers import received

    return {"cell": json.dumps(compute_cell(spec, received(shipped)[spec.name], cell_device()))}
