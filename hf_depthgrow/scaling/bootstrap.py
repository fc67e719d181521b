"""Percentile bootstrap intervals for `fit_power_law`: resample the points, refit, take quantiles."""

from __future__ import annotations

import numpy as np

from ..least_squares import PARAMS, Problem, fit_once, to_reported


def bootstrap_intervals(N, D, loss, w, floor, x_best, log_gn, log_gd, n_boot, seed, confidence):
    """`({param: [low, high]}, refits that succeeded)`, or `(None, 0)` when none did.

    Each resample is normalised like the full fit (`log_gn`, `log_gd`) and refitted from the full
    fit's optimum `x_best` (internal parametrisation), so one start suffices.

    Example:
        ```python
        >>> intervals, ok = bootstrap_intervals(N, D, loss, np.ones_like(loss), 0.0, x, log_gn, log_gd, 200, 0, 0.95)
        ```
    """
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(loss), size=(n_boot, len(loss)))
    samples = []
    for rows in idx:
        if np.unique(N[rows]).size < 2 or np.unique(D[rows]).size < 2:
            continue  # the law is not identifiable from this resample
        # Same normalisation as the full fit, so its optimum is a good (single) start.
        problem = Problem(np.log(N[rows]) - log_gn, np.log(D[rows]) - log_gd, loss[rows], w[rows], floor)
        if problem.lower[0] >= problem.upper[0]:
            continue
        x0 = np.clip(x_best, problem.lower, problem.upper)
        res = fit_once(problem, [x0], tol=1e-10)
        if res is None or not res.success or not np.all(np.isfinite(res.x)):
            continue
        samples.append(to_reported(res.x, log_gn, log_gd)[0])
    if not samples:
        return None, 0
    samples = np.array(samples)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(samples, [tail, 100.0 - tail], axis=0)
    return {p: [float(low[i]), float(high[i])] for i, p in enumerate(PARAMS)}, len(samples)
