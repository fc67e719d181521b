"""Multiple-arm certification and predictor statistics on constructed data with known answers."""

import math

import numpy as np
import pytest
from scipy import stats

from hf_depthgrow.evaluation.bounds import bernstein_interval, bootstrap_interval, hoeffding_interval
from hf_depthgrow.evaluation.decisions import (
    corrected_intervals,
    partial_spearman,
    predictor_table,
    regret,
    spearman,
    top_k_hit_rate,
)

DELTA = 0.05


def _arms(m=300, seed=0):
    """Clearly positive, clearly zero and clearly negative arms, within [-1, 1] for the bounds."""
    rng = np.random.default_rng(seed)
    noise = lambda: rng.uniform(-0.3, 0.3, size=m)  # noqa: E731
    return {"grow_k10": 0.4 + noise(), "grow_k20": 0.3 + noise(), "train_existing": noise(), "lora": -0.4 + noise()}


@pytest.mark.parametrize("kind", ["bootstrap", "bernstein", "hoeffding"])
@pytest.mark.parametrize("method", ["holm", "bonferroni"])
def test_known_certified_set(kind, method):
    out = corrected_intervals(_arms(), delta=DELTA, method=method, kind=kind, loss_bound=1.0, n_bootstrap=500)
    assert out["certified"] == ["grow_k10", "grow_k20"]
    assert out["worse"] == ["lora"]
    assert out["level"] == pytest.approx(DELTA / 4)
    zero = out["arms"]["train_existing"]
    assert zero["low"] < 0 < zero["high"] and not zero["certified"] and not zero["worse"]


def test_displayed_intervals_are_the_bounds_intervals_at_the_bonferroni_level():
    arms, level = _arms(), DELTA / 4
    for kind, fn in [("bootstrap", lambda d: bootstrap_interval(d, level, n_bootstrap=300, seed=3)),
                     ("bernstein", lambda d: bernstein_interval(d, level, 1.0)),
                     ("hoeffding", lambda d: hoeffding_interval(d, level, 1.0))]:
        out = corrected_intervals(arms, kind=kind, loss_bound=1.0, n_bootstrap=300, seed=3)
        for name, d in arms.items():
            row = out["arms"][name]
            assert (row["low"], row["high"]) == fn(d)
            assert row["mean"] == pytest.approx(d.mean())


@pytest.mark.parametrize("kind", ["bootstrap", "bernstein", "hoeffding"])
def test_p_value_is_dual_to_the_interval(kind):
    # p < alpha exactly when the single-arm interval at alpha excludes 0.
    rng = np.random.default_rng(1)
    for shift in [0.0, 0.02, 0.05, 0.1, -0.05]:
        d = np.clip(shift + rng.uniform(-0.5, 0.5, size=200), -1, 1)
        for alpha in [0.001, 0.01, 0.05, 0.2, 0.5]:
            out = corrected_intervals({"a": d}, delta=alpha, kind=kind, loss_bound=1.0, n_bootstrap=400, seed=2)
            row = out["arms"]["a"]
            assert (row["p_value"] < alpha) == (row["low"] > 0 or row["high"] < 0), (shift, alpha, row)


def test_holm_certifies_at_least_bonferroni():
    rng = np.random.default_rng(5)
    gained = 0
    for trial in range(30):
        arms = {f"arm{i}": rng.normal(rng.uniform(-0.05, 0.15), 0.5, size=150) for i in range(5)}
        kw = dict(delta=DELTA, kind="bootstrap", n_bootstrap=300, seed=trial)
        holm, bonf = set(corrected_intervals(arms, method="holm", **kw)["certified"]), set(
            corrected_intervals(arms, method="bonferroni", **kw)["certified"])
        assert bonf <= holm
        gained += len(holm - bonf)
    assert gained > 0  # the step-down buys something on these arms


@pytest.mark.parametrize("method", ["holm", "bonferroni"])
def test_family_wise_error_controlled_with_all_null_arms(method):
    rng = np.random.default_rng(7)
    any_certified = any_rejected = any_finite_sample = 0
    n_sims = 200
    for sim in range(n_sims):
        arms = {f"arm{i}": np.clip(rng.normal(0.0, 0.3, size=200), -1, 1) for i in range(4)}
        out = corrected_intervals(arms, delta=DELTA, method=method, n_bootstrap=1000, seed=sim)
        any_certified += bool(out["certified"])
        any_rejected += bool(out["certified"] or out["worse"])
        out = corrected_intervals(arms, delta=DELTA, method=method, kind="bernstein", loss_bound=1.0)
        any_finite_sample += bool(out["certified"] or out["worse"])
    # Binomial(200, 0.05) has sd ~0.015. The percentile bootstrap is asymptotic and a little liberal
    # (~0.06 over 1000 simulations of this set-up), hence the wider tolerance for any rejection.
    assert any_certified / n_sims <= DELTA + 0.03
    assert any_rejected / n_sims <= DELTA + 0.05
    assert any_finite_sample / n_sims <= DELTA


def test_corrected_intervals_refusals():
    with pytest.raises(ValueError, match="non-empty"):
        corrected_intervals({})
    with pytest.raises(ValueError, match="without differences"):
        corrected_intervals({"a": []})
    with pytest.raises(ValueError, match="different numbers"):
        corrected_intervals({"a": [0.1, 0.2], "b": [0.1]})
    with pytest.raises(ValueError, match="non-finite"):
        corrected_intervals({"a": [0.1, math.nan]})
    with pytest.raises(ValueError, match="method"):
        corrected_intervals({"a": [0.1, 0.2]}, method="fdr")
    with pytest.raises(ValueError, match="kind"):
        corrected_intervals({"a": [0.1, 0.2]}, kind="normal")
    with pytest.raises(ValueError, match="delta"):
        corrected_intervals({"a": [0.1, 0.2]}, delta=1.5)
    with pytest.raises(ValueError, match="loss bound"):
        corrected_intervals({"a": [0.1, 0.2]}, kind="hoeffding")
    with pytest.raises(ValueError, match="clip"):
        corrected_intervals({"a": [0.1, 3.0]}, kind="bernstein", loss_bound=1.0)


def test_spearman_matches_scipy_with_ties():
    rng = np.random.default_rng(0)
    for n in [5, 12, 40]:
        x, y = rng.integers(0, 4, size=n).astype(float), rng.normal(size=n)
        y[: n // 3] = y[0]  # ties in y as well
        assert spearman(x, y, n_permutations=10)[0] == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    x, y = rng.normal(size=30), rng.normal(size=30)
    assert spearman(x, y, n_permutations=10).rho == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)


def test_permutation_p_value_small_for_monotone_and_uniform_under_null():
    x = np.arange(12.0)
    rho, p = spearman(x, np.exp(x / 3), n_permutations=2000)
    assert rho == 1.0 and p == pytest.approx(1 / 2001)
    # Two-sided: a decreasing relation is just as significant.
    assert spearman(x, -x, n_permutations=2000).p_value == pytest.approx(1 / 2001)
    rng = np.random.default_rng(11)
    ps = np.array([spearman(rng.normal(size=20), rng.normal(size=20), n_permutations=499, seed=s).p_value
                   for s in range(300)])
    assert abs(np.mean(ps < 0.05) - 0.05) < 0.04
    assert abs(np.mean(ps < 0.5) - 0.5) < 0.1
    assert stats.kstest(ps, "uniform").pvalue > 0.001
    # Same seed, same answer.
    assert spearman(x, np.sin(x), seed=3) == spearman(x, np.sin(x), seed=3)


def test_partial_spearman_removes_a_correlation_through_depth_only():
    rng = np.random.default_rng(2)
    depth = np.arange(30.0)
    x, y = depth + rng.normal(0, 2, size=30), depth + rng.normal(0, 2, size=30)
    assert spearman(x, y, n_permutations=2000).rho > 0.8
    rho, p = partial_spearman(x, y, depth, n_permutations=2000)
    assert abs(rho) < 0.3 and p > 0.05
    # A real signal beyond depth survives the partialling.
    signal = rng.normal(size=30)
    rho, p = partial_spearman(depth + 3 * signal, depth + 3 * signal + rng.normal(0, 0.5, size=30), depth,
                              n_permutations=2000)
    assert rho > 0.8 and p < 0.01


def test_correlation_refusals():
    with pytest.raises(ValueError, match="at least 3"):
        spearman([1, 2], [2, 1])
    with pytest.raises(ValueError, match="expected 3"):
        spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="non-finite"):
        spearman([1, 2, math.nan], [1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        spearman([], [])
    with pytest.raises(ValueError, match="constant"):
        spearman([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="n_permutations"):
        spearman([1, 2, 3], [1, 3, 2], n_permutations=0)
    with pytest.raises(ValueError, match="at least 4"):
        partial_spearman([1, 2, 3], [1, 3, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="monotone function of z"):
        partial_spearman([1, 2, 3, 4], [1, 3, 2, 4], [10, 20, 30, 40])
    with pytest.raises(ValueError, match="z is constant"):
        partial_spearman([1, 2, 3, 4], [1, 3, 2, 4], [5, 5, 5, 5])


def test_hit_rate_and_regret_on_hand_made_arrays():
    # A SmolLM2 oracle sweep: the probe picked k=26 (realized 0.151), the best was k=10 (0.295).
    positions = np.array([4, 10, 18, 26])
    realized = np.array([0.120, 0.295, 0.201, 0.151])
    probe = np.array([0.1, 0.3, 0.2, 0.9])  # ranks k=26 first
    assert regret(probe, realized) == pytest.approx(0.144)
    assert positions[np.argmax(probe)] == 26
    assert top_k_hit_rate(probe, realized, 1) == 0.0
    assert top_k_hit_rate(probe, realized, 2) == 0.5  # picks {26, 10}; realized top-2 is {10, 18}
    assert top_k_hit_rate(probe, realized, 3) == 1.0
    assert regret(realized, realized) == 0.0 and top_k_hit_rate(realized, realized, 1) == 1.0
    # Ties in the realized gains at the k-th place all count as top-k.
    assert top_k_hit_rate([3, 2, 1], [0.5, 0.2, 0.2], 2) == 1.0
    assert top_k_hit_rate([1, 2, 3], [0.5, 0.2, 0.2], 2) == 1.0
    assert top_k_hit_rate([2, 1, 3], [0.5, 0.2, 0.1], 2) == 0.5
    with pytest.raises(ValueError, match="k must be"):
        top_k_hit_rate(probe, realized, 0)
    with pytest.raises(ValueError, match="k must be"):
        top_k_hit_rate(probe, realized, 5)
    with pytest.raises(ValueError, match="expected 4"):
        regret(probe, realized[:3])
    with pytest.raises(ValueError, match="non-finite"):
        regret(probe, [0.1, math.inf, 0.2, 0.3])


def test_predictor_table():
    rng = np.random.default_rng(4)
    depth = np.arange(12.0)
    realized = -depth / 12 + rng.normal(0, 0.3, size=12)  # shallower is better
    predictors = {"probe": realized + rng.normal(0, 0.01, size=12), "depth_baseline": -depth,
                  "noise": rng.normal(size=12)}
    rows = predictor_table(predictors, realized, depth, n_permutations=999)
    assert [r["predictor"] for r in rows] == list(predictors)
    assert set(rows[0]) == {"predictor", "spearman", "p_value", "partial_spearman", "partial_p_value",
                            "top1_hit", "top3_hit", "regret"}
    probe, base = rows[0], rows[1]
    assert probe["spearman"] > 0.9 and probe["p_value"] < 0.01 and probe["partial_spearman"] > 0.5
    assert probe["regret"] == pytest.approx(0.0) and probe["top1_hit"] == 1.0
    assert base["spearman"] > 0.5 and math.isnan(base["partial_spearman"]) and math.isnan(base["partial_p_value"])
    for row in rows:
        assert row["regret"] >= 0 and 0 <= row["top3_hit"] <= 1
    with pytest.raises(ValueError, match="non-empty"):
        predictor_table({}, realized, depth)
    with pytest.raises(ValueError, match="at least 4"):
        predictor_table({"p": [1, 2, 3]}, [1, 2, 3], [1, 2, 3])
    with pytest.raises(ValueError, match="predictor 'p'"):
        predictor_table({"p": [1, 2, 3]}, realized, depth)
    with pytest.raises(ValueError, match="depth is constant"):
        predictor_table({"p": realized}, realized, np.zeros(12))
