"""Statistics that let the evidence decide between plans.

Two questions, both on numbers already measured:

- **Which arms improved?** Several arms (growth at different positions, control arms that train
  existing layers or LoRA at a matched parameter count) are evaluated paired on the same test
  examples. `corrected_intervals` certifies improvements with the family-wise error held at `delta`
  across arms (Bonferroni or Holm), with the intervals themselves from `evaluation.bounds`.
- **Does a probe signal predict the realized gain?** `spearman`, `partial_spearman` (depth
  partialled out), `top_k_hit_rate`, `regret` and `predictor_table`, one row per predictor.

Per-example differences follow `bounds`: `d_i = l_i(original) - l_i(arm)`, positive = the arm is
better. Realized gains are "higher = better"; so are predictor scores (negate a score that ranks
low = better before passing it). Pure numpy/scipy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.stats import rankdata

from .bounds import (
    INTERVALS,
    bernstein_interval,
    bootstrap_interval,
    bootstrap_means,
    check_bound,
    cluster_codes,
    hoeffding_interval,
)

METHODS = ("holm", "bonferroni")
_PERM_CHUNK = 512  # permutations per draw, to bound memory


class Correlation(NamedTuple):
    """A rank correlation and its two-sided permutation p-value (unpacks as `rho, p = ...`)."""

    rho: float
    p_value: float


# --------------------------------------------------------------------------- multiple arms


def _check_arms(diffs_by_arm) -> dict[str, np.ndarray]:
    if not isinstance(diffs_by_arm, dict) or not diffs_by_arm:
        raise ValueError("diffs_by_arm must be a non-empty dict {arm name: per-example differences}")
    arms = {str(name): np.asarray(d, dtype=np.float64).reshape(-1) for name, d in diffs_by_arm.items()}
    sizes = {name: d.size for name, d in arms.items()}
    if min(sizes.values()) == 0:
        raise ValueError(f"arms without differences: {[n for n, s in sizes.items() if s == 0]}")
    if len(set(sizes.values())) > 1:
        # The arms are evaluated paired on the same test examples, so their lengths must agree.
        raise ValueError(f"arms have different numbers of examples (they must share the test set): {sizes}")
    bad = [name for name, d in arms.items() if not np.all(np.isfinite(d))]
    if bad:
        raise ValueError(f"non-finite differences in arms {bad}")
    return arms


def _bootstrap_p(means: np.ndarray) -> tuple[float, int]:
    """Smallest alpha whose percentile interval `quantile(means, [alpha/2, 1-alpha/2])` excludes 0.

    Inverts numpy's linear-interpolation quantile, so `p < alpha` exactly when the interval from
    `bounds.bootstrap_interval` at level alpha (same seed) has `low > 0` or `high < 0`.
    """
    s, n = np.sort(means), means.size

    def crossing(count: int) -> float:
        # Quantile level where Q crosses 0 between s[count-1] and s[count] (which differ in sign,
        # or the first is 0), on numpy's grid h = q (n - 1).
        if count in (0, n):
            return float(count > 0)
        lo, hi = s[count - 1], s[count]
        return ((count - 1) - lo / (hi - lo)) / (n - 1)

    if n == 1:
        return (0.0, int(np.sign(s[0]))) if s[0] != 0 else (1.0, 0)
    q_low = crossing(int((s <= 0).sum()))  # Q(q) <= 0 for q <= q_low
    q_high = crossing(int((s < 0).sum()))  # Q(q) >= 0 for q >= q_high
    p_up, p_down = 2.0 * q_low, 2.0 * (1.0 - q_high)
    return min(1.0, p_up, p_down), (1 if p_up <= p_down else -1)


def _arm_test(d: np.ndarray, kind: str, level: float, bound, n_bootstrap: int, seed: int, clusters=None) -> dict:
    """Interval at `level` and the dual two-sided p-value (smallest level that excludes 0)."""
    mean = float(d.mean())
    if kind == "bootstrap":
        low, high = bootstrap_interval(d, level, n_bootstrap=n_bootstrap, seed=seed, clusters=clusters)
        p, sign = _bootstrap_p(bootstrap_means(d, n_bootstrap, seed, clusters=clusters))
    elif kind == "hoeffding":
        low, high = hoeffding_interval(d, level, bound)
        # half(alpha) = 2B sqrt(ln(2/alpha) / (2m)) < |mean|  <=>  alpha > 2 exp(-m mean^2 / (2 B^2))
        p, sign = min(1.0, 2.0 * math.exp(-d.size * mean**2 / (2.0 * bound**2))), int(np.sign(mean))
    else:
        low, high = bernstein_interval(d, level, bound)
        # half = a sqrt(L) + b L with L = ln(4/alpha): solve the quadratic in sqrt(L) for half = |mean|.
        a = math.sqrt(2.0 * float(d.var(ddof=1)) / d.size)
        b = 7.0 * 2.0 * bound / (3.0 * (d.size - 1))
        root = (-a + math.sqrt(a * a + 4.0 * b * abs(mean))) / (2.0 * b)
        p, sign = min(1.0, 4.0 * math.exp(-root * root)), int(np.sign(mean))
    return {"mean": mean, "low": low, "high": high, "p_value": float(p), "sign": sign}


def _holm(p_values: dict[str, float], delta: float) -> set[str]:
    """Arms rejected by Holm's step-down: the j-th smallest p (from 0) is tested at delta/(m - j)."""
    order = sorted(p_values, key=lambda name: p_values[name])  # stable: ties keep arm order
    rejected: set[str] = set()
    for j, name in enumerate(order):
        # Strict `<`, matching `low > 0` for the intervals, so Holm contains Bonferroni exactly.
        if not p_values[name] < delta / (len(order) - j):
            break
        rejected.add(name)
    return rejected


def corrected_intervals(
    diffs_by_arm: dict,
    *,
    delta: float = 0.05,
    method: str = "holm",
    kind: str = "bootstrap",
    loss_bound: float | None = None,
    n_bootstrap: int = 2000,
    seed: int = 0,
    clusters=None,
) -> dict:
    """Per-arm paired intervals for the mean delta, with family-wise error `delta` across arms.

    Each arm's interval comes from `evaluation.bounds` (`kind`). Its p-value is two-sided and dual to
    that interval: the smallest level at which the interval excludes 0 (for the bootstrap, the
    inverted percentile interval, the same seed and resamples for every arm, since they share the
    test examples). An arm is **certified** (an improvement) when its two-sided null is rejected and
    the interval lies above 0, so a certification errs with probability at most delta/2 in total
    under H0: mean <= 0; `worse` lists the arms rejected below 0. Bernstein and Hoeffding hold in
    finite samples; the bootstrap only asymptotically (with 4 null arms of 200 examples, its
    family-wise rate of any rejection was ~0.06 at delta = 0.05 over 1000 simulations).

    - `"bonferroni"`: rejected when `p < delta / m` (the interval at `delta / m` excludes 0).
    - `"holm"`: step-down on the sorted p-values at `delta / m, delta / (m-1), ...`; certifies at
      least the Bonferroni set. The reported `low`/`high` are still the Bonferroni-level
      (`delta / m`) intervals, for display: Holm's later steps have no simultaneous interval.

    Args:
        diffs_by_arm: `{arm: d_i = loss_original - loss_arm}` per example, equal lengths.
        delta: family-wise error level in (0, 1).
        method: `"holm"` or `"bonferroni"`.
        kind: `"bootstrap"` (no bound, asymptotic), `"bernstein"` or `"hoeffding"` (finite-sample).
        loss_bound: B for Bernstein/Hoeffding, whose differences must lie in [-B, B] (clip the
            losses to [0, B] first); ignored by the bootstrap.
        n_bootstrap, seed: the paired resamples, shared by all arms.
        clusters (*optional*): one document label per example (the arms share the examples): the bootstrap then
            resamples documents, all blocks of a drawn document together (`bounds.bootstrap_interval`);
            Bernstein and Hoeffding ignore it.

    Returns:
        `{"method", "kind", "delta", "level", "certified": [arms], "worse": [arms], "arms": {arm:
        {"mean", "low", "high", "p_value", "certified", "worse"}}}`; `level = delta / m`.

    Example:
        ```python
        >>> out = corrected_intervals({"a": [0.3, 0.2, 0.4] * 20, "b": [0.1, -0.1, 0.0] * 20}, seed=0)
        >>> out["certified"]
        ['a']
        ```
    """
    arms = _check_arms(diffs_by_arm)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if kind not in INTERVALS:
        raise ValueError(f"kind must be one of {INTERVALS}, got {kind!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if kind != "bootstrap":
        loss_bound = check_bound(loss_bound)
    level = delta / len(arms)
    if clusters is not None:
        clusters = cluster_codes(clusters, next(iter(arms.values())).size)[0]  # checked once, the same for every arm
    rows = {name: _arm_test(d, kind, level, loss_bound, n_bootstrap, seed, clusters) for name, d in arms.items()}
    p_values = {name: row["p_value"] for name, row in rows.items()}
    if method == "holm":
        rejected = _holm(p_values, delta)
    else:
        rejected = {name for name, p in p_values.items() if p < level}
    for name, row in rows.items():
        sign = row.pop("sign")
        row["certified"] = name in rejected and sign > 0
        row["worse"] = name in rejected and sign < 0
    return {
        "method": method,
        "kind": kind,
        "delta": delta,
        "level": level,
        "certified": [name for name in rows if rows[name]["certified"]],
        "worse": [name for name in rows if rows[name]["worse"]],
        "arms": rows,
    }


# --------------------------------------------------------------------------- rank correlations


def _vector(values, name: str, n: int | None = None, min_size: int = 1) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name} has non-finite values at positions {np.flatnonzero(~np.isfinite(v))[:10].tolist()}")
    if n is not None and v.size != n:
        raise ValueError(f"{name} has {v.size} values, expected {n} (one per candidate)")
    if v.size < min_size:
        raise ValueError(f"{name} has {v.size} values; this needs at least {min_size}")
    return v


def _centered_unit(v: np.ndarray, name: str) -> np.ndarray:
    c = v - v.mean()
    norm = float(np.sqrt(c @ c))
    if norm <= 1e-12 * max(1.0, float(np.abs(v).max())):
        raise ValueError(f"{name} is constant, so the correlation is undefined")
    return c / norm


def _permutation_corr(a: np.ndarray, b: np.ndarray, n_permutations: int, seed: int) -> Correlation:
    """Pearson of `a` and `b`, and the two-sided p-value of permuting `a` against `b`."""
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be >= 1, got {n_permutations}")
    rho = float(np.clip(a @ b, -1.0, 1.0))
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_permutations, _PERM_CHUNK):
        rows = min(_PERM_CHUNK, n_permutations - start)
        perms = rng.permuted(np.tile(a, (rows, 1)), axis=1)
        # Tolerance, so that permutations giving the same |rho| up to rounding count as extreme.
        hits += int((np.abs(perms @ b) >= abs(rho) - 1e-12).sum())
    # (1 + hits) / (1 + n): the observed order counts as one permutation, so p is never 0.
    return Correlation(rho, (1.0 + hits) / (1.0 + n_permutations))


def spearman(x, y, *, n_permutations: int = 10000, seed: int = 0) -> Correlation:
    """Spearman's rho (average ranks for ties) and a two-sided permutation p-value.

    The p-value is `(1 + #{|rho_perm| >= |rho|}) / (1 + n_permutations)` over random permutations
    of y's ranks: exact in distribution for any n and any ties, unlike the t approximation.

    Example:
        ```python
        >>> rho, p = spearman([1, 2, 3, 4, 5, 6], [2, 1, 4, 3, 6, 5], n_permutations=2000)
        >>> round(rho, 4)
        0.8286
        ```
    """
    x = _vector(x, "x", min_size=3)
    y = _vector(y, "y", n=x.size)
    rx, ry = _centered_unit(rankdata(x), "x"), _centered_unit(rankdata(y), "y")
    return _permutation_corr(ry, rx, n_permutations, seed)


def _residual_ranks(v: np.ndarray, rz: np.ndarray, name: str) -> np.ndarray:
    """Ranks of `v` with a least-squares line in the ranks of z removed, as a unit vector."""
    design = np.column_stack([np.ones_like(rz), rz])
    r = rankdata(v)
    coef, *_ = np.linalg.lstsq(design, r, rcond=None)
    resid = r - design @ coef
    if float(np.sqrt(resid @ resid)) <= 1e-9 * float(np.sqrt(r @ r)):
        raise ValueError(f"{name} is a monotone function of z: nothing is left once z is partialled out")
    return resid / float(np.sqrt(resid @ resid))


def partial_spearman(x, y, z, *, n_permutations: int = 10000, seed: int = 0) -> Correlation:
    """Spearman correlation of x and y with z (typically depth) partialled out.

    Why: in a pre-norm transformer the gradient reaching a block shrinks with depth, so a raw
    first-order signal can rank positions by depth alone; if the realized gain also trends with
    depth, the raw rho looks good without the signal knowing anything else. Partialling depth out
    asks whether the signal predicts the gain *beyond* what depth already does.

    Method: rank x, y and z (average ranks), regress the ranks of x and of y on `[1, rank(z)]`,
    correlate the residuals. The p-value permutes x's residuals against y's, two-sided.
    Needs at least 4 points (with 3, the residuals always correlate at +-1).

    Example:
        ```python
        >>> depth = [0, 1, 2, 3, 4, 5, 6, 7]
        >>> rho, p = partial_spearman([0, 2, 1, 3, 5, 4, 6, 7], [1, 0, 3, 2, 4, 6, 5, 7], depth)
        ```
    """
    x = _vector(x, "x", min_size=4)
    y = _vector(y, "y", n=x.size)
    z = _vector(z, "z", n=x.size)
    rz = rankdata(z)
    if np.ptp(rz) == 0:
        raise ValueError("z is constant, so there is nothing to partial out")
    ex, ey = _residual_ranks(x, rz, "x"), _residual_ranks(y, rz, "y")
    return _permutation_corr(ex, ey, n_permutations, seed)


# --------------------------------------------------------------------------- choosing a position


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values; ties broken toward the lower index (stable order)."""
    return np.argsort(-values, kind="stable")[:k]


def top_k_hit_rate(predicted_scores, realized, k: int) -> float:
    """Fraction of the predicted top-k (highest scores) that lie in the realized top-k.

    The realized top-k holds every candidate at least as good as the k-th best realized gain, so
    candidates tied with it count as hits (they are equally good); the predicted top-k breaks ties
    toward the lower index.

    Example:
        ```python
        >>> top_k_hit_rate([0.9, 0.1, 0.5, 0.3], [0.2, 0.0, 0.4, 0.1], k=2)
        1.0
        ```
    """
    scores = _vector(predicted_scores, "predicted_scores")
    gains = _vector(realized, "realized", n=scores.size)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= scores.size:
        raise ValueError(f"k must be an integer in [1, {scores.size}], got {k!r}")
    kth_best = np.sort(gains)[::-1][k - 1]
    return float(np.mean(gains[_top(scores, k)] >= kth_best))


def regret(predicted_scores, realized) -> float:
    """Best realized gain minus the realized gain of the predictor's top pick (>= 0; 0 = best).

    Higher realized = better. The top pick is the highest predicted score, the lower index on ties.

    Example:
        ```python
        >>> # SmolLM2 oracle, candidates k=10 and k=26: the probe picked k=26 (0.151), the best was k=10 (0.295)
        >>> round(regret([0.2, 0.8], [0.295, 0.151]), 3)
        0.144
        ```
    """
    scores = _vector(predicted_scores, "predicted_scores")
    gains = _vector(realized, "realized", n=scores.size)
    return float(gains.max() - gains[_top(scores, 1)[0]])


def predictor_table(
    predictors: dict, realized, depth, *, n_permutations: int = 10000, seed: int = 0
) -> list[dict]:
    """One row per predictor: how well its scores rank the realized gains of the candidates.

    Row keys: `predictor`, `spearman`, `p_value`, `partial_spearman`, `partial_p_value` (depth
    partialled out; NaN when the scores are a monotone function of depth, e.g. a depth baseline),
    `top1_hit`, `top3_hit`, `regret`. Needs at least 4 candidates.

    Example:
        ```python
        >>> rows = predictor_table({"probe": [0.1, 0.4, 0.3, 0.2]}, [0.0, 0.3, 0.2, 0.1], [1, 2, 3, 4],
        ...                        n_permutations=500)
        >>> rows[0]["regret"]
        0.0
        ```
    """
    if not isinstance(predictors, dict) or not predictors:
        raise ValueError("predictors must be a non-empty dict {name: scores per candidate}")
    gains = _vector(realized, "realized", min_size=4)
    depth = _vector(depth, "depth", n=gains.size)
    if np.ptp(depth) == 0:
        raise ValueError("depth is constant, so there is nothing to partial out")
    rows = []
    for name, scores in predictors.items():
        scores = _vector(scores, f"predictor {name!r}", n=gains.size)
        rho, p = spearman(scores, gains, n_permutations=n_permutations, seed=seed)
        try:
            partial, partial_p = partial_spearman(scores, gains, depth, n_permutations=n_permutations, seed=seed)
        except ValueError:  # inputs are checked: only "monotone in depth" is left, undefined, not an error
            partial, partial_p = math.nan, math.nan
        rows.append({
            "predictor": str(name),
            "spearman": rho,
            "p_value": p,
            "partial_spearman": partial,
            "partial_p_value": partial_p,
            "top1_hit": top_k_hit_rate(scores, gains, 1),
            "top3_hit": top_k_hit_rate(scores, gains, 3),
            "regret": regret(scores, gains),
        })
    return rows
