"""The probe's figure: the signals with error bars against depth, and the z-scores with the verdict's threshold."""

from __future__ import annotations

import math

from ..plots import new_figure, save_figure
from .result import Z_THRESHOLD, ProbeResult


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
                       label=f"{what} k = {', '.join(map(str, sorted(chosen)))}" if i == 0 and ax is bottom else None)
    bottom.set_ylabel("z-score")
    bottom.set_xlabel("insertion position k (0 = after embeddings, L = before final norm)")
    bottom.legend(loc="best", fontsize=8)
    fig.suptitle(title or f"{result.model_type}: first-order signal of a {result.block} block "
                 f"({result.num_batches} batches, {result.total_weight:.0f} {result.weight_unit})", fontsize=10)
    fig.tight_layout()
    return fig
