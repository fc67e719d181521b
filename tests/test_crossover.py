"""Learning-curve fits `L(D) = E + A * D^-alpha`, the predicted crossover and its validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hf_depthgrow.comparison.crossover import FLAT_NATS, fit_learning_curve, predict_crossover, validate_fit

TOKENS = 10240 * 2.0 ** np.arange(5)  # 10,240 ... 163,840: four doublings, as a budget sweep runs them
CROSS = 5 * TOKENS[-1]  # where the constructed growth curve overtakes the constructed control


def control(D):
    return 3.5 + 50 * np.asarray(D, dtype=float) ** -0.3


def growth(D):
    # Same exponent, lower floor, larger coefficient: equal to control() exactly at CROSS.
    return 3.0 + (50 + 0.5 * CROSS**0.3) * np.asarray(D, dtype=float) ** -0.3


def per_example(curve, n=300, sd=0.5, seed=0, common=None, tokens=TOKENS):
    """One array per budget whose mean is exactly `curve(D)`: centred noise, plus an optional per-example offset
    `common` shared by every arm and budget (the same test example is hard for every arm)."""
    rng = np.random.default_rng(seed)
    out = []
    for D in tokens:
        noise = rng.normal(0.0, sd, n)
        noise -= noise.mean()
        out.append(curve(D) + noise + (0.0 if common is None else common))
    return out


@pytest.mark.parametrize("E, A, alpha", [(3.0, 60.0, 0.4), (2.2, 900.0, 0.7), (1.1, 4.0, 0.12)])
def test_exact_curve_recovers_parameters(E, A, alpha):
    fit = fit_learning_curve(TOKENS, E + A * TOKENS**-alpha)
    assert fit.converged and fit.message == "ok" and not fit.flat
    for got, true in ((fit.E, E), (fit.A, A), (fit.alpha, alpha)):
        assert got == pytest.approx(true, rel=1e-3)
    assert fit.predict(1e7) == pytest.approx(E + A * 1e7**-alpha, rel=1e-6)
    assert fit.to_dict()["alpha"] == pytest.approx(alpha, rel=1e-3)


def test_three_points_are_enough():
    D = TOKENS[:3]
    fit = fit_learning_curve(D, 3.0 + 60 * D**-0.4)
    assert fit.num_points == 3 and fit.predict(D[-1]) == pytest.approx(3.0 + 60 * D[-1] ** -0.4, rel=1e-6)


@pytest.mark.parametrize("losses", [[3.2] * 5, [3.2, 3.21, 3.19, 3.2, 3.22]])
def test_flat_curve_is_finite_and_flagged(losses):
    fit = fit_learning_curve(TOKENS, losses)
    assert fit.flat and fit.message.startswith("flat")
    assert all(math.isfinite(v) for v in (fit.E, fit.A, fit.alpha, fit.rss))
    far = fit.predict(100 * TOKENS[-1])
    assert abs(far - fit.predict(TOKENS[-1])) < FLAT_NATS  # predicts a constant, out to the horizon
    assert min(losses) - 1e-9 <= far <= max(losses)
    json.dumps(fit.to_dict(), allow_nan=False)


def test_rising_losses_are_flat_and_said_so():
    fit = fit_learning_curve(TOKENS, [3.0, 3.1, 3.2, 3.3, 3.4])
    assert fit.flat and "not as a falling power law" in fit.message


def test_a_parameter_on_its_bound_is_said():
    # Straight in log D: no floor in sight, so E runs to its lower bound 0 and the message says so.
    fit = fit_learning_curve(TOKENS, 5.0 - 0.3 * np.log2(TOKENS / TOKENS[0]))
    assert not fit.flat and "E at its lower bound 0: extrapolation is uncertain" in fit.message
    # Flattened already: E sits on the smallest measured loss.
    fit = fit_learning_curve(TOKENS, [4.0, 3.0, 2.9, 2.85, 2.84])
    assert "E at its upper bound 2.84" in fit.message


def _crossover(losses, **kwargs):
    kwargs.setdefault("n_bootstrap", 60)
    return predict_crossover(
        TOKENS, losses, growth=["probe:1"], controls=["lora", "layers"], best_growth="probe:1", best_control="lora",
        **kwargs,
    )


def test_constructed_crossing_is_found_with_an_interval_that_covers_it():
    losses = {"probe:1": per_example(growth, seed=1), "lora": per_example(control, seed=2),
              "layers": per_example(lambda D: control(D) + 0.1, seed=3)}
    out = _crossover(losses)
    json.dumps(out, allow_nan=False)  # JSON-ready: the open end of an interval is the string "inf"
    cross = out["on_gain"]
    assert cross["status"] == "crossover"
    assert cross["tokens"] == pytest.approx(CROSS, rel=1e-4) and cross["multiple"] == pytest.approx(5.0, rel=1e-4)
    low, high = cross["interval"]["multiple"]
    assert low <= 5.0 and (high == "inf" or high >= 5.0)
    assert cross["interval"]["open_ended"] == (high == "inf")
    assert 0.5 < cross["share_with_crossover"] <= 1.0 and cross["replicates"] == 60
    assert cross["text"].startswith("probe:1 is predicted to overtake lora at 819,200 tokens (5x the largest budget)")
    assert set(out["fits"]) == {"probe:1", "lora", "layers"}
    assert out["fits"]["lora"]["E"] == pytest.approx(3.5, rel=1e-4)
    assert out["within_forgetting"] is None
    assert _crossover(losses) == out  # seeded


def test_bootstrap_keeps_the_pairing():
    # Every test example carries one large offset shared by every arm and budget. A replicate that draws harder
    # examples raises every curve by the same amount, which moves no crossing: the interval must stay at 5x.
    # Resampling each arm or budget on its own draw would scatter the crossing widely.
    common = np.random.default_rng(9).normal(0.0, 2.0, 300)
    zero = {"sd": 0.0, "common": common}
    out = _crossover({"probe:1": per_example(growth, **zero), "lora": per_example(control, **zero),
                      "layers": per_example(control, **zero)})
    low, high = out["on_gain"]["interval"]["multiple"]
    assert low == pytest.approx(5.0, rel=1e-3) and high == pytest.approx(5.0, rel=1e-3)
    assert out["on_gain"]["share_with_crossover"] == 1.0


def test_no_crossover_and_already_ahead():
    better = lambda D: control(D) - 0.2  # noqa: E731
    losses = {"probe:1": per_example(control, seed=1), "lora": per_example(better, seed=2),
              "layers": per_example(control, seed=3)}
    none = _crossover(losses)["on_gain"]
    assert none["status"] == "none" and none["tokens"] is None
    assert none["text"].startswith("no crossover predicted within 100x the largest budget (probe:1 vs lora)")
    assert none["share_with_crossover"] < 0.5
    far = _crossover({"probe:1": per_example(control, sd=0.0), "lora": per_example(better, sd=0.0), "layers": per_example(control, sd=0.0)})
    assert far["on_gain"]["share_with_crossover"] == 0.0
    assert "95% bootstrap interval entirely beyond 100x; 0% of" in far["on_gain"]["text"]  # was "[infx, beyond 100x: open-ended]"
    losses["probe:1"], losses["lora"] = losses["lora"], losses["probe:1"]
    ahead = _crossover(losses)["on_gain"]
    assert ahead["status"] == "ahead" and ahead["multiple"] == 1.0
    assert ahead["text"].startswith("growth is already ahead at the largest budget")


def test_second_crossover_within_the_forgetting_budget():
    # A control with a higher floor that learns faster than growth: growth overtakes it later, at 20x.
    expected = 20 * TOKENS[-1]
    coef = 50 + 0.5 * CROSS**0.3 - 0.2 * expected**0.3  # 3.0 + g D^-0.3 = 3.2 + coef D^-0.3 at D = expected
    slow = lambda D: 3.2 + coef * np.asarray(D, dtype=float) ** -0.3  # noqa: E731
    losses = {"probe:1": per_example(growth, seed=1), "lora": per_example(control, seed=2),
              "layers": per_example(slow, seed=3)}
    out = _crossover(losses, controls_within=["layers"], best_control_within="layers", n_bootstrap=20)
    assert out["within_forgetting"]["control"] == "layers"
    assert out["within_forgetting"]["tokens"] == pytest.approx(expected, rel=1e-4)
    assert out["on_gain"]["tokens"] == pytest.approx(CROSS, rel=1e-4)
    empty = _crossover(losses, controls_within=[], n_bootstrap=0)
    assert empty["within_forgetting"]["status"] == "no_control"
    assert empty["on_gain"]["interval"] is None and "no bootstrap interval" in empty["on_gain"]["text"]


def test_weights_make_the_weighted_mean():
    # Half the examples weigh 3x: the measured loss is the token-weighted mean, not the plain one.
    base = per_example(control, seed=4)
    w = [np.where(np.arange(300) < 150, 3.0, 1.0) for _ in TOKENS]
    losses = {"probe:1": per_example(growth, seed=1), "lora": base, "layers": base}
    weights = {arm: w for arm in losses}
    out = _crossover(losses, weights=weights, n_bootstrap=0)
    expected = [float(np.sum(l * wi) / np.sum(wi)) for l, wi in zip(base, w)]
    fit = fit_learning_curve(TOKENS, expected)
    assert out["fits"]["lora"]["E"] == pytest.approx(fit.E) and out["fits"]["lora"]["alpha"] == pytest.approx(fit.alpha)
    assert out["on_gain"]["measured_at_largest"]["control"] == pytest.approx(expected[-1])


def test_validation_error_is_predicted_minus_measured():
    # The first four budgets lie on the curve; the largest is measured 0.05 nats above it.
    def bumped(D):
        return control(D) + (0.05 if D == TOKENS[-1] else 0.0)

    losses = {"lora": per_example(bumped, seed=2), "probe:1": per_example(growth, seed=1)}
    out = validate_fit(TOKENS, losses, n_bootstrap=40)
    json.dumps(out, allow_nan=False)
    row = out["arms"]["lora"]
    assert row["predicted"] == pytest.approx(float(control(TOKENS[-1])), abs=1e-6)
    assert row["measured"] == pytest.approx(float(control(TOKENS[-1])) + 0.05, abs=1e-9)
    assert row["error"] == pytest.approx(row["predicted"] - row["measured"], abs=1e-12)
    assert row["error"] == pytest.approx(-0.05, abs=1e-6)
    low, high = row["interval"]
    assert low < row["predicted"] < high and row["inside"] == (low <= row["measured"] <= high)
    low, high = row["error_interval"]  # replicate predictions minus replicate measurements
    assert low < row["error"] < high and row["error_covers_zero"] == (low <= 0 <= high)
    assert out["arms"]["probe:1"]["error"] == pytest.approx(0.0, abs=1e-6) and out["arms"]["probe:1"]["inside"]
    assert out["fit_tokens"] == TOKENS[:-1].tolist() and out["predicted_tokens"] == TOKENS[-1]
    assert out["summary"].startswith("fit on the first 4 budgets, predicting 163,840 tokens: largest |error| 0.0500")
    covered = int(row["error_covers_zero"]) + int(out["arms"]["probe:1"]["error_covers_zero"])
    assert out["summary"].endswith(
        f"interval of the prediction for {int(row['inside']) + 1} of 2 arms; the interval of the error covers 0 for {covered} of 2"
    )


def test_validation_needs_four_budgets():
    losses = {"lora": per_example(control, tokens=TOKENS[:3])}
    out = validate_fit(TOKENS[:3], losses)
    assert out == {"skipped": True, "reason": "needs at least 4 budgets (3 to fit, 1 to predict), got 3"}


@pytest.mark.parametrize(
    "tokens, losses, match",
    [
        (TOKENS[:2], [4.0, 3.9], "at least 3 budgets"),
        ([1e4, 3e4, 2e4], [4.0, 3.9, 3.8], "strictly increasing"),
        ([1e4, 1e4, 2e4], [4.0, 3.9, 3.8], "strictly increasing"),
        (TOKENS, [4.0, 3.9, 3.8], "same length"),
        (TOKENS, [4.0, 3.9, float("nan"), 3.7, 3.6], "finite"),
        ([1e4, 2e4, float("inf")], [4.0, 3.9, 3.8], "finite"),
        ([0, 2e4, 4e4], [4.0, 3.9, 3.8], "> 0"),
    ],
)
def test_bad_curve_is_a_clear_error(tokens, losses, match):
    with pytest.raises(ValueError, match=match):
        fit_learning_curve(tokens, losses)


def _good():
    return {"probe:1": per_example(growth, n=20), "lora": per_example(control, n=20), "layers": per_example(control, n=20)}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda l, k: l["lora"].pop(), "one array per budget"),
        (lambda l, k: l.pop("layers"), "no per-example test losses for arm 'layers'"),
        (lambda l, k: l["lora"].__setitem__(0, l["lora"][0][:10]), "same, non-empty test examples"),
        (lambda l, k: l.__setitem__("lora", [v[:10] for v in l["lora"]]), "they must be the same examples"),
        (lambda l, k: l["lora"][2].__setitem__(3, np.nan), "arm 'lora': losses contain non-finite values"),
        (lambda l, k: l.__setitem__("layers", [v * 0 for v in l["layers"]]), "arm 'layers': the test loss must be > 0"),
        (lambda l, k: k.__setitem__("best_growth", "lora"), "not one of the growth arms"),
        (lambda l, k: k.__setitem__("best_control", "nope"), "not one of the controls"),
        (lambda l, k: k.update(controls=["lora", "probe:1"]), "both growth and control"),
        (lambda l, k: k.update(controls_within=["lora"]), "pass its best as best_control_within"),
        (lambda l, k: k.update(controls_within=["lora"], best_control_within="layers"), "must be one of"),
        (lambda l, k: k.update(best_control_within="layers"), "must be one of"),
        (lambda l, k: k.update(horizon=1.0), "horizon must be a finite number > 1"),
        (lambda l, k: k.update(n_bootstrap=-1), "n_bootstrap"),
        (lambda l, k: k.update(weights={"probe:1": [-np.ones(20)] * 5}), "weights must be >= 0"),
    ],
)
def test_bad_sweep_is_a_clear_error(change, match):
    losses = _good()
    kwargs = dict(growth=["probe:1"], controls=["lora", "layers"], best_growth="probe:1", best_control="lora", n_bootstrap=2)
    change(losses, kwargs)
    with pytest.raises(ValueError, match=match):
        predict_crossover(TOKENS, losses, **kwargs)


def test_crossover_needs_three_budgets():
    losses = {arm: per_example(control, n=20, tokens=TOKENS[:2]) for arm in ("probe:1", "lora")}
    with pytest.raises(ValueError, match="at least 3 budgets"):
        predict_crossover(TOKENS[:2], losses, growth=["probe:1"], controls=["lora"], best_growth="probe:1", best_control="lora")
