"""The gain x forgetting frontier, the choice within a forgetting budget, and the control curve.

Gain is an arm's paired loss reduction on the training domain (higher is better); forgetting is its loss
increase on a general-domain retention set (lower is better). Training methods trade one for the other:
LoRA and full fine-tuning lie on one learning-vs-forgetting curve (arXiv:2405.09673), so a method is
better only if it moves *off* that curve. Three questions, each answered here:

- **The frontier**: the arms no other arm beats on both axes (the original, gain 0 and forgetting 0, is
  one of the candidates: training nothing is always an option).
- **Within a forgetting budget** `eps`: the best-gain arm whose forgetting's upper bound stays within eps.
- **Off the control curve**: the controls (LoRA at several ranks, `layers`, `full`) and the original trace
  a curve (their lower envelope: the least forgetting seen at each gain, linear in between, flat past the
  largest gain). A growth arm is off the curve when, at its gain, it forgets less than the curve, with a
  paired bootstrap interval over test and retention examples (Bonferroni across growth arms); where the
  examples name their documents, documents are resampled instead (`evaluation.bounds`).

Choices (the frontier, the arm within eps) use held-out data only: the domain's held-out loss and the
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


def off_curve(
    gain: dict[str, np.ndarray],
    forgetting: dict[str, np.ndarray],
    controls: list[str],
    growth: list[str],
    *,
    delta: float = 0.05,
    n_bootstrap: int = 2000,
    seed: int = 0,
    test_clusters=None,
    retention_clusters=None,
) -> dict:
    """Is each growth arm off the controls' learning-vs-forgetting curve? A paired bootstrap answer.

    Args:
        gain: Per arm, per test example `loss(original) - loss(arm)` (the same examples for every arm).
        forgetting: Per arm, per retention example `loss(arm) - loss(original)`.
        controls, growth: Which arms trace the curve, and which are tested against it.
        delta: Family-wise error across the growth arms (Bonferroni).
        test_clusters, retention_clusters: The document of each test / retention example (optional): documents are
            then resampled, all their examples together (the same draws as examples when each is its own document).

    Returns:
        `{"curve": [[gain, forgetting], ...], "arms": {name: {"gain", "forgetting", "curve", "margin": {mean,
        low, high}, "status"}}}`; margin = curve forgetting at the arm's gain minus the arm's forgetting (positive:
        the arm forgets less). status: `"off the curve"` (low > 0), `"forgets more than the curve"` (high < 0),
        `"on the curve"` otherwise. `None` without controls.
    """
    if not controls or not growth:
        return None
    rng = np.random.default_rng(seed)
    n_test, n_ret = len(next(iter(gain.values()))), len(next(iter(forgetting.values())))
    names = controls + growth
    test = _Resampler(n_test, test_clusters, rng, n_bootstrap)
    ret = _Resampler(n_ret, retention_clusters, rng, n_bootstrap)
    g_boot = {n: test.means(gain[n]) for n in names}
    f_boot = {n: ret.means(forgetting[n]) for n in names}
    g_mean = {n: float(gain[n].mean()) for n in names}
    f_mean = {n: float(forgetting[n].mean()) for n in names}
    gains, forgets = envelope(np.array([[g_mean[c], f_mean[c]] for c in controls]))
    alpha = delta / len(growth)
    out = {"curve": [[float(a), float(b)] for a, b in zip(gains, forgets)], "level": alpha, "arms": {}}
    for name in growth:
        margins = np.empty(n_bootstrap)
        for b in range(n_bootstrap):
            gb, fb = envelope(np.array([[g_boot[c][b], f_boot[c][b]] for c in controls]))
            margins[b] = curve_at(gb, fb, g_boot[name][b]) - f_boot[name][b]
        mean = curve_at(gains, forgets, g_mean[name]) - f_mean[name]
        low, high = (float(x) for x in np.quantile(margins, [alpha / 2, 1 - alpha / 2]))
        status = "off the curve" if low > 0 else "forgets more than the curve" if high < 0 else "on the curve"
        out["arms"][name] = {"gain": g_mean[name], "forgetting": f_mean[name], "curve": curve_at(gains, forgets, g_mean[name]),
                             "margin": {"mean": mean, "low": low, "high": high}, "status": status}  # fmt: skip
    return out
