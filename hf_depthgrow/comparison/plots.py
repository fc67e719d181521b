"""The two figures of a budget sweep: the gain x forgetting plane, and learning curves with their fits.

Both take the JSON-ready dict of a sweep (`{"budgets": [...], "fits": {...}, "crossover": {...}}`; see
`plot_gain_forgetting`) and write a PNG atomically through `hf_depthgrow.plots.save_figure`. Optional parts
(forgetting without a retention set, fits with fewer than 3 budgets, a crossover) may be missing or `None`.
Growth arms are drawn in blues, controls in oranges and reds, so the two families read apart at a glance.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from ..plots import new_figure, save_figure
from ..utils import json_number
from .frontier import pareto

__all__ = ["plot_gain_forgetting", "plot_learning_curves"]

_EXTEND = 10.0  # without a crossover, fitted curves run to this multiple of the largest budget


def _num(value) -> float:
    """A number of the JSON dict as a float: `None` and `"nan"` become `nan`, `"inf"` becomes `inf`."""
    value = json_number(value)
    return math.nan if value is None else float(value)


def _arm_names(sweep: dict) -> tuple[list[str], list[str]]:
    """`(growth arms, controls)` in order of first appearance; the untouched original is neither."""
    growth, controls = [], []
    for budget in sweep["budgets"]:
        for name, arm in budget["arms"].items():
            kind = arm.get("kind")
            if kind == "original" or name in growth or name in controls:
                continue
            (growth if kind == "growth" else controls).append(name)
    return growth, controls


def _styles(sweep: dict) -> dict[str, dict]:
    """Colour and marker per arm: shades of blue for growth, of orange-red for the controls; markers tell
    arms of one family apart where shades are close."""
    import matplotlib

    growth, controls = _arm_names(sweep)
    out = {}
    for names, cmap, markers in ((growth, "Blues", "o^vD<>"), (controls, "YlOrRd", "sPXdp*")):
        shades = np.linspace(0.55, 0.95, len(names)) if len(names) > 1 else [0.8]
        for i, (name, shade) in enumerate(zip(names, shades)):
            out[name] = {"color": matplotlib.colormaps[cmap](shade), "marker": markers[i % len(markers)]}
    return out


def _tokens(tokens: float) -> str:
    """`10k`, `1.6M`, `inf`: short enough for a marker label."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if math.isfinite(tokens) and tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return f"{tokens:g}"


def _budget_label(budget: dict) -> str:
    """`20` steps when the sweep names them, else the tokens."""
    return str(budget["steps"]) if budget.get("steps") is not None else _tokens(_num(budget.get("tokens")))


def _interval(entry) -> tuple[float, float, float]:
    """`(mean, low, high)` of a `{"mean", "low", "high"}` entry; `nan`s where it is missing."""
    if not isinstance(entry, dict):
        return math.nan, math.nan, math.nan
    return _num(entry.get("mean")), _num(entry.get("low")), _num(entry.get("high"))


def _error(mean: float, low: float, high: float) -> list[list[float]]:
    """A one-point errorbar `[[below], [above]]`, zero where the interval is unknown or excludes the mean (a percentile
    bootstrap's may, with few resamples; matplotlib refuses a negative bar)."""
    below, above = mean - low, high - mean
    return [[max(below, 0.0) if math.isfinite(below) else 0.0], [max(above, 0.0) if math.isfinite(above) else 0.0]]


def _finish(fig, ax, path, xlabel: str, ylabel: str, title: str, caption: str) -> Path:
    """Every figure's end: the axis labels and title, the legend outside the axes on the right (the paths and curves
    run everywhere inside), `caption` wrapped under the axes with the layout tightened above it (the room grows with
    its lines), and the PNG written to `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="arms (blue: growth)",
              title_fontsize=7.5, frameon=False)
    lines = textwrap.wrap(caption, 130)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7.5, va="bottom", ha="left", color="0.25")
    line = 7.5 * 1.25 / 72 / fig.get_figheight()  # one caption line, as a fraction of the figure's height
    fig.tight_layout(rect=(0, 0.015 + line * (len(lines) + 0.5), 1, 1))
    return save_figure(fig, path)


def _lower_envelope(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The controls that no other control beats on both axes (more gain *and* less forgetting), by gain."""
    kept = set(pareto({name: (gain, forgetting) for gain, forgetting, name in points}))
    return sorted(p for p in points if p[2] in kept)


def plot_gain_forgetting(sweep: dict, path) -> Path:
    """The gain x forgetting plane: each arm's path across budgets, the frontier, and the control curve.

    Args:
        sweep: A budget sweep as JSON-ready data:
            `{"budgets": [{"steps", "tokens", "arms": {name: {"kind", "gain": {"mean", "low", "high"},
            "forgetting": {...} or None, "test_loss", "test_interval"}}, "frontier": [names]}, ...],
            "fits": {...}, "crossover": {...}}`, budgets in increasing order. `gain` is in nats against the
            original (higher is better), `forgetting` in nats on the retention set (lower is better).
        path: Where to write the PNG (its folder is created).

    Without any forgetting (no retention set) the figure shows gain against tokens instead, and says why.

    Returns:
        The path written.

    Example:
        ```python
        >>> plot_gain_forgetting(result.sweep, "out/compare_frontier.png")
        PosixPath('out/compare_frontier.png')
        ```
    """
    budgets = sweep["budgets"]
    styles = _styles(sweep)
    growth, controls = _arm_names(sweep)
    has_forgetting = any(
        isinstance(a.get("forgetting"), dict) for b in budgets for a in b["arms"].values() if a.get("kind") != "original"
    )
    fig = new_figure(figsize=(9.6, 6.0), dpi=110)
    ax = fig.add_subplot()
    if not has_forgetting:
        return _gain_by_budget(fig, ax, sweep, styles, growth + controls, path)
    for name in growth + controls:
        xs, ys, colour = [], [], styles[name]["color"]
        for budget in budgets:
            arm = budget["arms"].get(name)
            if arm is None:
                continue
            gain, forgetting = _interval(arm.get("gain")), _interval(arm.get("forgetting"))
            if not (math.isfinite(gain[0]) and math.isfinite(forgetting[0])):
                continue
            on_frontier = name in (budget.get("frontier") or [])
            ax.errorbar(
                gain[0], forgetting[0], xerr=_error(*gain), yerr=_error(*forgetting), fmt=styles[name]["marker"],
                ms=6.5, color=colour, ecolor=colour, elinewidth=0.8, capsize=2, alpha=0.9, zorder=3,
                mec="black" if on_frontier else colour, mew=1.4 if on_frontier else 0.5,
            )
            ax.annotate(_budget_label(budget), (gain[0], forgetting[0]), xytext=(4, 4), textcoords="offset points",
                        fontsize=6.5, color="0.2")
            xs.append(gain[0])
            ys.append(forgetting[0])
        if xs:
            ax.plot(xs, ys, "-", marker=styles[name]["marker"], color=colour, lw=1.4, alpha=0.8, label=name, zorder=2)
    _control_curve(ax, budgets[-1], controls)
    if any(a.get("kind") == "original" and isinstance(a.get("forgetting"), dict) for a in budgets[-1]["arms"].values()):
        ax.plot(0.0, 0.0, "*", color="0.35", ms=11, ls="none", label="original", zorder=4)
    ax.axhline(0, color="0.6", lw=0.7)
    ax.axvline(0, color="0.6", lw=0.7)
    return _finish(fig, ax, path, "gain vs the original (nats on the test set)  →  better", "forgetting (nats on the retention set)  ↓  better",
                   "gain x forgetting across budgets", (
        "Better is right (more gain) and down (less forgetting). Each arm's path joins its budgets (marker labels: "
        f"{'training steps' if budgets[0].get('steps') is not None else 'tokens'}); bars: intervals. A black ring: on "
        "the gain x forgetting frontier at that budget. Dashed: the control curve at the largest budget (the control "
        "points, every rate, that no other control point beats on both axes); a growth arm below it forgets less at matched gain."
    ))


def _control_curve(ax, budget: dict, controls: list[str]) -> None:
    """Dashed line: the curve of every control point at `budget` (each rate), else the controls' rows' envelope (two or more)."""
    curve = ((budget.get("frontier_detail") or {}).get("control_curve") or {}).get("curve")
    if curve and len(curve) >= 2:
        ax.plot([p[0] for p in curve], [p[1] for p in curve], "--", marker=".", color="0.15", lw=1.2,  # vertices: control points
                label=f"control curve, every rate ({_budget_label(budget)})", zorder=1)
        return
    points = []
    for name in controls:
        arm = budget["arms"].get(name) or {}
        gain, forgetting = _interval(arm.get("gain"))[0], _interval(arm.get("forgetting"))[0]
        if math.isfinite(gain) and math.isfinite(forgetting):
            points.append((gain, forgetting, name))
    envelope = _lower_envelope(points)
    if len(envelope) >= 2:
        ax.plot([p[0] for p in envelope], [p[1] for p in envelope], "--", color="0.15", lw=1.2,
                label=f"control curve ({_budget_label(budget)})", zorder=1)


def _gain_by_budget(fig, ax, sweep: dict, styles: dict, names: list[str], path) -> Path:
    """Without forgetting there is no plane: gain against tokens, with a note saying why."""
    for name in names:
        rows = [(_num(b["tokens"]), *_interval(b["arms"][name].get("gain"))) for b in sweep["budgets"] if name in b["arms"]]
        rows = [r for r in rows if math.isfinite(r[1])]
        if not rows:
            continue
        t, mean, low, high = (np.array(c) for c in zip(*rows))
        err = np.nan_to_num(np.stack([mean - low, high - mean]), nan=0.0).clip(min=0.0)
        ax.errorbar(t, mean, yerr=err, fmt="-", marker=styles[name]["marker"], color=styles[name]["color"], capsize=2,
                    lw=1.4, ms=5, label=name)
    ax.set_xscale("log")
    ax.axhline(0, color="0.6", lw=0.7)
    return _finish(fig, ax, path, "training tokens (log)", "gain vs the original (nats on the test set)  ↑  better",
                   "gain across budgets (forgetting not measured)", "No retention set was given, so forgetting was not measured and "
                   "the gain x forgetting plane cannot be drawn: this shows gain alone (higher is better), with its intervals.")


def plot_learning_curves(sweep: dict, path) -> Path:
    """Test loss against training tokens (log scale): measured points with intervals, fitted curves, the crossover.

    Args:
        sweep: A budget sweep as JSON-ready data (see `plot_gain_forgetting`); `fits` holds each arm's
            `LearningCurveFit.to_dict()` and `crossover` the output of `predict_crossover`, both optional.
        path: Where to write the PNG (its folder is created).

    Each fitted curve runs past the predicted crossover (or to 10x the largest budget without one); a vertical
    line marks the crossover, a band its bootstrap interval (to the edge when it is open-ended).

    Returns:
        The path written.
    """
    budgets = sweep["budgets"]
    styles = _styles(sweep)
    growth, controls = _arm_names(sweep)
    tokens = np.array([_num(b["tokens"]) for b in budgets])
    d_max = float(tokens.max())
    fits = sweep.get("fits") or {}
    marks = _crossover_marks(sweep.get("crossover") or {})
    end = max(m[1] for m in marks) * 1.6 if marks else _EXTEND * d_max  # a little past the crossover
    end = end if fits else d_max  # nothing to extrapolate
    grid = np.geomspace(tokens.min(), max(end, d_max), 300)
    fig = new_figure(figsize=(9.6, 5.8), dpi=110)
    ax = fig.add_subplot()
    bars, names = set(), growth + controls
    for i, name in enumerate(names):
        # Measured points are nudged apart along x (a few percent, log scale) so the arms' bars do not hide each other.
        nudge = 1.025 ** (i - (len(names) - 1) / 2)
        rows = [(t * nudge, b["arms"][name], _original_loss(b)) for t, b in zip(tokens, budgets) if name in b["arms"]]
        loss = np.array([_num(a.get("test_loss")) for _, a, _ in rows])
        low, high = np.array([_loss_interval(a, orig, bars) for _, a, orig in rows]).reshape(-1, 2).T
        err = np.nan_to_num(np.stack([loss - low, high - loss]), nan=0.0).clip(min=0.0)
        ax.errorbar([r[0] for r in rows], loss, yerr=err, fmt=styles[name]["marker"], color=styles[name]["color"],
                    capsize=2, ms=5, zorder=3, label=name)
        fit = fits.get(name) or {}
        params = [_num(fit.get(k)) for k in ("E", "A", "alpha")]
        if all(math.isfinite(p) for p in params):
            E, A, alpha = params
            style = ":" if fit.get("flat") else "-"
            ax.plot(grid, E + A * grid ** (-alpha), style, color=styles[name]["color"], lw=1.3, alpha=0.85, zorder=2)
        else:  # no fit: join the measured points, thinly, so each arm still reads as one curve
            ax.plot([r[0] for r in rows], loss, "-", color=styles[name]["color"], lw=0.8, alpha=0.6, zorder=2)
    if math.isfinite(_original_loss(budgets[0])):
        ax.axhline(_original_loss(budgets[0]), color="0.5", ls=(0, (1, 2)), lw=1, label="original (untrained)")
    ax.axvline(d_max, color="0.7", lw=0.8)
    ax.text(d_max, 0.98, "largest budget measured ", transform=ax.get_xaxis_transform(), fontsize=7, rotation=90,
            ha="right", va="top", color="0.4")
    for i, (label, at, interval, style) in enumerate(marks):
        ax.axvline(at, color="black", ls=style, lw=1.2, label=label)
        if interval is not None and i == 0:  # one band: two overlapping ones read as one darker one
            right = interval[1] if math.isfinite(interval[1]) else grid[-1]
            ax.axvspan(max(interval[0], grid[0]), min(right, grid[-1]), color="0.5", alpha=0.12, lw=0)
    ax.set_xscale("log")
    ax.set_xlim(grid[0] / 1.3, grid[-1] * 1.1)
    shaded = bool(marks) and marks[0][2] is not None
    return _finish(fig, ax, path, "training tokens (log)", "test loss (nats)  ↓  better",
                   "learning curves: measured (points), fitted L(D) = E + A·D^-alpha (lines)", _curves_caption(sweep, fits, shaded, bars))


def _crossover_marks(crossover: dict) -> list[tuple[str, float, tuple[float, float] | None, str]]:
    """`(legend label, tokens, interval in tokens or None, line style)` for each predicted crossover."""
    marks = []
    for key, style, what in (("on_gain", "--", "crossover"), ("within_forgetting", "-.", "within forgetting budget")):
        entry = crossover.get(key)
        if not isinstance(entry, dict) or entry.get("status") != "crossover":
            continue
        at = _num(entry.get("tokens"))
        interval = (entry.get("interval") or {}).get("tokens")
        interval = (_num(interval[0]), _num(interval[1])) if interval else None
        shown = ""
        if interval is not None:
            high = "open-ended" if not math.isfinite(interval[1]) else _tokens(interval[1])
            shown = f"\ninterval [{_tokens(interval[0])}, {high}]"
        label = f"{what}:\n{entry['growth']} vs {entry['control']}\nat {_tokens(at)} tokens{shown}"
        marks.append((label, at, interval, style))
    return marks


def _original_loss(budget: dict) -> float:
    losses = [_num(a.get("test_loss")) for a in budget["arms"].values() if a.get("kind") == "original"]
    return losses[0] if losses else math.nan


def _loss_interval(arm: dict, original: float, used: set) -> tuple[float, float]:
    """The arm's test-loss interval: `test_interval` when the sweep gives one, else its gain's interval carried
    to the loss (`original - gain`: paired with the original on the same examples). `used` collects which."""
    if arm.get("test_interval"):
        used.add("test")
        return _num(arm["test_interval"][0]), _num(arm["test_interval"][1])
    _, low, high = _interval(arm.get("gain"))
    if math.isfinite(original) and math.isfinite(low) and math.isfinite(high):
        used.add("gain")
    return original - high, original - low


def _curves_caption(sweep: dict, fits: dict, shaded: bool, bars: set) -> str:
    crossover = sweep.get("crossover") or {}
    texts = []
    for key, prefix in (("on_gain", "On gain: "), ("within_forgetting", "Within the forgetting budget: ")):
        entry = crossover.get(key)
        if isinstance(entry, dict) and entry.get("text"):
            texts.append(f"{prefix}{entry['text']}.")
    if not fits:
        texts.append("No fitted curves in this sweep (a fit needs at least 3 budgets): lines join the measured points.")
    flat = sorted(name for name, fit in fits.items() if (fit or {}).get("flat"))
    if flat:
        texts.append(f"Dotted: flat fits (no measurable learning over these budgets): {', '.join(flat)}.")
    if "test" in bars:
        texts.append("Bars: intervals of the test loss.")
    elif "gain" in bars:
        texts.append("Bars: each gain's interval carried to the test loss (paired with the original).")
    if shaded:
        texts.append("Shaded: the bootstrap interval of the first crossover.")
    return " ".join(texts)
