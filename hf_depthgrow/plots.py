"""Every figure the package draws, in one place.

Figures are built on matplotlib's object API (`Figure` + the Agg canvas): no global backend
switch and no pyplot figure registry, so plotting is safe in servers and threads. Each file is
written to a temporary name beside its target and moved into place, so a reader never sees a
half-written image.
"""

from __future__ import annotations

import math
from pathlib import Path

from typing import TYPE_CHECKING

import matplotlib
import numpy as np

if TYPE_CHECKING:
    from .evaluation.paired import EvalResult
    from .probe.signal import ProbeResult
    from .scaling.fit import PowerLawFit


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


def plot_probe(result: ProbeResult, path, *, title: str | None = None, chosen=None) -> None:
    """Save a two-panel PNG: the signals with error bars vs depth, and the z-scores (see `probe_figure`)."""
    save_figure(probe_figure(result, title=title, chosen=chosen), path, dpi=120)


def probe_figure(result: ProbeResult, *, title: str | None = None, chosen=None):
    """The probe's figure: the signals with error bars vs depth, and the z-scores, the chosen k marked.

    Top: the empirical `||G_S||^2` and the unbiased population estimate of `||G_D||^2` with
    +-2 standard errors (symmetric-log scale, since the estimate can be negative). Bottom: z-scores
    with the verdict's threshold, labelled as such (`z > -1` by default: calibrated against certified
    gains, see `probe.result.threshold_note`); improvable positions are filled. `chosen`: the positions
    grown at (a dotted line on both panels); `None` marks the probe's own pick, `recommendation["best"]`,
    when it has one; `[]` marks nothing.
    """
    from .probe.signal import Z_THRESHOLD  # the probe imports this module

    k = result.positions
    emp = [s * s for s in result.signal]
    pop = [math.nan if v is None else v for v in result.population]
    se = [0.0 if v is None or math.isnan(v) else v for v in result.population_se]
    z = [math.nan if v is None else v for v in result.z]
    fig = new_figure(figsize=(8, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(k, emp, "o-", color="tab:gray", label=r"empirical $\|G_S\|^2$ (all data)")
    top.errorbar(k, pop, yerr=[2 * s for s in se], fmt="s", color="tab:blue", capsize=3,
                 label=r"population $\widehat{\|G_D\|^2}$ $\pm$ 2 se")
    finite = [abs(v) for v in pop + emp if v == v and v != 0]
    scale = [2 * s for s in se if s > 0]
    linthresh = min(scale) if scale else (min(finite) if finite else 1.0)
    top.set_yscale("symlog", linthresh=max(linthresh, 1e-30))
    top.axhline(0.0, color="black", lw=0.6)
    top.set_ylabel("squared signal")
    top.legend(loc="best", fontsize=8)
    colors = ["tab:green" if ok else "white" for ok in result.improvable]
    bottom.bar(k, [0 if v != v else v for v in z], color=colors, edgecolor="tab:green")
    # The line is the verdict's threshold; say which, or a reader takes z = -1 for a test at some level.
    rule = "calibrated on certified gains" if result.z_threshold == Z_THRESHOLD else "z_threshold of this probe"
    bottom.axhline(result.z_threshold, color="tab:red", ls="--", lw=1, label=f'"improvable" verdict: z > {result.z_threshold:g} ({rule})')
    bottom.axhline(0.0, color="black", lw=0.6)
    what = "grown at"
    if chosen is None:
        best = result.recommendation.get("best")
        chosen, what = ([] if best is None else [best]), "the probe's pick:"
    for i, position in enumerate(sorted(chosen)):
        for ax in (top, bottom):
            ax.axvline(position, color="tab:orange", ls=":", lw=1.5,
                       label=f"{what} k = {', '.join(map(str, sorted(chosen)))}" if i == 0 and ax is bottom else None)  # fmt: skip
    bottom.set_ylabel("z-score")
    bottom.set_xlabel("insertion position k (0 = after embeddings, L = before final norm)")
    bottom.legend(loc="best", fontsize=8)
    fig.suptitle(title or f"{result.model_type}: first-order signal of a {result.block} block "
                 f"({result.num_batches} batches, {result.total_weight:.0f} {result.weight_unit})", fontsize=10)
    fig.tight_layout()
    return fig


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
                    lw=1, label=f"{name}: train loss")  # fmt: skip
        if result.eval_history:
            ax.plot([h["step"] for h in result.eval_history], [h["eval_loss"] for h in result.eval_history], "o" + style,
                    color=colour, label=f"{name}: held-out loss")  # fmt: skip
    ax.set_title(title or ("training: grown model against the control" if control is not None else "training of the grown model"), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


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
    from .evaluation.bounds import INTERVALS

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


def _colour(i: int, n: int):
    return matplotlib.colormaps.get_cmap("viridis")(0.15 + 0.7 * i / max(1, n - 1))


def _plot_covariance(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """Covariance off-diagonal share against relative position, largest data."""
    from .scaling.report import NEAR_DIAGONAL

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
                    color=_colour(widths.index(r["width"]), len(widths)), label=f"d={r['width']}, L={r['depth']}")
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
            ax.errorbar([r["depth"] for r in sel], ys, yerr=es, fmt="o-", capsize=2, color=_colour(i, len(widths)), label=f"d={w}")
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
                ax.errorbar(r["probe"]["positions"], pop, yerr=se, fmt="o-", capsize=2, color=_colour(i, len(widths)), label=f"d={w}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(title=f"{name} (n={n_big}): by position, L={depths[-1]}", xlabel="position k", ylabel="population signal ||G_D||²",
               xticks=list(range(depths[-1] + 1)))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out / "signal_depth.png", dpi=120, bbox_inches="tight")



def _plot_z_width(rows: list[dict], found: dict, out: Path, names: list[str]) -> Path:
    """z against width at fixed (smallest) data."""
    from .scaling.report import best_value

    fig, axes = _panels("Observability: best-position z-score against width at fixed data", names)
    for ax, name in zip(axes, names):
        cells = [r for r in rows if r["name"] == name]
        n_fixed = found[name]["z_grows_with_width"]["data_size"]
        depths = sorted({r["depth"] for r in cells})
        for i, L in enumerate(depths):
            sel = sorted((r for r in cells if r["depth"] == L and r["data_size"] == n_fixed), key=lambda r: r["width"])
            ax.plot([r["width"] for r in sel], [best_value(r, "z") for r in sel], "o-", color=_colour(i, len(depths)), label=f"L={L}")
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
        ax.plot(pos, scaled, "--", color=_colour(i, len(validation.scores)), alpha=0.8, label=f"{name} (scaled)")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("insertion position k")
    ax.set_ylabel("test delta vs original (nats, + = better)")
    ax.set_title("does the predictor rank positions as training does?", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)
