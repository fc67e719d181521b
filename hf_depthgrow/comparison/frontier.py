"""The gain x forgetting frontier, the choice within a forgetting budget, and the control curve.

Gain is a trained point's paired loss reduction on the training domain (higher is better); forgetting is
its loss increase on a general-domain retention set (lower is better). A *point* is one trial at one budget:
an arm kind at one learning rate (and seed). Training methods trade one axis for the other, and within a
kind the learning rate moves along the trade: LoRA and full fine-tuning lie on one learning-vs-forgetting
curve (arXiv:2405.09673), traced by their rates, so a method is better only if it moves *off* that curve.
Three questions, each answered over every trained point, growth and controls alike:

- **The frontier**: the points no other point beats on both axes (the original, gain 0 and forgetting 0,
  is one of the candidates: training nothing is always an option).
- **Within a forgetting budget** `eps`: the best-gain point whose forgetting's upper bound stays within
  eps, the bound corrected for every candidate point (choosing one of many is inside the bound).
- **Off the control curve**: every control point (each kind at every rate, low rates included) and the
  original trace a curve (their lower envelope: the least forgetting seen at each gain). A growth point is off
  the curve when, at its gain, it forgets less than the curve, by a paired bootstrap interval (`off_curve`); a
  point that is not off names the control that dominates it, where one does.

Choices (the frontier, the point within eps) use held-out data only: the domain's held-out loss and the
retention set's selection part. The curve test is a reported claim, made on the test parts.
"""

from __future__ import annotations

import numpy as np


def pareto(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the points `(gain, forgetting)` no other point dominates (gain >= and forgetting <=, one strictly).

    Example:
        ```python
        >>> pareto({"a": (0.5, 0.3), "b": (0.3, 0.0), "c": (0.2, 0.1), "original": (0.0, 0.0)})
        ['a', 'b']
        ```
    """
    def dominated(g, f):
        return any((g2 >= g and f2 <= f) and (g2 > g or f2 < f) for g2, f2 in points.values())

    return sorted((n for n, (g, f) in points.items() if not dominated(g, f)), key=lambda n: (-points[n][0], n))


def best_within(gain: dict[str, float], forgetting_high: dict[str, float], eps: float) -> str:
    """The arm with the largest gain whose forgetting upper bound is <= `eps`; `"original"` if none qualifies."""
    eligible = {n: g for n, g in gain.items() if forgetting_high.get(n, np.inf) <= eps}
    eligible.setdefault("original", 0.0)
    return max(eligible, key=lambda n: (eligible[n], n == "original"))


def envelope(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lower envelope of `points[:, (gain, forgetting)]` (plus the origin): increasing gains and their forgetting."""
    pts = np.vstack([[0.0, 0.0], points])
    order = np.lexsort((pts[:, 1], -pts[:, 0]))  # by gain, descending; ties: least forgetting first
    gains, forgets, best = [], [], np.inf
    for g, f in pts[order]:
        if f < best:  # sweeping down the gains, keep a point only if it forgets less than every larger-gain one
            gains.append(g)
            forgets.append(f)
            best = f
    return np.array(gains[::-1]), np.array(forgets[::-1])


def curve_at(gains: np.ndarray, forgets: np.ndarray, g: float) -> float:
    """The envelope's forgetting at gain `g` (linear between points; flat past the ends)."""
    return float(np.interp(g, gains, forgets))


class _Resampler:
    """Bootstrap means of per-example values over `n` examples, resampling examples, or their documents (`clusters`)."""

    def __init__(self, n: int, clusters, rng, n_bootstrap: int):
        from ..evaluation.bounds import cluster_codes

        self.codes, k = cluster_codes(clusters, n) if clusters is not None else (np.arange(n), n)
        self.draws = rng.integers(0, k, size=(n_bootstrap, k))
        self.k = k
        self.sizes = np.bincount(self.codes, minlength=k).astype(np.float64)[self.draws].sum(axis=1)

    def means(self, values: np.ndarray) -> np.ndarray:
        sums = np.bincount(self.codes, weights=np.asarray(values, dtype=np.float64), minlength=self.k)
        return sums[self.draws].sum(axis=1) / self.sizes


def dominating(point: tuple[float, float], controls: dict[str, tuple[float, float]]) -> str | None:
    """The control that gains at least as much as `point = (gain, forgetting)` and forgets the least, if it forgets no more.

    Ties on forgetting go to the larger gain. `None` when no control gains as much and forgets no more.

    Example:
        ```python
        >>> dominating((0.5, 0.2), {"full@lr1e-05": (0.55, 0.05), "full@lr0.0003": (0.9, 0.6)})
        'full@lr1e-05'
        ```
    """
    g, f = point
    found = [(cf, -cg, n) for n, (cg, cf) in controls.items() if cg >= g and cf <= f]
    return min(found)[2] if found else None


def off_curve(
    gain: dict[str, np.ndarray],
    forgetting: dict[str, np.ndarray],
    controls: list[str],
    growth: list[str],
    *,
    delta: float = 0.05,
    tests: int | None = None,
    n_bootstrap: int = 2000,
    seed: int = 0,
    test_clusters=None,
    retention_clusters=None,
) -> dict:
    """Is each growth point off the controls' learning-vs-forgetting curve? A paired bootstrap answer.

    The curve is the lower envelope of every control point given (each kind at every rate and budget the
    caller passes, low rates included), recomputed on each resample, so choosing the curve's points from the
    set is inside the interval.

    Args:
        gain: Per point, per test example `loss(original) - loss(point)` (the same examples for every point).
        forgetting: Per point, per retention example `loss(point) - loss(original)`.
        controls, growth: Which points trace the curve, and which are tested against it.
        delta: Family-wise error of the curve tests (Bonferroni).
        tests: Tests in the family (default: `len(growth)`): the caller's count across budgets and seeds.
        test_clusters, retention_clusters: The document of each test / retention example (optional): documents are
            then resampled, all their examples together (the same draws as examples when each is its own document).

    Returns:
        `{"curve": [[gain, forgetting], ...], "curve_points": [names], "controls": {name: (gain, forgetting)}
        (means, the original's (0, 0) included), "level", "tests", "arms": {name: {"gain",
        "forgetting", "curve", "margin": {mean, low, high}, "status", "dominated_by"}}}`; margin = the curve's
        forgetting at the point's gain minus the point's (positive: it forgets less). status: `"off the curve"`
        (low > 0), `"forgets more than the curve"` (high < 0), `"on the curve"` otherwise; `dominated_by`: the
        control that gains at least as much and forgets no more (`dominating`, on the means). `None` without
        controls or growth.
    """
    if not controls or not growth:
        return None
    rng = np.random.default_rng(seed)
    n_test, n_ret = len(next(iter(gain.values()))), len(next(iter(forgetting.values())))
    names = controls + growth
    test = _Resampler(n_test, test_clusters, rng, n_bootstrap)
    ret = _Resampler(n_ret, retention_clusters, rng, n_bootstrap)
    g_boot = np.stack([test.means(gain[n]) for n in names], axis=1)  # (resample, point)
    f_boot = np.stack([ret.means(forgetting[n]) for n in names], axis=1)
    g_mean = {n: float(gain[n].mean()) for n in names}
    f_mean = {n: float(forgetting[n].mean()) for n in names}
    c, k = len(controls), len(growth)
    margins = np.empty((n_bootstrap, k))
    for b in range(n_bootstrap):  # one envelope per resample, every growth point read off it
        gb, fb = envelope(np.stack([g_boot[b, :c], f_boot[b, :c]], axis=1))
        margins[b] = np.interp(g_boot[b, c:], gb, fb) - f_boot[b, c:]
    gains, forgets = envelope(np.array([[g_mean[n], f_mean[n]] for n in controls]))
    tests = tests or k
    alpha = delta / tests
    on_curve = [n for n in controls if any(abs(g_mean[n] - x) < 1e-15 and abs(f_mean[n] - y) < 1e-15 for x, y in zip(gains, forgets))]
    out = {"curve": [[float(a), float(b)] for a, b in zip(gains, forgets)], "curve_points": on_curve, "level": alpha,
           "tests": tests, "arms": {}}
    means = {"original": (0.0, 0.0)} | {n: (g_mean[n], f_mean[n]) for n in controls}  # training nothing dominates too
    out["controls"] = means
    for j, name in enumerate(growth):
        mean = curve_at(gains, forgets, g_mean[name]) - f_mean[name]
        low, high = (float(x) for x in np.quantile(margins[:, j], [alpha / 2, 1 - alpha / 2]))
        status = "off the curve" if low > 0 else "forgets more than the curve" if high < 0 else "on the curve"
        out["arms"][name] = {"gain": g_mean[name], "forgetting": f_mean[name], "curve": curve_at(gains, forgets, g_mean[name]),
                             "margin": {"mean": mean, "low": low, "high": high}, "status": status,
                             "dominated_by": dominating((g_mean[name], f_mean[name]), means)}
    return out
