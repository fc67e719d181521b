"""Scaling study: depth x width x data on small normalized residual transformers (docs/theory.md §8).

For every cell `(depth L, width d, data n)` of a grid, a small model is trained from scratch
(a ViT on Fashion-MNIST or digits; a Llama-style character LM on Shakespeare), probed at every
position (first-order signal, its z-score, the activation-gradient covariance's off-diagonal
share), grown by one block at the probe's best position, the new block trained with the
fallback rule, and the paired test-risk delta evaluated (`cells.run_cell`; both trainings go
through `hf_depthgrow.training.train`). The study then asks whether the mechanism's findings show up:

1. the activation-gradient covariance is near-diagonal;
2. the first-order signal decays with depth, and its z-score grows with width at fixed data;
3. test loss after growth improves monotonically when depth and width scale together, while
   depth alone at narrow width turns non-monotone;
4. the base losses follow `L(N, D) = E + A N^-alpha + B D^-beta` (fit with uncertainties).

Every finding is checked against a stated criterion and reported as measured, including when it
does not reproduce (`report.py`). Cells are independent trial units (`units.CellSpec` in, a stored and
verified result out) and run on compare's engines: `serial` (under `torchrun` or `accelerate launch` each
process takes every `WORLD_SIZE`-th cell on its own device, so a grid spreads over GPUs or CPU processes
without collectives) or `ray` (each cell a Ray Tune trial, `ray_cells.py`, the same results). Finished
cells are stored one file each, so an interrupted study resumes; the aggregation reads only stored cells.

Modules: `config.py` (TaskGrid, StudyConfig, StudyCommand), `tasks.py` (data splits, models), `cells.py`
(one cell), `units.py` (a cell as a stored trial unit), this file (the runner), `ray_cells.py` (the Ray
engine), `report.py` (findings, tables, figures), `fit.py` (the power law).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..utils import atomic_write_text, write_json
from .cells import run_cell
from .config import StudyConfig, TaskGrid
from .tasks import TaskData, build_model, cell_device, load_task_data
from .units import CellSpec, cell_name, compute_cell, load_cell, save_cell, study_cells

__all__ = ["StudyConfig", "TaskGrid", "build_model", "cell_name", "load_task_data", "run_cell", "run_study"]


def _process_layout() -> tuple[int, int]:
    """`(rank, world size)` from the launcher's environment (`torchrun` and `accelerate launch` both set it)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"inconsistent launcher environment: RANK={rank}, WORLD_SIZE={world}")
    return rank, world


def _run_cells(config: StudyConfig, specs: list[CellSpec], todo: list[CellSpec], path_of, rank: int, world: int) -> None:
    """The serial engine: this process's share of the missing cells, each stored as soon as it is done."""
    from tqdm.auto import tqdm

    device = cell_device()
    # Shares are cut from every cell, not from the missing ones: a process that starts late (and finds some of
    # the others' cells done) still takes the same share, so no cell is left to nobody.
    missing = {spec.stem for spec in todo}
    mine = [spec for i, spec in enumerate(specs) if i % world == rank and spec.stem in missing]
    loaded: dict[str, TaskData] = {}
    bar = tqdm(mine, desc=f"cells (process {rank}/{world})", disable=not config.progress)
    for spec in bar:
        bar.set_postfix_str(spec.stem)
        if spec.name not in loaded:
            loaded[spec.name] = load_task_data(spec.grid, config.seed)
        save_cell(path_of(spec), compute_cell(spec, loaded[spec.name], device))


def run_study(config: StudyConfig, *, only_aggregate: bool = False) -> dict:
    """Run every missing cell on `config.engine`, then aggregate the stored cells on the main process.

    With `engine="serial"` each process of a launcher takes its share of the cells; with `engine="ray"` the
    cells are Ray Tune trials (one process, no launcher) and equal the serial ones on CPU fp32. Stored cells
    are read back and verified first (`units.load_cell`): only the missing ones run, on either engine.
    Returns the aggregate (findings, fits, file paths) on the main process and `{}` on the others.

    Example:
        ```python
        >>> cfg = StudyConfig.from_yaml("recipes/configs/scaling/default.yaml")
        >>> summary = run_study(cfg)
        >>> summary["findings"]["covariance_near_diagonal"]["reproduced"]
        ```
    """
    rank, world = _process_layout()
    if config.engine == "ray" and world > 1 and not only_aggregate:
        raise ValueError(f"engine 'ray' spreads the cells itself: run it in one process, not under a launcher (WORLD_SIZE={world})")
    out = Path(config.output_dir)
    cells_dir = out / "cells"
    specs = study_cells(config)

    def path_of(spec: CellSpec) -> Path:
        return cells_dir / f"{spec.stem}.json"

    # Every stored cell is verified before anything runs or is written: one of another study is refused here.
    todo = [] if only_aggregate else [spec for spec in specs if load_cell(path_of(spec), spec) is None]
    torch.set_num_threads(config.threads)

    def prepare() -> None:
        cells_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0 and not only_aggregate:
            write_json(out / "config.json", config.to_dict(), indent=1)
            # The report names the command that computed the cells, also when redrawn later with --aggregate-only.
            atomic_write_text(out / "command.txt", os.environ.get("HF_DEPTHGROW_STUDY_COMMAND", "run_study(StudyConfig(...))") + "\n")

    if todo and config.engine == "ray":
        from .ray_cells import run_cells_ray

        run_cells_ray(config, todo, path_of, prepare=prepare)  # prepares once Ray took the address and resources
    else:
        prepare()
        if todo:
            _run_cells(config, specs, todo, path_of, rank, world)
    if rank != 0:
        return {}
    # No collective barrier: the main process waits for the other processes' cell files (a crashed
    # process takes the launcher's whole group down, so this cannot wait forever under a launcher).
    while not only_aggregate and not all(path_of(spec).exists() for spec in specs):
        time.sleep(2.0)
    return aggregate(config, cells_dir, out)


def aggregate(config, cells_dir: Path, out: Path, *, command: str | None = None) -> dict:
    """Findings, fits, figures and `RESULTS.md` / `summary.json` from the cells on disk.

    Example:
        ```python
        >>> summary = aggregate(StudyConfig.from_yaml("recipes/configs/scaling/default.yaml"), Path("docs/scaling/cells"), Path("docs/scaling"))
        >>> summary["num_cells"]
        54
        ```
    """
    from .plots import plot_findings, plot_power_law  # matplotlib loads only when a study reports
    from .report import findings, fits, load_cells, results_markdown

    rows = load_cells(cells_dir)
    if not rows:
        raise RuntimeError(f"no finished cells in {cells_dir}")
    found = findings(rows)
    fitted = fits(rows, bootstrap=config.fit_bootstrap, seed=config.seed)
    figures = plot_findings(rows, found, out)
    for name, item in fitted.items():
        if "fit" in item:
            figures[f"fit_{name}"] = str(plot_power_law(item["fit"], item["N"], item["D"], item["loss"], out / f"fit_{name}.png"))
    stored = out / "command.txt"
    command = command or (stored.read_text().strip() if stored.exists() else None) or "python recipes/scaling_study.py"
    text = results_markdown(config.to_dict(), rows, found, fitted, figures, command)
    atomic_write_text(out / "RESULTS.md", text)
    summary = {
        "findings": found,
        "fits": {k: (v["fit"].to_dict() if "fit" in v else v) for k, v in fitted.items()},
        "figures": figures,
        "num_cells": len(rows),
        "seconds": sum(r["seconds"] for r in rows),
    }
    write_json(out / "summary.json", summary, indent=1)
    return summary
