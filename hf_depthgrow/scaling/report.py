"""A scaling study's cells read back and turned into findings, power-law fits and a results table.

Each finding of docs/theory.md §8 is decided by a criterion stated next to it (and in the report), so a
reader can see why it counts as reproduced or not; nothing is tuned to make it reproduce.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from ..evaluation.formatting import format_value

# A covariance is called near-diagonal when less than half of its Frobenius mass is off the diagonal.
NEAR_DIAGONAL = 0.5


def load_cells(cells_dir: str | os.PathLike) -> list[dict]:
    """Every finished cell, sorted by task, data size, width, depth; a cell that fails its digest is refused."""
    from .units import check_digest

    rows = []
    for path in sorted(Path(cells_dir).glob("*.json")):
        rows.append(json.loads(path.read_text()))
        check_digest(path, rows[-1])
    return sorted(rows, key=lambda r: (r["name"], r["data_size"], r["width"], r["depth"]))


def _spearman(x, y) -> float:
    """Rank correlation (average ranks for ties); nan with fewer than 2 distinct values."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 2 or len(set(x)) < 2 or len(set(y)) < 2:
        return float("nan")

    def ranks(v):
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


def best_value(row: dict, key: str) -> float:
    values = [v for v in row["probe"][key] if v is not None]
    return max(values) if values else float("nan")


def findings(rows: list[dict]) -> dict:
    """The four findings, per task, with the numbers behind each verdict.

    Example:
        ```python
        >>> found = findings(load_cells("docs/scaling/cells"))
        >>> found["lm_shakespeare"]["covariance_near_diagonal"]["reproduced"]
        True
        ```
    """
    out: dict = {}
    for name in sorted({r["name"] for r in rows}):
        cells = [r for r in rows if r["name"] == name]
        grid = _Grid(cells)
        out[name] = {
            "covariance_near_diagonal": _covariance_finding(grid),
            "signal_decays_with_depth": _signal_depth_finding(grid),
            "z_grows_with_width": _z_width_finding(grid),
            "joint_scaling_beats_depth_alone": _joint_scaling_finding(grid),
        }
    return out


class _Grid:
    """One task's cells, indexed by `(depth, width, data_size)`, with the axes' values sorted."""

    def __init__(self, cells: list[dict]):
        self.cells = cells
        self.depths = sorted({r["depth"] for r in cells})
        self.widths = sorted({r["width"] for r in cells})
        self.sizes = sorted({r["data_size"] for r in cells})
        self.get = {(r["depth"], r["width"], r["data_size"]): r for r in cells}


def _covariance_finding(g: _Grid) -> dict:
    shares = [v for r in g.cells for v in r["probe"]["offdiag_share"] if v is not None]
    median = float(np.median(shares)) if shares else float("nan")
    by_width = {
        str(w): float(np.median([v for r in g.cells if r["width"] == w for v in r["probe"]["offdiag_share"] if v is not None] or [np.nan]))
        for w in g.widths
    }
    return {
        "criterion": f"median off-diagonal share over every cell and position < {NEAR_DIAGONAL}",
        "median": median,
        "quartiles": [float(np.percentile(shares, 25)), float(np.percentile(shares, 75))] if shares else None,
        "by_width": by_width,
        "reproduced": bool(median < NEAR_DIAGONAL),
    }


def _signal_depth_finding(g: _Grid) -> dict:
    rhos = []
    for w in g.widths:
        for n in g.sizes:
            pts = [(L, best_value(g.get[(L, w, n)], "population")) for L in g.depths if (L, w, n) in g.get]
            if len(pts) >= 2:
                rhos.append(_spearman(*zip(*pts)))
    rhos = [r for r in rhos if math.isfinite(r)]
    # Second reading of "decays with depth": along the positions k of one model.
    within = [_spearman(r["probe"]["positions"], r["probe"]["population"]) for r in g.cells if r["depth"] >= 2]
    within = [r for r in within if math.isfinite(r)]
    return {
        "criterion": "best-position population signal falls with depth L (Spearman rho < 0) in most (width, data) groups",
        "rho_by_group": rhos,
        "share_decreasing": float(np.mean([r < 0 for r in rhos])) if rhos else float("nan"),
        "reproduced": bool(rhos) and float(np.mean([r < 0 for r in rhos])) > 0.5,
        "within_model": {
            "criterion": "population signal falls with position k inside a model (Spearman rho < 0), models with L >= 2",
            "rho_by_cell": within,
            "share_decreasing": float(np.mean([r < 0 for r in within])) if within else float("nan"),
            "reproduced": bool(within) and float(np.mean([r < 0 for r in within])) > 0.5,
        },
    }


def _z_width_finding(g: _Grid) -> dict:
    n_fixed = g.sizes[0]
    rhos = []
    for L in g.depths:
        pts = [(w, best_value(g.get[(L, w, n_fixed)], "z")) for w in g.widths if (L, w, n_fixed) in g.get]
        if len(pts) >= 2:
            rhos.append(_spearman(*zip(*pts)))
    rhos = [r for r in rhos if math.isfinite(r)]
    return {
        "criterion": f"best-position z-score rises with width at fixed data n={n_fixed} (Spearman rho > 0) for most depths",
        "data_size": n_fixed,
        "rho_by_depth": rhos,
        "share_increasing": float(np.mean([r > 0 for r in rhos])) if rhos else float("nan"),
        "reproduced": bool(rhos) and float(np.mean([r > 0 for r in rhos])) > 0.5,
    }


def _joint_scaling_finding(g: _Grid) -> dict:
    n_big = g.sizes[-1]
    joint = [(g.depths[i], g.widths[i]) for i in range(min(len(g.depths), len(g.widths)))]
    narrow = [(L, g.widths[0]) for L in g.depths]

    def path_losses(path):
        return [g.get[(L, w, n_big)]["test"]["loss_grown"] if (L, w, n_big) in g.get else None for L, w in path]

    jl, nl = path_losses(joint), path_losses(narrow)
    joint_monotone = all(a is not None and b is not None and b < a for a, b in zip(jl, jl[1:]))
    narrow_monotone = all(a is not None and b is not None and b < a for a, b in zip(nl, nl[1:]))
    return {
        "criterion": "test loss after growth falls at every step of the joint (depth, width) path, and rises somewhere "
        f"along depth alone at width {g.widths[0]} (data n={n_big})",
        "joint_path": [list(p) for p in joint],
        "joint_losses": jl,
        "narrow_path": [list(p) for p in narrow],
        "narrow_losses": nl,
        "joint_monotone": joint_monotone,
        "narrow_non_monotone": not narrow_monotone,
        "reproduced": bool(len(joint) >= 2 and joint_monotone and not narrow_monotone),
    }


def fits(rows: list[dict], *, bootstrap: int = 200, seed: int = 0) -> dict:
    """`L(N, D) = E + A N^-alpha + B D^-beta` on the base models' test losses, per task."""
    from .fit import fit_power_law

    out = {}
    for name in sorted({r["name"] for r in rows}):
        cells = [r for r in rows if r["name"] == name]
        N = np.array([r["N"] for r in cells], float)
        D = np.array([r["D"] for r in cells], float)
        loss = np.array([r["test"]["loss_base"] for r in cells], float)
        try:
            fit = fit_power_law(N, D, loss, bootstrap=bootstrap, seed=seed)
        except ValueError as err:
            out[name] = {"skipped": str(err)}
            continue
        out[name] = {"fit": fit, "N": N, "D": D, "loss": loss}
    return out


def results_markdown(config: dict, rows: list[dict], found: dict, fitted: dict, figures: dict, command: str) -> str:
    """The study's report: findings with verdicts, fits, and one row per cell."""
    lines = ["# Scaling study results", "", f"Produced by `{command}`.", ""]
    lines += ["## Findings", "", "| task | finding | criterion | measured | reproduced |", "|---|---|---|---|---|"]
    for name, task in found.items():
        c = task["covariance_near_diagonal"]
        lines.append(f"| {name} | covariance near-diagonal | {c['criterion']} | median {format_value(c['median'], 3)} "
                     f"(IQR {format_value(c['quartiles'][0], 3)}–{format_value(c['quartiles'][1], 3)}) | {'yes' if c['reproduced'] else '**no**'} |")
        s = task["signal_decays_with_depth"]
        lines.append(f"| {name} | signal decays with depth | {s['criterion']} | {format_value(s['share_decreasing'], 2)} of groups, "
                     f"rho {', '.join(format_value(r, 2) for r in s['rho_by_group'])} | {'yes' if s['reproduced'] else '**no**'} |")
        w = s["within_model"]
        lines.append(f"| {name} | signal decays with position | {w['criterion']} | {format_value(w['share_decreasing'], 2)} of cells, "
                     f"median rho {format_value(float(np.median(w['rho_by_cell'])) if w['rho_by_cell'] else None, 2)} "
                     f"| {'yes' if w['reproduced'] else '**no**'} |")
        z = task["z_grows_with_width"]
        lines.append(f"| {name} | z grows with width | {z['criterion']} | {format_value(z['share_increasing'], 2)} of depths, "
                     f"rho {', '.join(format_value(r, 2) for r in z['rho_by_depth'])} | {'yes' if z['reproduced'] else '**no**'} |")
        g = task["joint_scaling_beats_depth_alone"]
        lines.append(f"| {name} | depth+width monotone, depth alone not | {g['criterion']} | joint "
                     f"{' → '.join(format_value(v) for v in g['joint_losses'])}; narrow {' → '.join(format_value(v) for v in g['narrow_losses'])} "
                     f"| {'yes' if g['reproduced'] else '**no**'} |")
    lines += ["", "## Power-law fits `L(N, D) = E + A N^-alpha + B D^-beta` (base models' test loss)", ""]
    for name, item in fitted.items():
        lines.append(f"### {name}")
        lines.append("")
        if "skipped" in item:
            lines.append(f"Not fitted: {item['skipped']}")
        else:
            lines.append(item["fit"].summary())
        lines.append("")
    lines += ["## Figures", ""] + [f"- {k}: `{Path(v).name}`" for k, v in figures.items()] + [""]
    lines += ["## Cells", "",
              "| task | L | d | n | N | D | base test loss | grown at k | selected | grown test loss | Δ test (95% bootstrap) | max z | median off-diag | s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        boot = r["test"]["bootstrap"]
        ci = f"[{format_value(boot[0], 3)}, {format_value(boot[1], 3)}]" if boot else "–"
        off = [v for v in r["probe"]["offdiag_share"] if v is not None]
        lines.append(
            f"| {r['name']} | {r['depth']} | {r['width']} | {r['data_size']} | {r['N']} | {r['D']} | {format_value(r['test']['loss_base'])} "
            f"| {r['growth']['position']} | {r['growth']['selected']} | {format_value(r['test']['loss_grown'])} | {format_value(r['test']['delta'], 3)} {ci} "
            f"| {format_value(best_value(r, 'z'), 3)} | {format_value(float(np.median(off)) if off else None, 3)} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"
