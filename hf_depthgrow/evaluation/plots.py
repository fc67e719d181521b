"""The evaluation's figures: the per-example differences and the intervals of the mean delta (`report.md` shows both)."""

from __future__ import annotations

import math
from pathlib import Path

from ..plots import new_figure, save_figure
from .bounds import INTERVALS
from .result import EvalResult


def plot_differences(result: EvalResult, path: str | Path) -> Path:
    """Histogram of per-example differences `old - new`, with 0 and the mean marked."""

    diffs = [a - b for a, b in zip(result.per_example_old, result.per_example_new)]
    fig = new_figure(figsize=(6, 3.6), dpi=110)
    ax = fig.subplots()
    ax.hist(diffs, bins=min(50, max(5, len(diffs) // 4)), color="#4C72B0", alpha=0.85)
    ax.axvline(0.0, color="black", lw=1, label="0 (no change)")
    ax.axvline(result.mean_delta, color="#C44E52", lw=2, label=f"mean = {result.mean_delta:.4g}")
    ax.set_xlabel("per-example loss difference, old - new (positive = new better)")
    ax.set_ylabel("examples")
    ax.set_title(f"Per-example differences ({result.num_examples} examples)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return Path(path)


def plot_intervals(result: EvalResult, path: str | Path) -> Path:
    """The three intervals for the mean per-example delta, 0 marked; the right panel zooms on the narrowest."""
    from matplotlib.ticker import MaxNLocator

    finite = {n: result.intervals[n] for n in INTERVALS if all(math.isfinite(v) for v in result.intervals[n])}
    narrow = min(finite, key=lambda n: finite[n][1] - finite[n][0]) if finite else None
    fig = new_figure(figsize=(9, 2.9), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    for ax in axes:
        for y, name in enumerate(INTERVALS):
            low, high = result.intervals[name]
            center = result.interval_details[name]["center"]
            color = "#55A868" if low > 0 else ("#C44E52" if high < 0 else "#4C72B0")
            ax.plot([low, high], [y, y], color=color, lw=5, solid_capstyle="butt")
            ax.plot([center], [y], "o", color="black", ms=4)
        ax.axvline(0.0, color="black", lw=1)
        ax.set_yticks(range(len(INTERVALS)), list(INTERVALS))
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_title("all intervals", fontsize=9)
    axes[0].set_xlabel(f"mean per-example delta, old - new ({result.confidence:.0%})", fontsize=8)
    if narrow is not None:
        low, high = finite[narrow]
        pad = max(high - low, abs(result.mean_delta), 1e-12)
        axes[1].set_xlim(min(low, 0.0) - 0.5 * pad, max(high, 0.0) + 0.5 * pad)
        axes[1].set_title(f"zoom on the narrowest ({narrow}: [{low:.3g}, {high:.3g}])", fontsize=9)
    axes[1].set_xlabel("same, zoomed (bars may run off the panel)", fontsize=8)
    fig.suptitle("Green: certified improvement; red: certified degradation; blue: contains 0", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return Path(path)
