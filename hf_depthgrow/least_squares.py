"""The bounded least-squares machinery behind `scaling.fit_power_law` (see `scaling/fit.py` for the method) and
`comparison.fit_learning_curve`.

Works in the internal parametrisation `(E, log a, alpha, log b, beta)` on sizes normalised by
their geometric means; `to_reported` carries a solution back to `(E, A, alpha, B, beta)`.
"""

from __future__ import annotations

import math

import numpy as np

PARAMS = ("E", "A", "alpha", "B", "beta")
EXPONENT_BOUNDS = (1e-4, 3.0)  # (0, 3]: no LM scaling exponent measured so far comes near 3
LOG_COEF_BOUND = 40.0  # |log a|, |log b| after normalisation: keeps a vanishing term from running off
_SINGULAR_RTOL = 1e-10  # smallest / largest singular value of the column-scaled Jacobian


def _as_1d(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def validate(N, D, loss, weights, loss_floor):
    """`(N, D, loss, weights, floor)` as float arrays, or a `ValueError` that says what is wrong with them."""
    N, D, loss = _as_1d(N), _as_1d(D), _as_1d(loss)
    if not len(N) == len(D) == len(loss):
        raise ValueError(f"N, D and loss must have the same length, got {len(N)}, {len(D)} and {len(loss)}")
    if len(N) < len(PARAMS) + 1:
        raise ValueError(
            f"need at least {len(PARAMS) + 1} points to fit 5 parameters (E, A, alpha, B, beta) "
            f"with a residual left over, got {len(N)}"
        )
    for name, arr in (("N", N), ("D", D)):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0))
        if bad.size:
            raise ValueError(f"{name} must be finite and > 0; bad values at positions {bad[:10].tolist()}")
    bad = np.flatnonzero(~np.isfinite(loss))
    if bad.size:
        raise ValueError(f"loss must be finite; non-finite values at positions {bad[:10].tolist()}")
    for name, arr, term in (("N", N, "A, alpha"), ("D", D, "B, beta")):
        distinct = np.unique(arr)
        if distinct.size < 2:
            raise ValueError(
                f"{name} takes only {distinct.size} distinct value ({distinct[0]:g}): "
                f"{term} cannot be told apart from E; measure at least 2 (better 4+) {name} values"
            )
    if weights is None:
        w = np.ones_like(loss)
    else:
        w = _as_1d(weights)
        if len(w) != len(loss):
            raise ValueError(f"weights must have one entry per point ({len(loss)}), got {len(w)}")
        if not np.all(np.isfinite(w) & (w > 0)):
            raise ValueError("weights must be finite and > 0")
    floor = 0.0 if loss_floor is None else float(loss_floor)
    if not math.isfinite(floor):
        raise ValueError(f"loss_floor must be finite, got {loss_floor}")
    if floor >= loss.min():
        raise ValueError(
            f"E is bounded by [loss_floor, min(loss)] = [{floor:g}, {loss.min():g}], which is empty: "
            "pass a loss_floor below the smallest loss"
        )
    return N, D, loss, w, floor


class Problem:
    """Residuals and Jacobian in the internal parametrisation `(E, log a, alpha, log b, beta)`."""

    def __init__(self, log_n, log_d, loss, w, floor):
        self.log_n, self.log_d, self.loss = log_n, log_d, loss
        self.sw = np.sqrt(w)
        lo_exp, hi_exp = EXPONENT_BOUNDS
        c = LOG_COEF_BOUND
        self.lower = np.array([floor, -c, lo_exp, -c, lo_exp])
        self.upper = np.array([loss.min(), c, hi_exp, c, hi_exp])

    def terms(self, x):
        _, la, alpha, lb, beta = x
        return np.exp(la - alpha * self.log_n), np.exp(lb - beta * self.log_d)

    def residuals(self, x):
        tn, td = self.terms(x)
        return self.sw * (x[0] + tn + td - self.loss)

    def jacobian(self, x):
        tn, td = self.terms(x)
        cols = [np.ones_like(tn), tn, -tn * self.log_n, td, -td * self.log_d]
        return self.sw[:, None] * np.stack(cols, axis=1)

    def start(self, alpha, beta):
        """Best `(E, a, b)` for fixed exponents: the model is linear in them."""
        from scipy.optimize import lsq_linear

        X = self.sw[:, None] * np.stack(
            [np.ones_like(self.log_n), np.exp(-alpha * self.log_n), np.exp(-beta * self.log_d)], axis=1
        )
        tiny = 1e-12
        sol = lsq_linear(
            X, self.sw * self.loss, bounds=([self.lower[0], tiny, tiny], [self.upper[0], np.inf, np.inf])
        )
        E, a, b = sol.x
        x0 = np.array([E, math.log(max(a, tiny)), alpha, math.log(max(b, tiny)), beta])
        # least_squares wants a start inside the box; the linear solve may sit exactly on it
        return np.clip(x0, self.lower, self.upper)

    def solve(self, x0, tol):
        from scipy.optimize import least_squares

        return least_squares(
            self.residuals, x0, jac=self.jacobian, bounds=(self.lower, self.upper), method="trf",
            x_scale="jac", ftol=tol, xtol=tol, gtol=tol, max_nfev=2000,
        )


def start_grid(n_starts: int) -> list[tuple[float, float]]:
    """A square grid of about `n_starts` starting exponents `(alpha, beta)`."""
    k = max(1, math.ceil(math.sqrt(n_starts)))
    # log-spaced: exponents reported for LMs range from ~0.05 to ~1
    grid = np.geomspace(0.05, 1.5, k) if k > 1 else np.array([0.3])
    return [(float(a), float(b)) for a in grid for b in grid]


def fit_once(problem: Problem, starts, tol):
    """The lowest-cost `least_squares` result over `starts`, or `None` if every start failed."""
    best = None
    for x0 in starts:
        try:
            res = problem.solve(x0, tol)
        except (ValueError, np.linalg.LinAlgError, FloatingPointError):
            continue
        if np.isfinite(res.cost) and (best is None or res.cost < best.cost):
            best = res
    return best


def to_reported(x, log_gn, log_gd) -> tuple[np.ndarray, np.ndarray]:
    """Reported parameters `(E, A, alpha, B, beta)` and their Jacobian wrt the internal ones."""
    E, la, alpha, lb, beta = x
    # a * (N / gN)**-alpha == (a * gN**alpha) * N**-alpha
    A, B = math.exp(la + alpha * log_gn), math.exp(lb + beta * log_gd)
    G = np.zeros((5, 5))
    G[0, 0] = 1.0
    G[1, 1], G[1, 2] = A, A * log_gn
    G[2, 2] = 1.0
    G[3, 3], G[3, 4] = B, B * log_gd
    G[4, 4] = 1.0
    return np.array([E, A, alpha, B, beta]), G


def covariance(J: np.ndarray, sigma2: float) -> np.ndarray | None:
    """`sigma^2 (J^T J)^-1` through an SVD of the column-scaled `J`; `None` when `J` is rank-deficient."""
    norms = np.linalg.norm(J, axis=0)
    if not np.all(np.isfinite(J)) or np.any(norms == 0):
        return None
    _, s, vt = np.linalg.svd(J / norms, full_matrices=False)
    if s[-1] <= _SINGULAR_RTOL * s[0]:
        return None
    inv = (vt.T / s**2) @ vt
    return sigma2 * inv / np.outer(norms, norms)
