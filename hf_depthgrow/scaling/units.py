"""A cell as a trial unit: a `CellSpec` in, a stored, verified result out, whichever engine ran it.

A cell's result is one JSON file `<output_dir>/cells/<task>_L<depth>_d<width>_n<n>.json` that also holds the
spec it was computed from and a sha256 digest of its content (written last, atomically). Before a study
reuses a stored cell it reads it back: a file that does not parse or fails its digest (damaged, edited) is
run again with a warning, never reused; a cell computed with other settings (another grid, seed or budget
in the same output folder) is refused with one line naming the first difference, since rerunning it would
overwrite a finished result of another study. Cells written before the spec was recorded (the committed
`docs/scaling/cells`) are checked on what they hold: task, dataset, depth, width, data size and seed.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from ..utils import json_safe, write_json
from .config import TaskGrid

__all__ = ["CellSpec", "cell_name", "check_digest", "compute_cell", "load_cell", "save_cell"]


def cell_name(task_name: str, depth: int, width: int, n: int) -> str:
    """File stem of one cell's result.

    Example:
        ```python
        >>> cell_name("lm", 2, 32, 60)
        'lm_L2_d32_n60'
        ```
    """
    return f"{task_name}_L{depth}_d{width}_n{n}"


@dataclass(frozen=True)
class CellSpec:
    """One cell of a study: the task's name and grid, `(depth, width, data size)` and the study's seed.

    Example:
        ```python
        >>> spec = CellSpec("lm", TaskGrid(task="lm"), depth=2, width=32, data_size=60, seed=0)
        >>> spec.stem
        'lm_L2_d32_n60'
        ```
    """

    name: str
    grid: TaskGrid
    depth: int
    width: int
    data_size: int
    seed: int

    @property
    def stem(self) -> str:
        return cell_name(self.name, self.depth, self.width, self.data_size)

    def to_dict(self) -> dict:
        return asdict(self)


def study_cells(config) -> list[CellSpec]:
    """Every cell of `config`, task by task in the grid's order."""
    return [CellSpec(name, grid, L, d, n, config.seed) for name, grid in config.tasks.items() for L, d, n in grid.cells()]


def compute_cell(spec: CellSpec, data, device="cpu") -> dict:
    """`run_cell` on `spec`: the cell's result as it is stored (with its name and spec)."""
    from .cells import run_cell

    row = run_cell(spec.grid, data, spec.depth, spec.width, spec.data_size, seed=spec.seed, device=device)
    return {**row, "name": spec.name, "spec": spec.to_dict()}


def _digest(row: dict) -> str:
    text = json.dumps(json_safe({k: v for k, v in row.items() if k != "sha256"}), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def check_digest(path: str | Path, row: dict) -> None:
    """Refuse a stored cell whose content fails its digest (edited or damaged); one written before digests passes."""
    if "sha256" in row and row["sha256"] != _digest(row):
        raise ValueError(f"{path}: its content does not match its sha256 digest (edited or damaged): run the study again "
                         "without --aggregate-only to recompute it")


def save_cell(path: str | Path, row: dict) -> Path:
    """Write a cell's result with its digest, atomically."""
    return write_json(path, {**row, "sha256": _digest(row)}, indent=1)


def load_cell(path: str | Path, spec: CellSpec) -> dict | None:
    """The stored result of `spec` at `path`, verified; `None` when there is none or it is unreadable (with a warning).

    Raises:
        ValueError: the file holds a cell computed with other settings.

    Example:
        ```python
        >>> load_cell(out / "cells" / f"{spec.stem}.json", spec) is None  # not run yet
        True
        ```
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        row = json.loads(path.read_text())
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
        if "sha256" in row and row["sha256"] != _digest(row):
            raise ValueError("its content does not match its sha256 digest")
    except (OSError, ValueError) as err:
        warnings.warn(f"scaling study: the stored cell {path} is unreadable ({err}); running it again", stacklevel=2)
        return None
    _check_same(path, row, spec)
    return row


def _check_same(path: Path, row: dict, spec: CellSpec) -> None:
    want, have = spec.to_dict(), row.get("spec", row)
    if "spec" in row:
        pairs = [(f"grid.{k}", have.get("grid", {}).get(k), v) for k, v in json_safe(want["grid"]).items()]
    else:  # written before specs were stored: what the row itself records
        pairs = [("grid.task", row.get("task"), spec.grid.task), ("grid.dataset", row.get("dataset"), spec.grid.dataset)]
    pairs += [(k, have.get(k), want[k]) for k in ("name", "depth", "width", "data_size", "seed")]
    for key, there, here in pairs:
        if there != here:
            raise ValueError(f"{path} holds a cell computed with {key}={there!r}, this study has {here!r}: "
                             "use another output_dir, or --overwrite to start afresh")
