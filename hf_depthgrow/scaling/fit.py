"""Fit the scaling law `L(N, D) = E + A * N**(-alpha) + B * D**(-beta)` to measured test losses.

`N` is the model size (parameter count), `D` the data size (training examples or tokens), `loss`
the test loss measured for each `(N, D)` pair of a grid of runs. The fit is nonlinear
least squares (`scipy.optimize.least_squares`) made dependable in three ways:

- **Conditioning.** `N` and `D` are divided by their geometric means, and the optimizer works on
  `(E, log a, alpha, log b, beta)` with `a, b` the coefficients of the normalised sizes; `A` and `B`
  are converted back to original units afterwards (`A = a * gN**alpha`).
- **Bounds.** `loss_floor <= E <= min(loss)` (an irreducible loss cannot exceed a measured one) and
  `alpha, beta` in `(0, 3]`.
- **Multiple starts.** A grid of `(alpha, beta)` pairs; for each, `E, a, b` enter linearly and are
  solved exactly (bounded linear least squares), so each start is already the best curve with those
  exponents. The lowest residual over all starts wins.

Standard errors come from `sigma^2 (J^T J)^-1` at the optimum (`sigma^2 = rss / dof`), carried to
`(E, A, alpha, B, beta)` by the delta method. They are asymptotic: a parameter sitting on a bound,
or a rank-deficient Jacobian, makes them meaningless, and the fit says so in `message`. The
percentile bootstrap (resampling points with replacement) makes no such assumption, but with
few points it runs narrow (it has no `n / (n - 5)` correction for the fitted parameters).

Only numpy, scipy and (for the plot) matplotlib: no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..utils import json_safe
from .bootstrap import bootstrap_intervals
from ..least_squares import EXPONENT_BOUNDS, PARAMS, Problem, covariance, fit_once, start_grid, to_reported, validate

__all__ = ["EXPONENT_BOUNDS", "PARAMS", "PowerLawFit", "fit_power_law"]


@dataclass
class PowerLawFit:
    r"""Result of `fit_power_law`: `L(N, D) = E + A * N**(-alpha) + B * D**(-beta)`.

    E, A, alpha, B, beta (`float`):
        The fitted parameters, `A` and `B` in the original units of `N` and `D`.
    stderr (`dict[str, float]`):
        Asymptotic standard error of each parameter; `inf` where the Jacobian is singular.
    covariance (`list[list[float]]`):
        5x5 covariance in the order `E, A, alpha, B, beta`; `nan` where it is undetermined.
    rss (`float`): (weighted) residual sum of squares.
    r2 (`float`): (weighted) coefficient of determination.
    num_points (`int`), dof (`int`): points fitted, and `num_points - 5`.
    converged (`bool`), message (`str`): whether the optimizer converged, and every caveat.
    bootstrap (`dict[str, list[float]]` or `None`):
        Percentile interval `[low, high]` per parameter, or `None` without (successful) resamples.
    bootstrap_requested, bootstrap_succeeded (`int`): resamples drawn, and refits that succeeded.
    confidence (`float`): level of the bootstrap intervals.
    """

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    stderr: dict[str, float]
    covariance: list[list[float]]
    rss: float
    r2: float
    num_points: int
    dof: int
    converged: bool
    message: str
    bootstrap: dict[str, list[float]] | None = None
    bootstrap_requested: int = 0
    bootstrap_succeeded: int = 0
    confidence: float = 0.95

    @property
    def params(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARAMS}

    def predict(self, N, D):
        """Loss predicted at model size `N` and data size `D` (scalars or broadcastable arrays).

        Example:
            ```python
            >>> fit.predict(1e6, [1e3, 1e5])  # two data sizes at one model size
            array([...])
            ```
        """
        N = np.asarray(N, dtype=np.float64)
        D = np.asarray(D, dtype=np.float64)
        out = self.E + self.A * N ** (-self.alpha) + self.B * D ** (-self.beta)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        """Plain, strict-JSON data: non-finite numbers (an undetermined stderr) become `None`."""
        return json_safe(asdict(self), nonfinite="null")

    @classmethod
    def from_dict(cls, data: dict) -> PowerLawFit:
        """Inverse of `to_dict`; a `None` number comes back as `nan`."""
        data = dict(data)
        data["stderr"] = {k: _num(v) for k, v in data["stderr"].items()}
        data["covariance"] = [[_num(v) for v in row] for row in data["covariance"]]
        for name in (*PARAMS, "rss", "r2"):
            data[name] = _num(data[name])
        return cls(**data)

    def summary(self) -> str:
        """A short markdown table: each parameter with its standard error and bootstrap interval."""
        level = f"{self.confidence:.0%} bootstrap"
        if self.bootstrap is not None:
            level += f" ({self.bootstrap_succeeded}/{self.bootstrap_requested} refits)"
        lines = [
            "`L(N, D) = E + A * N^-alpha + B * D^-beta`",
            "",
            f"| parameter | value | ± stderr | {level} |",
            "|---|---|---|---|",
        ]
        for name in PARAMS:
            interval = "n/a"
            if self.bootstrap is not None:
                low, high = self.bootstrap[name]
                interval = f"[{low:.4g}, {high:.4g}]"
            lines.append(f"| {name} | {getattr(self, name):.4g} | {self.stderr[name]:.2g} | {interval} |")
        lines += [
            "",
            f"{self.num_points} points, dof {self.dof}, rss {self.rss:.3g}, R² {self.r2:.5f}, "
            f"converged: {self.converged}. {self.message}",
        ]
        return "\n".join(lines) + "\n"


def _num(v) -> float:
    return float("nan") if v is None else float(v)



def fit_power_law(
    N,
    D,
    loss,
    *,
    weights=None,
    n_starts: int = 25,
    bootstrap: int = 200,
    seed: int = 0,
    loss_floor: float | None = None,
    confidence: float = 0.95,
) -> PowerLawFit:
    """Fit `L(N, D) = E + A * N**(-alpha) + B * D**(-beta)` to measured losses.

    Args:
        N: Model sizes (parameter counts), one per measurement; finite and > 0.
        D: Data sizes (training examples or tokens), one per measurement; finite and > 0.
        loss: Measured test losses, one per measurement.
        weights: Optional positive weight per point (e.g. `1 / variance` of each loss); the fit
            minimises `sum(weights * residual**2)`.
        n_starts: Starting points, arranged as a square grid of `(alpha, beta)` (rounded up to one).
        bootstrap: Resamples of the points (with replacement) to refit for percentile intervals;
            `0` switches the bootstrap off.
        seed: Seed of the bootstrap resampling.
        loss_floor: Lower bound of `E` (default 0), e.g. a known entropy of the data.
        confidence: Level of the bootstrap intervals.

    Returns:
        `PowerLawFit`. Caveats (parameter on a bound, singular Jacobian, failed refits) are listed in
        its `message`, never raised.

    Raises:
        ValueError: on inputs of different lengths, fewer than 6 points, non-finite or non-positive
            `N`/`D`, non-finite losses, or fewer than 2 distinct `N` or `D` values.

    Example:
        ```python
        >>> import numpy as np
        >>> N, D = (a.ravel() for a in np.meshgrid(np.geomspace(1e4, 1e6, 4), np.geomspace(1e3, 1e5, 4)))
        >>> loss = 1.7 + 8 * N**-0.34 + 5 * D**-0.28
        >>> fit = fit_power_law(N, D, loss, bootstrap=0)
        >>> round(fit.alpha, 3), round(fit.beta, 3)
        (0.34, 0.28)
        ```
    """
    _check_settings(n_starts, bootstrap, confidence)
    N, D, loss, w, floor = validate(N, D, loss, weights, loss_floor)
    log_n, log_d = np.log(N), np.log(D)
    # Normalising by the geometric means puts a and b on the scale of the losses themselves.
    log_gn, log_gd = float(log_n.mean()), float(log_d.mean())
    problem = Problem(log_n - log_gn, log_d - log_gd, loss, w, floor)

    starts = [problem.start(a, b) for a, b in start_grid(n_starts)]
    best = fit_once(problem, starts, tol=1e-12)
    if best is None:  # every start raised: report it rather than crash
        return _failed_fit(len(loss))

    notes = [] if best.success else [f"optimizer did not converge: {best.message}"]
    x = best.x
    values, G = to_reported(x, log_gn, log_gd)
    n = len(loss)
    dof = n - len(PARAMS)
    rss = float(2.0 * best.cost)  # least_squares' cost is half the sum of squares
    w_mean = float(np.sum(w * loss) / np.sum(w))
    tss = float(np.sum(w * (loss - w_mean) ** 2))
    r2 = 1.0 - rss / tss if tss > 0 else float("nan")
    cov, stderr = _standard_errors(problem, x, G, rss, dof, notes)

    intervals, succeeded = None, 0
    if bootstrap:
        intervals, succeeded = bootstrap_intervals(N, D, loss, w, floor, x, log_gn, log_gd, bootstrap, seed, confidence)
        if succeeded < bootstrap:
            notes.append(f"bootstrap: {succeeded} of {bootstrap} refits succeeded")

    return PowerLawFit(
        *(float(v) for v in values), stderr=stderr, covariance=cov.tolist(), rss=rss, r2=float(r2), num_points=n, dof=dof,
        converged=bool(best.success), message="; ".join(notes) if notes else "ok", bootstrap=intervals,
        bootstrap_requested=bootstrap, bootstrap_succeeded=succeeded, confidence=confidence,
    )


def _check_settings(n_starts: int, bootstrap: int, confidence: float) -> None:
    if n_starts < 1:
        raise ValueError(f"n_starts must be >= 1, got {n_starts}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _failed_fit(n: int) -> PowerLawFit:
    """The fit when every start of the optimizer raised: NaN values, infinite standard errors, the reason."""
    nan = float("nan")
    return PowerLawFit(
        nan, nan, nan, nan, nan, {p: float("inf") for p in PARAMS}, [[nan] * 5 for _ in range(5)],
        nan, nan, n, n - 5, False, "every start of the optimizer failed",
    )


def _standard_errors(problem: Problem, x, G, rss: float, dof: int, notes: list[str]) -> tuple[np.ndarray, dict]:
    """Delta-method covariance and standard errors of the reported parameters; caveats go to `notes`."""
    cov_int = covariance(problem.jacobian(x), rss / dof) if dof > 0 else None
    if cov_int is None:
        why = (
            "no residual degrees of freedom" if dof <= 0
            else "J^T J is singular (parameters not identifiable from these points)"
        )
        notes.append(f"standard errors undetermined: {why}")
        cov = np.full((5, 5), np.nan)
        stderr = {p: float("inf") for p in PARAMS}
    else:
        cov = G @ cov_int @ G.T
        stderr = {p: float(math.sqrt(max(cov[i, i], 0.0))) for i, p in enumerate(PARAMS)}
    # The asymptotic covariance assumes an interior optimum; flag parameters pinned at a bound.
    span = problem.upper - problem.lower
    names_int = ("E", "log a", "alpha", "log b", "beta")
    pinned = [
        names_int[i] for i in range(5)
        if min(x[i] - problem.lower[i], problem.upper[i] - x[i]) <= 1e-8 * max(span[i], 1.0)
    ]
    if pinned:
        notes.append(f"at a bound: {', '.join(pinned)} (its standard errors are not meaningful)")
    return cov, stderr
