"""Intervals and Route A/B terms against hand computations, and a coverage simulation."""

import math

import numpy as np
import pytest

from hf_depthgrow.evaluation.bounds import (
    bernstein_interval,
    bootstrap_interval,
    bootstrap_means,
    hoeffding_interval,
    paired_intervals,
)
from hf_depthgrow.evaluation.routes import RouteInputs, eps_k, eps_m, route_bounds

DELTA = 0.05


def _diffs(m=50, seed=0, bound=2.0):
    rng = np.random.default_rng(seed)
    return bound * (2 * rng.beta(2, 5, size=m) - 1)


def test_hoeffding_matches_hand_computation():
    d, bound = _diffs(), 2.0
    half = 2 * bound * math.sqrt(math.log(2 / DELTA) / (2 * d.size))
    low, high = hoeffding_interval(d, DELTA, bound)
    assert low == pytest.approx(d.mean() - half, abs=1e-12)
    assert high == pytest.approx(d.mean() + half, abs=1e-12)
    with pytest.raises(ValueError, match="clip"):
        hoeffding_interval(d * 10, DELTA, bound)


def test_bernstein_matches_maurer_pontil_formula():
    d, bound = _diffs(), 2.0
    m, log_term = d.size, math.log(4 / DELTA)  # delta/2 per side
    var = np.sum((d - d.mean()) ** 2) / (m - 1)
    half = math.sqrt(2 * var * log_term / m) + 7 * (2 * bound) * log_term / (3 * (m - 1))
    low, high = bernstein_interval(d, DELTA, bound)
    assert (low, high) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-12)


def test_bootstrap_matches_numpy_percentile_of_resampled_means():
    d = _diffs(m=37)
    rng = np.random.default_rng(7)
    means = d[rng.integers(0, d.size, size=(1000, d.size))].mean(axis=1)
    expected = np.quantile(means, [DELTA / 2, 1 - DELTA / 2])
    assert bootstrap_interval(d, DELTA, n_bootstrap=1000, seed=7) == pytest.approx(tuple(expected), abs=1e-12)
    # chunked drawing gives exactly the one-call stream
    np.testing.assert_array_equal(bootstrap_means(d, 1000, 7), means)


def test_paired_intervals_clip_and_certify():
    old = np.array([3.0, 1.0, 1.2, 0.9, 1.1, 1.0])
    new = old - 0.2
    out = paired_intervals(old, new, delta=DELTA, bound=2.0, n_bootstrap=200, seed=0)
    assert out["hoeffding"]["clipped"] == 2  # 3.0 and 2.8 > B
    assert out["hoeffding"]["center"] == pytest.approx(np.mean(np.clip(old, 0, 2) - np.clip(new, 0, 2)))
    assert out["bootstrap"]["center"] == pytest.approx(0.2)
    assert out["bootstrap"]["certified"] and out["bootstrap"]["low"] == pytest.approx(0.2)
    assert not out["hoeffding"]["certified"]


def test_coverage_simulation():
    """400 synthetic test sets with a known mean: Hoeffding/Bernstein conservative, bootstrap near nominal."""
    trials, m, bound = 400, 100, 1.0
    true_mean = bound * (2 * 2 / 7 - 1)  # B (2 Beta(2,5) - 1)
    se = math.sqrt(DELTA * (1 - DELTA) / trials)
    rng = np.random.default_rng(123)
    hits = {"hoeffding": 0, "bernstein": 0, "bootstrap": 0}
    for t in range(trials):
        d = bound * (2 * rng.beta(2, 5, size=m) - 1)
        for name, (low, high) in (
            ("hoeffding", hoeffding_interval(d, DELTA, bound)),
            ("bernstein", bernstein_interval(d, DELTA, bound)),
            ("bootstrap", bootstrap_interval(d, DELTA, n_bootstrap=500, seed=t)),
        ):
            hits[name] += low <= true_mean <= high
    cover = {k: v / trials for k, v in hits.items()}
    assert cover["hoeffding"] >= 1 - DELTA - 3 * se
    assert cover["bernstein"] >= 1 - DELTA - 3 * se
    # percentile bootstrap is asymptotic: slightly liberal at m = 100, allow 1 point on top of 3 SE
    assert abs(cover["bootstrap"] - (1 - DELTA)) <= 3 * se + 0.01, cover


def test_eps_terms_and_routes_by_hand():
    n, m, bound = 1000, 200, 5.0
    inputs = RouteInputs(n_train=n, delta_erm=0.01, delta_r=0.2, delta_r_test=0.15, rho=0.5, b_w=0.3, b_a=10.0)
    em = 2 * 0.5 * 0.3 * 10.0 / math.sqrt(n) + bound * math.sqrt(math.log(2 / DELTA) / (2 * n))
    ek = bound * math.sqrt(math.log(2 / DELTA) / (2 * m))
    assert eps_m(rho=0.5, b_w=0.3, b_a=10.0, n=n, delta=DELTA, bound=bound) == pytest.approx(em)
    assert eps_k(bound, m, DELTA) == pytest.approx(ek)
    out = route_bounds(inputs, loss_old=3.0, bound=bound, m=m, delta=DELTA)
    a, b = out["route_a"], out["route_b"]
    assert a["upper_bound_loss_new"] == pytest.approx(3.0 - 0.1 - 0.01 + 2 * em)
    assert b["upper_bound_loss_new"] == pytest.approx(3.0 - 0.15 - 0.01 + 2 * (em + ek))
    assert a["vacuous"] and "vacuous" in a["sentence"] and "certifies no improvement" in a["sentence"]
    assert b["vacuous"]


def test_route_certifies_with_large_n_and_reports_missing():
    inputs = RouteInputs(n_train=10**9, delta_erm=0.05, delta_r=0.4, delta_r_test=0.3, rho=0.1, b_w=0.1, b_a=1.0)
    out = route_bounds(inputs, loss_old=3.0, bound=5.0, m=10**8, delta=DELTA)
    assert not out["route_a"]["vacuous"] and "certifies an improvement" in out["route_a"]["sentence"]
    partial = route_bounds(RouteInputs(delta_erm=0.1), loss_old=3.0, bound=1.0, m=10, delta=DELTA)
    assert not partial["route_a"]["complete"]
    assert "delta_r" in partial["route_a"]["missing"] and "rho" in partial["route_a"]["missing"]
    assert partial["terms"]["eps_K"] == pytest.approx(eps_k(1.0, 10, DELTA))
    # a bound above the loss range says nothing
    big = route_bounds(RouteInputs(n_train=4, delta_erm=0.0, delta_r=0.0, delta_r_test=0.0, rho=1, b_w=1, b_a=1),
                       loss_old=0.9, bound=1.0, m=4, delta=DELTA)
    assert "says nothing" in big["route_b"]["sentence"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        hoeffding_interval([], DELTA, 1.0)
    with pytest.raises(ValueError, match="delta"):
        bootstrap_interval([0.1, 0.2], 1.5)
    with pytest.raises(ValueError, match="non-finite"):
        bootstrap_interval([0.1, float("nan")], DELTA)
    with pytest.raises(ValueError, match="bound"):
        hoeffding_interval([0.1], DELTA, 0.0)


def test_bootstrap_is_scipys_percentile_interval_and_one_example_is_a_point():
    from scipy.stats import bootstrap

    d = _diffs(m=256)
    scipy_ci = bootstrap((d,), np.mean, n_resamples=2000, vectorized=True, method="percentile", confidence_level=1 - DELTA,
                         rng=np.random.default_rng(11)).confidence_interval
    assert bootstrap_interval(d, DELTA, n_bootstrap=2000, seed=11) == pytest.approx(tuple(scipy_ci), abs=1e-12)
    # scipy refuses a single observation; every resample of one pair is that pair.
    assert bootstrap_interval([0.3], DELTA, n_bootstrap=50) == (0.3, 0.3)
    np.testing.assert_array_equal(bootstrap_means([0.3], 5, 0), np.full(5, 0.3))
    with pytest.raises(ValueError, match="n_bootstrap"):
        bootstrap_interval(d, DELTA, n_bootstrap=0)


# --------------------------------------------------------------------------------------------------------------------
# Cluster (document-level) bootstrap
# --------------------------------------------------------------------------------------------------------------------


def _documents_with_an_effect(n_docs=24, per_doc=8, seed=0):
    """Blocks whose differences share their document's effect (sd 0.5) on top of block noise (sd 0.1)."""
    rng = np.random.default_rng(seed)
    docs = np.repeat(np.arange(n_docs), per_doc)
    return 0.05 + rng.normal(0.0, 0.5, n_docs)[docs] + rng.normal(0.0, 0.1, docs.size), docs


def test_cluster_bootstrap_widens_intervals_on_correlated_blocks():
    from hf_depthgrow.evaluation.decisions import corrected_intervals

    d, docs = _documents_with_an_effect()
    low_b, high_b = bootstrap_interval(d, 0.05, n_bootstrap=2000, seed=0)
    low_c, high_c = bootstrap_interval(d, 0.05, n_bootstrap=2000, seed=0, clusters=docs)
    # 24 documents carry the information, not 192 blocks: the spread of the mean is about sqrt(8) times larger.
    assert (high_c - low_c) > 2.0 * (high_b - low_b)
    assert low_c < d.mean() < high_c
    # The same in the corrected intervals of several arms and in the paired intervals' bootstrap entry.
    arms = {"a": d, "b": d + 0.01}
    plain, clustered = corrected_intervals(arms, seed=0, n_bootstrap=500), corrected_intervals(arms, seed=0, n_bootstrap=500, clusters=docs)
    for name in arms:
        width = lambda out: out["arms"][name]["high"] - out["arms"][name]["low"]  # noqa: E731
        assert width(clustered) > 2.0 * width(plain)
        assert clustered["arms"][name]["p_value"] > plain["arms"][name]["p_value"]
    old = np.full(d.size, 3.0)
    details = paired_intervals(old, old - d, delta=0.05, bound=10.0, n_bootstrap=2000, seed=0, clusters=docs)
    assert (details["bootstrap"]["low"], details["bootstrap"]["high"]) == pytest.approx((low_c, high_c), abs=1e-12)
    assert "24 documents" in details["bootstrap"]["formula"]


def test_cluster_bootstrap_equals_the_block_bootstrap_when_each_block_is_its_own_document():
    from hf_depthgrow.evaluation.decisions import corrected_intervals

    d, _ = _documents_with_an_effect()
    own = [f"page-{i}" for i in np.random.default_rng(1).permutation(d.size)]  # any labels, one per block
    for seed in (0, 7):
        assert bootstrap_interval(d, 0.05, n_bootstrap=1000, seed=seed, clusters=own) == bootstrap_interval(d, 0.05, n_bootstrap=1000, seed=seed)
        assert np.array_equal(bootstrap_means(d, 1000, seed, clusters=own), bootstrap_means(d, 1000, seed))
    arms = {"a": d, "b": -d}
    assert corrected_intervals(arms, n_bootstrap=500, clusters=own) == corrected_intervals(arms, n_bootstrap=500)


def test_cluster_bootstrap_refuses_bad_clusters():
    d, docs = _documents_with_an_effect(n_docs=3, per_doc=2)
    with pytest.raises(ValueError, match="clusters has 5 labels for 6 examples"):
        bootstrap_interval(d, 0.05, clusters=docs[:5])
    with pytest.raises(ValueError, match="needs at least 2 documents; all 6 examples name one"):
        bootstrap_interval(d, 0.05, clusters=[0] * 6)
