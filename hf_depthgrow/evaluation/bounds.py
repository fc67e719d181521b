"""Confidence intervals for a paired test-risk delta, and the terms of Route A and Route B (THEORY §7).

Everything here is plain arithmetic on numbers and numpy arrays; the evaluator
(`hf_depthgrow.evaluation.paired`) feeds it per-example losses and the quantities it measured.

Intervals are for the **mean of per-example differences** `d_i = l_i(f_old) - l_i(f_new)` over the
test examples (positive = the grown model is better). For a causal LM an example's loss is the
mean over its supervised tokens, so this mean differs from the token-weighted delta whenever
examples carry different numbers of tokens; both are reported and the intervals cover this one.

- Hoeffding: losses clipped to `[0, B]`, so `d_i` lies in `[-B, B]` (range `2B`):
  `mean(d) +- 2B sqrt(ln(2/delta) / (2m))`.
- Empirical Bernstein (Maurer & Pontil 2009, Theorem 4), two-sided with `delta/2` per side, for
  clipped `d_i` of range `R = 2B` and unbiased sample variance `V`:
  `mean(d) +- ( sqrt(2 V ln(4/delta) / m) + 7 R ln(4/delta) / (3 (m - 1)) )`.
- Paired bootstrap (percentile): resample the `m` pairs with replacement `n_bootstrap` times
  (indices `rng.integers(0, m, size=(n_bootstrap, m))` from `numpy.random.default_rng(seed)`),
  take the `delta/2` and `1 - delta/2` quantiles (numpy's default linear interpolation) of the
  resampled means. Unclipped: no bound is assumed, and no finite-sample guarantee is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

INTERVALS = ("hoeffding", "bernstein", "bootstrap")
_BOOTSTRAP_CHUNK = 256  # rows of resampled indices per draw, to bound memory for large m


def _check(diffs, delta: float) -> np.ndarray:
    d = np.asarray(diffs, dtype=np.float64).reshape(-1)
    if d.size == 0:
        raise ValueError("no differences: the interval needs at least one example")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"non-finite differences at positions {np.flatnonzero(~np.isfinite(d))[:10].tolist()}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return d


def _check_bound(bound: float) -> float:
    if bound is None or not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"the loss bound B must be a finite number > 0, got {bound}")
    return float(bound)


def hoeffding_half_width(bound: float, m: int, delta: float) -> float:
    """`2B sqrt(ln(2/delta) / (2m))`: two-sided Hoeffding for a mean of `m` values in `[-B, B]`.

    Example:
        ```python
        >>> round(hoeffding_half_width(1.0, 100, 0.05), 4)
        0.2716
        ```
    """
    return 2.0 * _check_bound(bound) * math.sqrt(math.log(2.0 / delta) / (2.0 * m))


def hoeffding_interval(diffs, delta: float, bound: float) -> tuple[float, float]:
    """Two-sided Hoeffding interval for the mean of differences that lie in `[-bound, bound]`.

    The caller clips the losses to `[0, bound]` first (see `clip_losses`); values outside the
    range are rejected, since the guarantee would not hold for them.

    Example:
        ```python
        >>> low, high = hoeffding_interval([0.1, 0.3, -0.1, 0.2], 0.05, bound=1.0)
        ```
    """
    d = _check(diffs, delta)
    bound = _check_bound(bound)
    if np.abs(d).max() > bound * (1 + 1e-12):
        raise ValueError(f"differences exceed [-B, B] = [-{bound}, {bound}]: clip the losses to [0, B] first")
    half = hoeffding_half_width(bound, d.size, delta)
    return float(d.mean() - half), float(d.mean() + half)


def bernstein_half_width(diffs, delta: float, bound: float) -> float:
    """Half-width of the two-sided empirical-Bernstein interval (Maurer & Pontil 2009, Thm 4).

    For `m >= 2` values of range `R = 2B` and unbiased sample variance `V`, with `delta/2` per side:
    `sqrt(2 V ln(4/delta) / m) + 7 R ln(4/delta) / (3 (m - 1))`.
    """
    d = _check(diffs, delta)
    m = d.size
    if m < 2:
        raise ValueError("the empirical Bernstein bound needs at least 2 examples")
    log_term = math.log(4.0 / delta)
    variance = float(d.var(ddof=1))
    return math.sqrt(2.0 * variance * log_term / m) + 7.0 * (2.0 * _check_bound(bound)) * log_term / (3.0 * (m - 1))


def bernstein_interval(diffs, delta: float, bound: float) -> tuple[float, float]:
    """Two-sided empirical-Bernstein interval for the mean of differences in `[-bound, bound]`.

    Example:
        ```python
        >>> low, high = bernstein_interval([0.1, 0.3, -0.1, 0.2], 0.05, bound=1.0)
        ```
    """
    d = _check(diffs, delta)
    bound = _check_bound(bound)
    if np.abs(d).max() > bound * (1 + 1e-12):
        raise ValueError(f"differences exceed [-B, B] = [-{bound}, {bound}]: clip the losses to [0, B] first")
    half = bernstein_half_width(d, delta, bound)
    return float(d.mean() - half), float(d.mean() + half)


def bootstrap_means(diffs, n_bootstrap: int, seed: int) -> np.ndarray:
    """Means of `n_bootstrap` paired resamples; the same as drawing all indices in one call.

    `Generator.integers` draws element by element, so chunks of rows give the same stream as
    `rng.integers(0, m, size=(n_bootstrap, m))` at a fraction of the memory.
    """
    d = np.asarray(diffs, dtype=np.float64).reshape(-1)
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be >= 1, got {n_bootstrap}")
    rng = np.random.default_rng(seed)
    out = np.empty(n_bootstrap)
    for start in range(0, n_bootstrap, _BOOTSTRAP_CHUNK):
        rows = min(_BOOTSTRAP_CHUNK, n_bootstrap - start)
        out[start : start + rows] = d[rng.integers(0, d.size, size=(rows, d.size))].mean(axis=1)
    return out


def bootstrap_interval(diffs, delta: float, *, n_bootstrap: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Paired percentile-bootstrap interval for the mean difference (seeded, reproducible).

    Example:
        ```python
        >>> low, high = bootstrap_interval([0.1, 0.3, -0.1, 0.2], 0.05, n_bootstrap=1000, seed=0)
        ```
    """
    d = _check(diffs, delta)
    means = bootstrap_means(d, n_bootstrap, seed)
    low, high = np.quantile(means, [delta / 2.0, 1.0 - delta / 2.0])
    return float(low), float(high)


def clip_losses(losses, bound: float) -> tuple[np.ndarray, int]:
    """Losses clipped to `[0, bound]` and how many were above `bound`."""
    x = np.asarray(losses, dtype=np.float64)
    return np.clip(x, 0.0, bound), int((x > bound).sum())


def paired_intervals(
    loss_old, loss_new, *, delta: float, bound: float, n_bootstrap: int = 2000, seed: int = 0
) -> dict[str, dict]:
    """All three intervals for the mean of `loss_old - loss_new`, with their details.

    Returns `{name: {"low", "high", "center", "half_width", "certified", "clipped", "formula"}}`;
    `certified` is `low > 0` ("certified improvement at level delta").
    """
    old, new = np.asarray(loss_old, dtype=np.float64), np.asarray(loss_new, dtype=np.float64)
    if old.shape != new.shape:
        raise ValueError(f"paired losses must have the same shape, got {old.shape} and {new.shape}")
    bound = _check_bound(bound)
    old_c, n_old = clip_losses(old, bound)
    new_c, n_new = clip_losses(new, bound)
    clipped = old_c - new_c
    raw = old - new
    m = raw.size
    out: dict[str, dict] = {}
    low, high = hoeffding_interval(clipped, delta, bound)
    out["hoeffding"] = {
        "low": low,
        "high": high,
        "center": float(clipped.mean()),
        "half_width": hoeffding_half_width(bound, m, delta),
        "clipped": n_old + n_new,
        "formula": "mean(d_clip) +- 2B sqrt(ln(2/delta) / (2m))",
    }
    if m >= 2:
        low, high = bernstein_interval(clipped, delta, bound)
        out["bernstein"] = {
            "low": low,
            "high": high,
            "center": float(clipped.mean()),
            "half_width": bernstein_half_width(clipped, delta, bound),
            "clipped": n_old + n_new,
            "formula": "mean(d_clip) +- [sqrt(2 V ln(4/delta) / m) + 7 (2B) ln(4/delta) / (3 (m-1))]",
        }
    else:
        out["bernstein"] = {"low": -math.inf, "high": math.inf, "center": float(clipped.mean()), "half_width": math.inf,
                            "clipped": n_old + n_new, "formula": "undefined for m < 2"}
    low, high = bootstrap_interval(raw, delta, n_bootstrap=n_bootstrap, seed=seed)
    out["bootstrap"] = {
        "low": low,
        "high": high,
        "center": float(raw.mean()),
        "half_width": (high - low) / 2.0,
        "clipped": 0,
        "formula": f"percentile [delta/2, 1-delta/2] of {n_bootstrap} paired resampled means (seed {seed})",
    }
    for entry in out.values():
        entry["certified"] = bool(entry["low"] > 0)
    return out


# --------------------------------------------------------------------------- Route A / Route B


def eps_k(bound: float, m: int, delta: float) -> float:
    """Test-side concentration term `B sqrt(ln(2/delta) / (2m))` (Hoeffding for a mean of `m` losses in `[0, B]`)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    return _check_bound(bound) * math.sqrt(math.log(2.0 / delta) / (2.0 * m))


def eps_m(*, rho: float, b_w: float, b_a: float, n: int, delta: float, bound: float) -> float:
    """Generalisation cost of the block class: `2 rho B_W B_a / sqrt(n) + B sqrt(ln(2/delta) / (2n))`.

    Example:
        ```python
        >>> round(eps_m(rho=1.0, b_w=1.0, b_a=1.0, n=100, delta=0.05, bound=1.0), 4)
        0.3358
        ```
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for name, value in (("rho", rho), ("b_w", b_w), ("b_a", b_a)):
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return 2.0 * rho * b_w * b_a / math.sqrt(n) + _check_bound(bound) * math.sqrt(math.log(2.0 / delta) / (2.0 * n))


@dataclass
class RouteInputs:
    """The inputs of Route A and Route B that come from outside the test set, with where each came from.

    Every field may be `None`; a route whose inputs are missing is reported as incomplete, never
    filled in with a guess.

    Args:
        n_train: `n`, the number of training examples the block was fitted on.
        delta_erm: `Delta_ERM = L_S(f~_S) - L_S(f_new) >= 0`, from the trainer (`TrainResult.delta_erm`).
        delta_r: `Delta_R = L_D(f_old) - L_D(f~_pop)`, the population stepping stone's margin on the
            held-out split.
        delta_r_test: `Delta^R_test = L_T(f_old) - L_T(f~)`, the stepping stone's margin on the test set.
        rho: Lipschitz constant of `loss o f_top` at the block's output (an estimate).
        b_w: `B_W = ||W||_F` of the trained block's output weights.
        b_a: `B_a = max ||a(z)||` of the block's pre-projection activation over the data.
        sources: How each value was obtained, by field name (shown in the report).
    """

    n_train: int | None = None
    delta_erm: float | None = None
    delta_r: float | None = None
    delta_r_test: float | None = None
    rho: float | None = None
    b_w: float | None = None
    b_a: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def route_bounds(inputs: RouteInputs, *, loss_old: float, bound: float, m: int, delta: float) -> dict:
    """Route A and Route B: every term, the bound on `L_test(f_new)`, and a plain verdict.

    - `eps_M = 2 rho B_W B_a / sqrt(n) + B sqrt(ln(2/delta) / (2n))`
    - `eps_K = B sqrt(ln(2/delta) / (2m))` (the test-side term)
    - Route A: `L_test(f_new) <= L_test(f_old) - Delta_R / 2 - Delta_ERM + 2 eps_M`
    - Route B: `L_test(f_new) <= L_test(f_old) - Delta^R_test - Delta_ERM + 2 (eps_M + eps_K)`

    A route's *guaranteed improvement* is `L_test(f_old)` minus its bound. The route is vacuous
    when that is <= 0 (it certifies no improvement); it says nothing at all when the bound is
    at or above `B`, the largest loss. Each concentration term holds with probability 1 - delta;
    a union bound over the terms a route uses lowers its joint confidence accordingly.
    `loss_old` is the test loss of the original model measured on T (the example-mean loss).
    """
    terms = {
        "loss_old_test": loss_old,
        "B": bound,
        "m": m,
        "delta": delta,
        **{k: v for k, v in inputs.to_dict().items() if k != "sources"},
        "sources": dict(inputs.sources),
    }
    terms["eps_K"] = eps_k(bound, m, delta)
    terms["eps_K_definition"] = "B sqrt(ln(2/delta) / (2m)): Hoeffding for the mean of m test losses in [0, B]"
    missing_m = [k for k in ("rho", "b_w", "b_a", "n_train") if getattr(inputs, k) is None]
    terms["eps_M"] = None
    if not missing_m:
        terms["eps_M"] = eps_m(rho=inputs.rho, b_w=inputs.b_w, b_a=inputs.b_a, n=inputs.n_train, delta=delta, bound=bound)
        terms["eps_M_complexity"] = 2.0 * inputs.rho * inputs.b_w * inputs.b_a / math.sqrt(inputs.n_train)
        terms["eps_M_concentration"] = bound * math.sqrt(math.log(2.0 / delta) / (2.0 * inputs.n_train))

    def route(name: str, margin_key: str, margin_factor: float, extra: float) -> dict:
        needed = [margin_key, "delta_erm"] + (["eps_M"] if terms["eps_M"] is None else [])
        missing = [k for k in (margin_key, "delta_erm") if getattr(inputs, k) is None] + (missing_m if terms["eps_M"] is None else [])
        if missing:
            return {
                "complete": False,
                "missing": missing,
                "sentence": f"Route {name} is not computed: missing {', '.join(missing)}.",
                "needed": needed,
            }
        margin = margin_factor * getattr(inputs, margin_key)
        cost = 2.0 * (terms["eps_M"] + extra)
        improvement = margin + inputs.delta_erm - cost
        upper = loss_old - improvement
        if upper >= bound:
            sentence = (
                f"Route {name} is vacuous: its bound on L_test(f_new) ({_fmt(upper)}) is at or above the largest "
                f"loss B = {_fmt(bound)}, so it says nothing."
            )
        elif improvement <= 0:
            sentence = (
                f"Route {name} is vacuous: the statistical cost {_fmt(cost)} exceeds the margins "
                f"{_fmt(margin + inputs.delta_erm)}, so it certifies no improvement (it only says "
                f"L_test(f_new) <= L_test(f_old) + {_fmt(-improvement)})."
            )
        else:
            sentence = f"Route {name} certifies an improvement of at least {_fmt(improvement)} (bound {_fmt(upper)})."
        return {
            "complete": True,
            "margin": margin,
            "cost": cost,
            "guaranteed_improvement": improvement,
            "upper_bound_loss_new": upper,
            "vacuous": bool(improvement <= 0 or upper >= bound),
            "sentence": sentence,
        }

    route_a = route("A", "delta_r", 0.5, 0.0)
    route_a["formula"] = "L_test(f_new) <= L_test(f_old) - Delta_R/2 - Delta_ERM + 2 eps_M"
    route_b = route("B", "delta_r_test", 1.0, terms["eps_K"])
    route_b["formula"] = "L_test(f_new) <= L_test(f_old) - Delta^R_test - Delta_ERM + 2 (eps_M + eps_K)"
    return {"terms": terms, "route_a": route_a, "route_b": route_b}
