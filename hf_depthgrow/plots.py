"""The figure helpers every room draws with, and the figures of the whole job: training curves, compare's arms, the probe's validation.

Figures are built on matplotlib's object API (`Figure` + the Agg canvas): no global backend
switch and no pyplot figure registry, so plotting is safe in servers and threads. Each file is
written to a temporary name beside its target and moved into place, so a reader never sees a
half-written image. A figure that needs a room's own knowledge lives with that room
(`probe.plots`, `evaluation.plots`, `scaling.plots`, `comparison.plots`) and draws with `new_figure`
and `save_figure`; this module imports no room of the package.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np


def new_figure(figsize=(6.4, 4.2), dpi: int = 110):
    """A matplotlib `Figure` with an Agg canvas attached (what `pyplot.subplots` does, without the global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path, *, dpi: int | None = None, **kwargs) -> Path:
    """Save `fig` to `path` atomically and with the usual file mode (`hf_depthgrow.utils.atomic_path`)."""
    from .utils import atomic_path

    path = Path(path)
    with atomic_path(path, suffix=path.suffix or ".png") as tmp:
        fig.savefig(tmp, format=(path.suffix.lstrip(".") or "png"), dpi=dpi or fig.dpi, **kwargs)
    return path


def plot_training(train_result, path: Path, *, title: str | None = None, control=None, control_label: str = "control") -> None:
    """Save the training and held-out loss curves (see `training_figure`)."""
    save_figure(training_figure(train_result, title=title, control=control, control_label=control_label), path, dpi=120)


def training_figure(train_result, *, title: str | None = None, control=None, control_label: str = "control"):
    """Training loss and held-out loss against the step; with `control` (another `TrainResult` at the same
    budget, e.g. the equal-parameter control) its curves too, dashed, in another colour."""
    fig = new_figure(figsize=(6, 3.5))
    ax = fig.subplots()
    runs = [("grown", train_result, "-", "tab:blue")]
    if control is not None:
        runs.append((control_label, control, "--", "tab:orange"))
    for name, result, style, colour in runs:
        if result.history:
            ax.plot([h["step"] for h in result.history], [h["loss"] for h in result.history], style, color=colour, alpha=0.6,
                    lw=1, label=f"{name}: train loss")
        if result.eval_history:
            ax.plot([h["step"] for h in result.eval_history], [h["eval_loss"] for h in result.eval_history], "o" + style,
                    color=colour, label=f"{name}: held-out loss")
    ax.set_title(title or ("training: grown model against the control" if control is not None else "training of the grown model"), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def colour(i: int, n: int):
    """The `i`-th of `n` colours spread over viridis (the palette of the multi-series figures)."""
    return matplotlib.colormaps.get_cmap("viridis")(0.15 + 0.7 * i / max(1, n - 1))


_KIND_COLOURS = {"growth": "tab:blue", "layers": "tab:orange", "lora": "tab:green", "full": "tab:red", "original": "tab:gray"}


def plot_comparison(result, path) -> Path:
    """Realized test delta of every arm against the original, with its corrected interval (left), and,
    for single-block growth arms, the delta by position with the probe's signal on a second axis (right).
    """
    fig = new_figure(figsize=(11, 4.2))
    ax, ax_pos = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    vs = result.statistics["vs_original"]["arms"]
    names = [a.name for a in result.arms if a.name in vs]
    kinds = {a.name: a.kind for a in result.arms}
    means = np.array([vs[n]["mean"] for n in names])
    lows, highs = np.array([vs[n]["low"] for n in names]), np.array([vs[n]["high"] for n in names])
    x = np.arange(len(names))
    ax.bar(x, means, color=[_KIND_COLOURS.get(kinds[n], "tab:purple") for n in names])
    # clipped: a percentile bootstrap's interval may exclude its mean (few resamples), and matplotlib refuses a negative bar
    ax.errorbar(x, means, yerr=np.clip([means - lows, highs - means], 0.0, None), fmt="none", ecolor="black", capsize=3)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("test delta vs original (nats, + = better)")
    ax.set_title(f"arms at an equal budget ({result.statistics['vs_original']['method']}-corrected)", fontsize=10)
    single = [a for a in result.arms if a.kind == "growth" and len(a.arm.get("positions") or []) == 1]
    if single:
        pos = np.array([a.arm["positions"][0] for a in single])
        order = np.argsort(pos)
        d = np.array([vs[a.name]["mean"] for a in single])[order]
        lo = np.array([vs[a.name]["low"] for a in single])[order]
        hi = np.array([vs[a.name]["high"] for a in single])[order]
        ax_pos.errorbar(pos[order], d, yerr=np.clip([d - lo, hi - d], 0.0, None), fmt="o-", color="tab:blue", capsize=3, label="realized delta")
        for a in result.arms:
            if a.kind in ("layers", "lora", "full") and a.name in vs:
                ax_pos.axhline(vs[a.name]["mean"], color=_KIND_COLOURS[a.kind], linestyle="--", linewidth=1, label=f"control: {a.name}")
        ax_pos.set_xlabel("insertion position k")
        ax_pos.set_ylabel("test delta (nats)")
        if result.probe:
            twin = ax_pos.twinx()
            twin.plot(result.probe["positions"], result.probe["signal"], color="tab:purple", alpha=0.6, label="probe signal")
            twin.set_ylabel("probe signal ||G_S(k)||", color="tab:purple")
        ax_pos.legend(fontsize=7, loc="best")
        ax_pos.set_title("single-block growth by position", fontsize=10)
    else:
        ax_pos.set_axis_off()
    fig.tight_layout()
    return save_figure(fig, path)


def plot_validation(validation, path) -> Path:
    """Realized gain by position (seed-averaged, corrected interval; seeds as dots) against each predictor's
    scores, min-max scaled to the realized range so the rankings can be compared by eye."""
    fig = new_figure(figsize=(8, 4.4))
    ax = fig.add_subplot(1, 1, 1)
    pos = np.array(validation.positions)
    rows = validation.intervals["arms"]
    real = np.array(validation.realized)
    low = np.array([rows[f"at:{k}"]["low"] for k in pos])
    high = np.array([rows[f"at:{k}"]["high"] for k in pos])
    ax.errorbar(pos, real, yerr=np.clip([real - low, high - real], 0.0, None), fmt="o-", color="black", capsize=3, label="realized (mean of seeds)", zorder=3)
    for seed, values in validation.realized_by_seed.items():
        ax.plot(pos, values, ".", color="gray", alpha=0.6)
    span = (real.min(), real.max()) if np.ptp(real) > 0 else (real.min() - 1e-3, real.max() + 1e-3)
    for i, (name, scores) in enumerate(validation.scores.items()):
        s = np.asarray(scores, dtype=float)
        if not np.all(np.isfinite(s)) or np.ptp(s) == 0:
            continue
        scaled = span[0] + (s - s.min()) / np.ptp(s) * (span[1] - span[0])
        ax.plot(pos, scaled, "--", color=colour(i, len(validation.scores)), alpha=0.8, label=f"{name} (scaled)")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("insertion position k")
    ax.set_ylabel("test delta vs original (nats, + = better)")
    ax.set_title("does the predictor rank positions as training does?", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)
