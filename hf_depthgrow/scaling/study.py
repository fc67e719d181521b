"""Scaling study: depth x width x data on small normalized residual transformers (THEORY.md §8).

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
does not reproduce (`report.py`). Cells are independent: under `torchrun` or `accelerate launch` each
process takes every `WORLD_SIZE`-th cell on its own device, so a grid spreads over GPUs (or CPU
processes) without collectives; finished cells are written one file each, so an interrupted study resumes.

Modules: `config.py` (TaskGrid, StudyConfig), `tasks.py` (data splits, models), `cells.py` (one cell),
this file (the runner), `report.py` (findings, tables, figures), `fit.py` (the power law).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..utils import atomic_write_text, write_json
from .cells import run_cell
from .config import StudyConfig, TaskGrid
from .tasks import TaskData, build_model, load_task_data

__all__ = ["StudyConfig", "TaskGrid", "build_model", "cell_name", "load_task_data", "run_cell", "run_study"]


def cell_name(task_name: str, depth: int, width: int, n: int) -> str:
    """File stem of one cell's result.

    Example:
        ```python
        >>> cell_name("lm", 2, 32, 60)
        'lm_L2_d32_n60'
        ```
    """
    return f"{task_name}_L{depth}_d{width}_n{n}"


def _process_layout() -> tuple[int, int]:
    """`(rank, world size)` from the launcher's environment (`torchrun` and `accelerate launch` both set it)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"inconsistent launcher environment: RANK={rank}, WORLD_SIZE={world}")
    return rank, world


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def _run_cells(config: StudyConfig, todo: list, path_of, rank: int, world: int) -> None:
    """This process's share of the missing cells, each written as soon as it is done."""
    from tqdm.auto import tqdm

    device = _device()
    mine = [t for i, t in enumerate(todo) if i % world == rank and not path_of(t).exists()]
    loaded: dict[str, TaskData] = {}
    bar = tqdm(mine, desc=f"cells (process {rank}/{world})", disable=not config.progress)
    for name, grid, (depth, width, n) in bar:
        bar.set_postfix_str(cell_name(name, depth, width, n))
        if name not in loaded:
            loaded[name] = load_task_data(grid, config.seed)
        row = run_cell(grid, loaded[name], depth, width, n, seed=config.seed, device=device)
        row["name"] = name
        write_json(path_of((name, grid, (depth, width, n))), row, indent=1)


def run_study(config: StudyConfig, *, only_aggregate: bool = False) -> dict:
    """Run every missing cell (this process's share under a launcher), then aggregate on the main process.

    Returns the aggregate (findings, fits, file paths) on the main process and `{}` on the others.

    Example:
        ```python
        >>> cfg = StudyConfig.from_yaml("recipes/configs/scaling/default.yaml")
        >>> summary = run_study(cfg)
        >>> summary["findings"]["covariance_near_diagonal"]["reproduced"]
        ```
    """
    rank, world = _process_layout()
    torch.set_num_threads(config.threads)
    out = Path(config.output_dir)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not only_aggregate:
        write_json(out / "config.json", config.to_dict(), indent=1)
        # The report names the command that computed the cells, also when redrawn later with --aggregate-only.
        atomic_write_text(out / "command.txt", os.environ.get("HF_DEPTHGROW_STUDY_COMMAND", "run_study(StudyConfig(...))") + "\n")
    todo = [(name, grid, cell) for name, grid in config.tasks.items() for cell in grid.cells()]

    def path_of(t):
        return cells_dir / f"{cell_name(t[0], *t[2])}.json"

    if not only_aggregate:
        _run_cells(config, todo, path_of, rank, world)
    if rank != 0:
        return {}
    # No collective barrier: the main process waits for the other processes' cell files (a crashed
    # process takes the launcher's whole group down, so this cannot wait forever under a launcher).
    while not only_aggregate and not all(path_of(t).exists() for t in todo):
        time.sleep(2.0)
    from .report import aggregate

    return aggregate(config, cells_dir, out)
