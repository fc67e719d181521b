"""The scaling study's figures: one per finding (a panel per task) and the fitted power law."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..plots import colour, new_figure, save_figure
from .fit import PowerLawFit
from .report import NEAR_DIAGONAL, best_value


def plot_findings(rows: list[dict], found: dict, out: Path) -> dict[str, str]:
    """One figure per finding of the scaling study (each with a panel per task). Returns name -> path."""
    names = sorted(found)
    figures = {
        "covariance": _plot_covariance,
        "signal_depth": _plot_signal_depth,
        "z_width": _plot_z_width,
        "growth_paths": _plot_growth_paths,
    }
    return {key: str(draw(rows, found, out, names)) for key, draw in figures.items()}


def _panels(title: str, names: list[str]):
    fig = new_figure(figsize=(5.2 * len(names), 3.8))
    axes = fig.subplots(1, len(names), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def _plot_covariance(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """Covariance off-diagonal share against relative position, largest data."""
    fig, axes = _panels("Activation-gradient covariance: off-diagonal share", names)
    for ax, name in zip(axes, names):
        cells = [r for r in rows if r["name"] == name]
        n_big = max(r["data_size"] for r in cells)
        widths = sorted({r["width"] for r in cells})
        for r in cells:
            if r["data_size"] != n_big:
                continue
            ks = np.array(r["probe"]["positions"]) / max(1, r["depth"])
            ax.plot(ks, r["probe"]["offdiag_share"], "o-", ms=3, alpha=0.8,
                    color=colour(widths.index(r["width"]), len(widths)), label=f"d={r['width']}, L={r['depth']}")
        ax.axhline(NEAR_DIAGONAL, color="grey", ls=":", lw=1)
        ax.set(title=f"{name} (n={n_big})", xlabel="position k / L", ylabel="||Σ - diag Σ||_F / ||Σ||_F", ylim=(0, 1.02))
        ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, out / "covariance.png", dpi=120, bbox_inches="tight")



def _plot_signal_depth(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """Population signal against depth: across models (best position vs L) and inside the deepest models (vs k)."""
    fig = new_figure(figsize=(5.2 * len(names), 7.0))
    grid = fig.subplots(2, len(names), squeeze=False)
    fig.suptitle("First-order signal against depth (population estimate ± SE)")
    for col, name in enumerate(names):
        cells = [r for r in rows if r["name"] == name]
        n_big = max(r["data_size"] for r in cells)
        widths = sorted({r["width"] for r in cells})
        depths = sorted({r["depth"] for r in cells})
        ax = grid[0][col]
        for i, w in enumerate(widths):
            sel = sorted((r for r in cells if r["width"] == w and r["data_size"] == n_big), key=lambda r: r["depth"])
            ys, es = [], []
            for r in sel:
                pop = [v if v is not None else np.nan for v in r["probe"]["population"]]
                j = int(np.nanargmax(pop))
                ys.append(pop[j])
                es.append(r["probe"]["population_se"][j] or 0.0)
            ax.errorbar([r["depth"] for r in sel], ys, yerr=es, fmt="o-", capsize=2, color=colour(i, len(widths)), label=f"d={w}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(title=f"{name} (n={n_big}): best position", xlabel="depth L of the model", ylabel="population signal ||G_D||²",
               xticks=depths)
        ax.legend(fontsize=7)
        ax = grid[1][col]
        for i, w in enumerate(widths):
            deep = [r for r in cells if r["width"] == w and r["data_size"] == n_big and r["depth"] == depths[-1]]
            for r in deep:
                pop = [v if v is not None else np.nan for v in r["probe"]["population"]]
                se = [v if v is not None else 0.0 for v in r["probe"]["population_se"]]
                ax.errorbar(r["probe"]["positions"], pop, yerr=se, fmt="o-", capsize=2, color=colour(i, len(widths)), label=f"d={w}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(title=f"{name} (n={n_big}): by position, L={depths[-1]}", xlabel="position k", ylabel="population signal ||G_D||²",
               xticks=list(range(depths[-1] + 1)))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out / "signal_depth.png", dpi=120, bbox_inches="tight")



def _plot_z_width(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """z against width at fixed (smallest) data."""
    fig, axes = _panels("Observability: best-position z-score against width at fixed data", names)
    for ax, name in zip(axes, names):
        cells = [r for r in rows if r["name"] == name]
        n_fixed = found[name]["z_grows_with_width"]["data_size"]
        depths = sorted({r["depth"] for r in cells})
        for i, L in enumerate(depths):
            sel = sorted((r for r in cells if r["depth"] == L and r["data_size"] == n_fixed), key=lambda r: r["width"])
            ax.plot([r["width"] for r in sel], [best_value(r, "z") for r in sel], "o-", color=colour(i, len(depths)), label=f"L={L}")
        ax.axhline(2.0, color="grey", ls=":", lw=1)
        widths = sorted({r["width"] for r in cells})
        ax.set(title=f"{name} (n={n_fixed})", xlabel="width d", ylabel="max z", xscale="log")
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    return save_figure(fig, out / "z_width.png", dpi=120, bbox_inches="tight")



def _plot_growth_paths(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """Test loss after growth along the two paths: depth and width together vs depth alone."""
    fig, axes = _panels("Test loss after growth: depth and width together vs depth alone", names)
    for ax, name in zip(axes, names):
        f = found[name]["joint_scaling_beats_depth_alone"]
        for key, label, style in (("joint", "depth + width", "o-"), ("narrow", f"depth alone (d={f['narrow_path'][0][1]})", "s--")):
            path, losses = f[f"{key}_path"], f[f"{key}_losses"]
            ax.plot([L + 1 for L, _ in path], losses, style, label=label)
            for (L, w), y in zip(path, losses):
                if y is not None:
                    ax.annotate(f"d={w}", (L + 1, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set(title=name, xlabel="depth after growth (L + 1)", ylabel="test loss")
        ax.legend(fontsize=7)
    return save_figure(fig, out / "growth_paths.png", dpi=120, bbox_inches="tight")


def plot_power_law(fit: PowerLawFit, N, D, loss, path: str | Path) -> Path:
    """Measured losses against `N`, coloured by `D`, with the fitted curve for each `D`.

    Example:
        ```python
        >>> plot_power_law(fit, N, D, loss, "scaling_fit.png")
        PosixPath('scaling_fit.png')
        ```
    """
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    N, D, loss = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (N, D, loss))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    fig = new_figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot()
    norm = LogNorm(D.min(), D.max()) if D.max() > D.min() else Normalize(D.min() - 1, D.max() + 1)
    cmap = "viridis"
    ax.scatter(N, loss, c=D, cmap=cmap, norm=norm, s=28, edgecolors="black", linewidths=0.4, zorder=3)
    distinct = np.unique(D)
    if distinct.size > 8:  # one curve per D would be unreadable; show 8 spread over the range
        distinct = np.unique(np.geomspace(distinct.min(), distinct.max(), 8))
    grid = np.geomspace(N.min(), N.max(), 200)
    mapper = ScalarMappable(norm=norm, cmap=cmap)
    for d in distinct:
        ax.plot(grid, fit.predict(grid, d), color=mapper.to_rgba(d), lw=1.3)
    ax.set_xscale("log")
    ax.set_xlabel("N (parameters)")
    ax.set_ylabel("test loss")
    ax.set_title(
        f"L = {fit.E:.3g} + {fit.A:.3g}·N^-{fit.alpha:.3g} + {fit.B:.3g}·D^-{fit.beta:.3g}  (R² {fit.r2:.4f})",
        fontsize=9,
    )
    fig.colorbar(mapper, ax=ax, label="D (training data)")
    fig.tight_layout()

    return save_figure(fig, path)
