"""When does growth pay? Learning curves `L(D) = E + A * D**(-alpha)` per arm, and the predicted crossover.

Each arm's test loss at each budget (tokens `D`) is fitted by `comparison.learning_curve.fit_learning_curve`.

Uncertainty comes from a percentile bootstrap over *test examples*: each replicate resamples the example
indices once and applies them to every arm and budget (the examples are the same for all: pairing is kept),
recomputes each weighted test loss, and refits. Arms are never chosen here: the caller picks the best growth
arm and the best control on held-out data and passes their names.

A prediction is an extrapolation, and past one pass over the training data (`fresh_tokens`) it extrapolates
into epochs of the same text: the text then says so, in epochs. A fit whose floor `E` sits at its bound (0, or
the smallest measured loss) has its floor placed by the bound, not the data: no crossover is read from it.

Only numpy and scipy: no torch.
"""

from __future__ import annotations

import math

import numpy as np

from ..utils import check_int, json_safe
from .fresh_data import format_epochs
from .learning_curve import FLAT_NATS, LearningCurveFit, _check_tokens, _fit, fit_learning_curve

__all__ = ["FLAT_NATS", "HORIZON", "TIE_NATS", "LearningCurveFit", "fit_learning_curve", "predict_crossover", "validate_fit"]

HORIZON = 100.0  # how far past the largest measured budget a crossover is searched (a multiple of it)
# Two fitted curves closer than this are tied: no crossover and no lead is claimed. It is above the rounding of
# a float32 loss of a few nats (~5e-7) and far below any difference a test set can resolve (~1e-2).
TIE_NATS = 1e-6
_GRID_POINTS = 4000  # log-spaced points between the largest budget and the horizon: ~0.1% steps at 100x


class _Sweep:
    """Per-example test losses of every arm at every budget, checked, as `(budgets, examples)` arrays."""

    def __init__(self, tokens, losses: dict, weights: dict | None, arms):
        self.tokens = _check_tokens(np.asarray(tokens, dtype=np.float64).reshape(-1))
        self.lw, self.w, n = {}, {}, None
        for arm in arms:
            if arm not in losses:
                raise ValueError(f"no per-example test losses for arm {arm!r}")
            L = self._stack(arm, "losses", losses[arm])
            W = np.ones_like(L) if weights is None else self._stack(arm, "weights", weights.get(arm))
            if W.shape != L.shape:
                raise ValueError(f"arm {arm!r}: weights have shape {W.shape}, losses {L.shape}")
            if np.any(W < 0) or np.any(W.sum(axis=1) <= 0):
                raise ValueError(f"arm {arm!r}: weights must be >= 0 with a positive sum at every budget")
            if n is not None and L.shape[1] != n:
                raise ValueError(f"arm {arm!r} has {L.shape[1]} test examples, another arm {n}: they must be the same examples")
            n = L.shape[1]
            self.lw[arm], self.w[arm] = L * W, W
            if not np.all(self.curve(arm) > 0):  # the fit bounds E by [0, min(loss)]
                raise ValueError(f"arm {arm!r}: the test loss must be > 0 at every budget, got {self.curve(arm).tolist()}")
        self.num_examples = n or 0

    def _stack(self, arm, what, per_budget) -> np.ndarray:
        if per_budget is None or len(per_budget) != len(self.tokens):
            got = "none" if per_budget is None else len(per_budget)
            raise ValueError(f"arm {arm!r}: {what} must have one array per budget ({len(self.tokens)}), got {got}")
        rows = [np.asarray(v, dtype=np.float64).reshape(-1) for v in per_budget]
        if len({r.size for r in rows}) != 1 or rows[0].size == 0:
            raise ValueError(f"arm {arm!r}: {what} must cover the same, non-empty test examples at every budget")
        out = np.stack(rows)
        if not np.all(np.isfinite(out)):
            raise ValueError(f"arm {arm!r}: {what} contain non-finite values")
        return out

    def curve(self, arm, counts=None) -> np.ndarray | None:
        """Weighted test loss per budget; `counts` (examples drawn per index) reweights for a bootstrap replicate, `None`
        where the replicate's loss is not finite and > 0 at every budget (it drew only zero-weight examples, say)."""
        if counts is None:
            return self.lw[arm].sum(axis=1) / self.w[arm].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rep = (self.lw[arm] @ counts) / (self.w[arm] @ counts)
        return rep if np.all(np.isfinite(rep) & (rep > 0)) else None

    def replicates(self, n_boot: int, seed: int):
        """Draw counts per example, one row per replicate: the same draw serves every arm and budget."""
        rng = np.random.default_rng(seed)
        n = self.num_examples
        return [np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64) for _ in range(n_boot)]


def _check_settings(n_bootstrap, confidence, seed):
    check_int("n_bootstrap", n_bootstrap, 0, numpy=True, what=" (replicates)")
    check_int("seed", seed, 0, numpy=True)
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def _percentiles(values, confidence) -> list[float]:
    """`[low, high]` percentile interval; `inverted_cdf` never interpolates, so `inf` entries stay `inf`."""
    tail = (1.0 - confidence) / 2.0
    return [float(np.quantile(values, q, method="inverted_cdf")) for q in (tail, 1.0 - tail)]


def _first_crossing(g: LearningCurveFit, c: LearningCurveFit, d_max: float, horizon: float) -> tuple[str, float]:
    """`(status, multiple)`: where `g` first drops below `c`, as a multiple of the largest budget (in `[1, horizon]`).

    `"ahead"` (multiple 1) when `g` is already below at the largest budget, `"none"` (multiple `inf`) when it
    never gets there within the horizon, `"tie"` (`inf`) when the two curves stay within `TIE_NATS` of each other
    over the whole horizon, `"unfit"` (`nan`) when either fit failed. Only a lead of more than `TIE_NATS` counts:
    the crossing is then where the difference last changes sign before that lead.
    """
    from scipy.optimize import brentq

    if not all(math.isfinite(v) for v in (g.E, g.A, g.alpha, c.E, c.A, c.alpha)):
        return "unfit", math.nan
    grid = np.geomspace(1.0, horizon, _GRID_POINTS)
    diff = g.predict(grid * d_max) - c.predict(grid * d_max)
    if diff[0] < -TIE_NATS:
        return "ahead", 1.0
    below = np.flatnonzero(diff < -TIE_NATS)
    if below.size == 0:
        return ("tie" if np.all(np.abs(diff) <= TIE_NATS) else "none"), math.inf
    above = np.flatnonzero(diff[: below[0]] >= 0)
    if above.size == 0:  # tied at the largest budget, then ahead by more than the tolerance
        return "crossover", float(grid[0])
    i = above[-1] + 1
    root = brentq(lambda m: g.predict(m * d_max) - c.predict(m * d_max), grid[i - 1], grid[i], rtol=1e-10)
    return "crossover", float(root)


def predict_crossover(
    tokens, losses: dict, weights: dict | None = None, *, growth, controls, best_growth: str, best_control: str,
    controls_within=None, best_control_within: str | None = None, horizon: float = HORIZON,
    n_bootstrap: int = 200, seed: int = 0, confidence: float = 0.95, fresh_tokens: float | None = None,
) -> dict:
    """Fit every arm's learning curve and predict the budget at which `best_growth` overtakes `best_control`.

    Args:
        tokens: Training tokens at each budget, strictly increasing; at least 3 budgets.
        losses: `{arm: [per-example test losses at budget 0, at budget 1, ...]}`: one array per budget, the
            same test examples (in the same order) for every arm and budget.
        weights: The same structure with each example's weight (its token count); `None`: equal weights. An
            arm's test loss at a budget is `sum(loss * w) / sum(w)`.
        growth, controls: Names of the growth arms and of the controls; every one of them is fitted.
        best_growth, best_control: The arms compared, chosen by the caller on held-out data.
        controls_within, best_control_within: Optional: the controls whose forgetting stays within the
            user's forgetting budget, and the best of them: a second crossover is predicted against it.
        horizon: How far to search, as a multiple of the largest budget.
        n_bootstrap: Replicates of the bootstrap over test examples (`0`: no interval). seed: their seed.
        confidence: Level of the percentile intervals.
        fresh_tokens: The tokens of one pass over the training data: the fresh data that exists. A prediction
            past it (or a search that runs past it) is said to be beyond the fresh data, in epochs; `None`: not said.

    Returns:
        A JSON-ready dict: `fits` (`{arm: LearningCurveFit.to_dict()}`), `on_gain` (the crossover of
        `best_growth` against `best_control`: `status` "crossover" / "none" / "tie" (within `TIE_NATS`) / "ahead" /
        "unfit" / "floor_at_bound" (either fit's floor sits at its bound, so no crossover can be read from them; what
        the fits gave is kept in `fitted_status`), `tokens`, `multiple`, `interval`, `share_with_crossover`,
        `share_ahead`, with `fresh_tokens`: `epochs` (of the prediction) and `beyond_fresh_data`; and `text`),
        `within_forgetting` (the same against `best_control_within`; `{"status": "no_control", "text"}` when
        `controls_within` is empty; `None` without `controls_within`), and the settings. An interval's upper end
        is `"inf"` when some replicates predict no crossover within the horizon (`open_ended`).

    Raises:
        ValueError: on fewer than 3 budgets, tokens not increasing, arrays of mismatched lengths, non-finite
            values, or arm names that are not in `growth` / `controls` / `controls_within`.
    """
    growth, controls = list(growth), list(controls)
    _check_settings(n_bootstrap, confidence, seed)
    if not isinstance(horizon, (int, float)) or isinstance(horizon, bool) or not 1 < horizon < math.inf:
        raise ValueError(f"horizon must be a finite number > 1 (a multiple of the largest budget), got {horizon!r}")
    if fresh_tokens is not None and not (math.isfinite(fresh_tokens) and fresh_tokens > 0):
        raise ValueError(f"fresh_tokens must be a finite number > 0 (the tokens of one pass over the training data), got {fresh_tokens}")
    _check_names(growth, controls, best_growth, best_control, controls_within, best_control_within)
    sweep = _Sweep(tokens, losses, weights, growth + controls)
    if len(sweep.tokens) < 3:
        raise ValueError(f"a learning curve needs at least 3 budgets to fit E, A and alpha, got {len(sweep.tokens)}")
    curves = {arm: sweep.curve(arm) for arm in growth + controls}
    fitted = {arm: _fit(sweep.tokens, curves[arm]) for arm in curves}
    pairs = {"on_gain": (best_growth, best_control)}
    if best_control_within is not None:
        pairs["within_forgetting"] = (best_growth, best_control_within)
    boot = {key: [] for key in pairs}
    needed = sorted({arm for pair in pairs.values() for arm in pair})
    for counts in sweep.replicates(n_bootstrap, seed):
        refit = {}
        for arm in needed:
            if (rep := sweep.curve(arm, counts)) is not None:
                refit[arm] = _fit(sweep.tokens, rep, replicate=True)
        for key, (g, c) in pairs.items():
            if g in refit and c in refit:
                status, multiple = _first_crossing(refit[g], refit[c], sweep.tokens[-1], horizon)
                if status != "unfit":
                    boot[key].append(multiple)
    out = {
        "tokens": sweep.tokens.tolist(), "largest_tokens": float(sweep.tokens[-1]), "horizon": float(horizon), "fresh_tokens": fresh_tokens,
        "fits": {arm: fit.to_dict() for arm, fit in fitted.items()},
        "bootstrap": {"requested": n_bootstrap, "seed": seed, "confidence": confidence},
        "within_forgetting": None,
    }
    for key, (g, c) in pairs.items():
        out[key] = _crossover_entry(g, c, fitted, curves, sweep.tokens[-1], horizon, boot[key], confidence, fresh_tokens)
    if controls_within is not None and best_control_within is None:
        out["within_forgetting"] = {
            "status": "no_control", "text": "no control stays within the forgetting budget: nothing to overtake"
        }
    return json_safe(out)


def _check_names(growth, controls, best_growth, best_control, controls_within, best_control_within) -> None:
    within = None if controls_within is None else list(controls_within)
    problems = [
        (not growth or not controls, "need at least one growth arm and one control"),
        (set(growth) & set(controls), f"arms cannot be both growth and control: {sorted(set(growth) & set(controls))}"),
        (best_growth not in growth, f"best_growth {best_growth!r} is not one of the growth arms {growth}"),
        (best_control not in controls, f"best_control {best_control!r} is not one of the controls {controls}"),
        (within is not None and not set(within) <= set(controls), f"controls_within {within} are not all controls"),
        (bool(within) and best_control_within is None, "controls_within is not empty: pass its best as best_control_within"),
        (best_control_within is not None and best_control_within not in (within or []),
         f"best_control_within {best_control_within!r} must be one of controls_within {within}"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(message)


def _crossover_entry(g, c, fitted, curves, d_max, horizon, replicates, confidence, fresh_tokens=None) -> dict:
    fitted_status, multiple = _first_crossing(fitted[g], fitted[c], d_max, horizon)
    floors = {arm: fitted[arm].floor_at_bound for arm in (g, c) if fitted[arm].floor_at_bound}
    # A floor placed by its bound decides any extrapolation by itself; inside the measured budgets ("ahead") it does not.
    status = "floor_at_bound" if floors and fitted_status in ("crossover", "none") else fitted_status
    found = status in ("crossover", "ahead")
    entry = {
        "growth": g, "control": c, "status": status, "fitted_status": fitted_status,
        "floor_at_bound": {arm: {"side": side, "E": fitted[arm].E} for arm, side in floors.items()},
        "multiple": multiple if found else None, "tokens": multiple * d_max if found else None,
        "measured_at_largest": {
            "growth": float(curves[g][-1]), "control": float(curves[c][-1]),
            "difference": float(curves[g][-1] - curves[c][-1]),
        },
        "fitted_at_largest": {"growth": fitted[g].predict(d_max), "control": fitted[c].predict(d_max)},
        "interval": None, "share_with_crossover": None, "share_ahead": None, "replicates": len(replicates),
    }
    if replicates:
        values = np.array(replicates)
        low, high = _percentiles(values, confidence)
        entry["interval"] = {
            "multiple": [low, high], "tokens": [low * d_max, high * d_max], "open_ended": not math.isfinite(high),
            "confidence": confidence,
        }
        entry["share_with_crossover"] = float(np.mean(np.isfinite(values)))
        entry["share_ahead"] = float(np.mean(values == 1.0))
    if fresh_tokens is not None:
        entry["fresh_tokens"] = float(fresh_tokens)
        entry["epochs_at_largest"] = d_max / fresh_tokens
        entry["epochs"] = entry["tokens"] / fresh_tokens if found else None
        reach = entry["tokens"] if found else horizon * d_max  # how far the claim extrapolates
        entry["beyond_fresh_data"] = bool(reach > fresh_tokens)
    entry["text"] = _crossover_text(entry, horizon, confidence)
    return entry


def _fresh_note(e: dict, horizon: float) -> str:
    """Where the claim stands against the fresh data (`""` without `fresh_tokens`): in epochs, and beyond it in words."""
    if "fresh_tokens" not in e:
        return ""
    largest, ends = e["epochs_at_largest"], 1.0 / e["epochs_at_largest"]
    where = f"which ends at {ends:.3g}x the largest budget" + (f" (the largest budget is already {format_epochs(largest)} epochs)" if ends < 1 else "")
    if e["status"] == "crossover":
        text = f", which is {format_epochs(e['epochs'])} epochs of the training data"
        return text + (f": beyond the fresh data, {where}" if e["beyond_fresh_data"] else ": within the fresh data")
    if e["status"] == "none":
        if not e["beyond_fresh_data"]:
            return f" ({horizon:g}x is {format_epochs(horizon * largest)} epochs of the training data: within the fresh data)"
        return f"; {horizon:g}x is {format_epochs(horizon * largest)} epochs of the training data: the search runs beyond the fresh data, {where}"
    if largest > 1:  # ahead, or a floor at its bound: only the measured budgets speak, and they already repeat data
        return f"; the largest budget is already {format_epochs(largest)} epochs of the training data: beyond the fresh data"
    return ""


def _crossover_text(e: dict, horizon: float, confidence: float) -> str:
    g, c = e["growth"], e["control"]
    if e["status"] == "unfit":
        return f"no prediction: the learning curve of {g} or {c} could not be fitted"
    if e["status"] == "floor_at_bound":
        which = "; ".join(f"{arm}: E at its {f['side']} bound {f['E']:.4g}" + (", its lowest measured test loss" if f["side"] == "upper" else "")
                          for arm, f in e["floor_at_bound"].items())
        return f"the fit's floor is at its bound: no crossover can be read from it ({g} vs {c}; {which}){_fresh_note(e, horizon)}"
    if e["status"] == "ahead":
        fit = e["fitted_at_largest"]
        head = f"growth is already ahead at the largest budget ({g} fitted {fit['growth']:.4f} < {c} {fit['control']:.4f})"
    elif e["status"] == "tie":
        head = f"no crossover: the fitted curves of {g} and {c} stay within {TIE_NATS:g} nats of each other up to {horizon:g}x (a tie)"
    elif e["status"] == "none":
        head = f"no crossover predicted within {horizon:g}x the largest budget ({g} vs {c})"
    else:
        head = f"{g} is predicted to overtake {c} at {e['tokens']:,.0f} tokens ({e['multiple']:.3g}x the largest budget)"
    head += _fresh_note(e, horizon)
    interval = e["interval"]
    if interval is None:
        return head + " (no bootstrap interval)"
    low, high = interval["multiple"]
    shown = f"beyond {horizon:g}x: open-ended" if interval["open_ended"] else f"{high:.3g}x"
    ahead = f" ({e['share_ahead']:.0%} already ahead)" if e["share_ahead"] else ""
    # A replicate that never crosses counts as infinitely far: both ends infinite means no crossing in the interval.
    where = f"entirely beyond {horizon:g}x" if not math.isfinite(low) else f"[{low:.3g}x, {shown}]"
    return (
        f"{head}; {confidence:.0%} bootstrap interval {where}; {e['share_with_crossover']:.0%} of "
        f"{e['replicates']} replicates cross within {horizon:g}x{ahead}"
    )


def validate_fit(
    tokens, losses: dict, weights: dict | None = None, *, arms=None, n_bootstrap: int = 200, seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """Check the fits out of sample: fit each arm on every budget but the largest, predict the largest.

    Args:
        tokens, losses, weights: As for `predict_crossover`.
        arms: The arms to check (default: every arm in `losses`).
        n_bootstrap, seed, confidence: The bootstrap over test examples (the same resampling as
            `predict_crossover`) that gives each prediction and each error its percentile interval.

    Returns:
        A JSON-ready dict: `skipped` (`True` with a `reason` when there are fewer than 4 budgets), else
        `arms` (`{arm: {predicted, measured, error (= predicted - measured), interval, inside, error_interval,
        error_covers_zero}}`: `interval` is the prediction's, `error_interval` also carries the measurement's own
        sampling noise, so it is the one to judge the fit by), `predicted_tokens`, and a one-line `summary`.

    Raises:
        ValueError: on tokens not increasing, arrays of mismatched lengths or non-finite values.
    """
    _check_settings(n_bootstrap, confidence, seed)
    arms = list(losses) if arms is None else list(arms)
    sweep = _Sweep(tokens, losses, weights, arms)
    if len(sweep.tokens) < 4:
        return {"skipped": True, "reason": f"needs at least 4 budgets (3 to fit, 1 to predict), got {len(sweep.tokens)}"}
    d_max = float(sweep.tokens[-1])
    draws = sweep.replicates(n_bootstrap, seed)
    rows = {arm: _validate_arm(sweep, arm, draws, confidence) for arm in arms}
    return json_safe({
        "skipped": False, "fit_tokens": sweep.tokens[:-1].tolist(), "predicted_tokens": d_max,
        "confidence": confidence, "arms": rows, "summary": _validation_summary(rows, len(sweep.tokens) - 1, d_max, confidence),
    })


def _validate_arm(sweep: _Sweep, arm: str, draws, confidence: float) -> dict:
    """One arm's out-of-sample check: fit all budgets but the largest, predict it, and bootstrap both the
    prediction and the error (each replicate's prediction minus that replicate's measurement)."""
    curve, d_max = sweep.curve(arm), float(sweep.tokens[-1])
    fit = _fit(sweep.tokens[:-1], curve[:-1])
    predictions, errors = [], []
    for counts in draws:
        if (rep := sweep.curve(arm, counts)) is not None:
            p = _fit(sweep.tokens[:-1], rep[:-1], replicate=True).predict(d_max)
            if math.isfinite(p):  # a refit that failed predicts nan
                predictions.append(p)
                errors.append(p - rep[-1])
    predicted, measured = fit.predict(d_max), float(curve[-1])
    interval = _percentiles(predictions, confidence) if predictions else None
    error_interval = _percentiles(errors, confidence) if errors else None
    return {
        "predicted": predicted, "measured": measured, "error": predicted - measured, "interval": interval,
        "inside": None if interval is None else bool(interval[0] <= measured <= interval[1]),
        "error_interval": error_interval,
        "error_covers_zero": None if error_interval is None else bool(error_interval[0] <= 0.0 <= error_interval[1]),
        "replicates": len(predictions), "flat": fit.flat, "message": fit.message,
    }


def _validation_summary(rows: dict, fitted: int, d_max: float, confidence: float) -> str:
    errors = {arm: abs(r["error"]) for arm, r in rows.items() if math.isfinite(r["error"])}
    head = f"fit on the first {fitted} budgets, predicting {d_max:,.0f} tokens: "
    if not errors:
        return head + "no arm could be fitted"
    worst = max(errors, key=errors.get)
    head += f"largest |error| {errors[worst]:.4f} nats ({worst})"
    checked = [r["inside"] for r in rows.values() if r["inside"] is not None]
    if not checked:
        return head + "; no bootstrap intervals"
    covers = sum(bool(r["error_covers_zero"]) for r in rows.values())
    return head + (
        f"; measured inside the {confidence:.0%} interval of the prediction for {sum(checked)} of {len(checked)} arms"
        f"; the interval of the error covers 0 for {covers} of {len(checked)}"
    )
