"""Calibrating the probe's "improvable" verdict against certified gains on the scaling study's cells.

Each cell grew one block where the probe pointed, trained it, and certified (or not) a test improvement
with a paired bootstrap interval. A verdict threshold `t` says "improvable" where the probe's z at that
position exceeds `t`; its agreement is the share of cells where that verdict equals "certified". The
threshold is chosen leave-one-task-out (on the LM cells for the ViT cells and vice versa), so each
task's figure is out of sample.

    python -m hf_depthgrow.scaling.calibration docs/scaling/cells
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

THRESHOLDS = (2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -np.inf)


def verdict_rows(cells_dir) -> list[dict]:
    """`{"task", "z", "certified"}` per cell: the probe's z at the grown position and the certified outcome."""
    rows = []
    for path in sorted(Path(cells_dir).glob("*.json")):
        cell = json.loads(path.read_text())
        growth, test = cell.get("growth"), cell.get("test")
        if not growth or not test or growth.get("position") is None:
            continue
        i = cell["probe"]["positions"].index(growth["position"])
        rows.append({"task": cell["task"], "z": float(cell["probe"]["z"][i]), "certified": bool(test["bootstrap"][0] > 0)})
    if not rows:
        raise ValueError(f"no finished cell under {cells_dir}")
    return rows


def agreement(rows: list[dict], threshold: float) -> float:
    """Share of cells where `z > threshold` equals "a test improvement was certified"."""
    return float(np.mean([(r["z"] > threshold) == r["certified"] for r in rows]))


def calibrate(rows: list[dict], *, current: float = 2.0, thresholds=THRESHOLDS) -> dict:
    """Per task: agreement at the `current` threshold, and at the threshold chosen on the other tasks' cells.

    Example:
        ```python
        >>> out = calibrate(verdict_rows("docs/scaling/cells"))
        >>> out["lm"]["before"], out["lm"]["after"]
        ```
    """
    tasks = sorted({r["task"] for r in rows})
    out = {}
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        others = [r for r in rows if r["task"] != task] or mine
        # Ties go to the larger threshold: the verdict stays as conservative as the data allow.
        chosen = max(thresholds, key=lambda t: (agreement(others, t), t))
        out[task] = {
            "cells": len(mine), "certified": sum(r["certified"] for r in mine),
            "before": agreement(mine, current), "said_before": sum(r["z"] > current for r in mine),
            "threshold": float(chosen), "after": agreement(mine, chosen), "said_after": sum(r["z"] > chosen for r in mine),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cells = argv[0] if argv else "docs/scaling/cells"
    result = calibrate(verdict_rows(cells))
    print("| task | cells | certified gains | improvable at z > 2 | agreement | threshold (other tasks) | improvable | agreement |")
    print("|---|---|---|---|---|---|---|---|")
    for task, r in result.items():
        print(f"| {task} | {r['cells']} | {r['certified']} | {r['said_before']} | {r['before']:.2f} | z > {r['threshold']:g} | "
              f"{r['said_after']} | {r['after']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
