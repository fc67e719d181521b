"""Scaling-law fit `L(N, D) = E + A N^-alpha + B D^-beta`: recovery, errors, bootstrap, plot."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_depthgrow.scaling.plots import plot_power_law
from hf_depthgrow.scaling.fit import PARAMS, PowerLawFit, fit_power_law

TRUE = {"E": 1.7, "A": 8.0, "alpha": 0.34, "B": 5.0, "beta": 0.28}
OTHER = {"E": 2.3, "A": 400.0, "alpha": 0.7, "B": 2.0, "beta": 0.15}  # A large so N still matters
SIGMA = 0.002
# Fixed noise draw. The 3-stderr check holds for every seed tried (0-7, |z| <= 2.6); the 95%
# bootstrap intervals, as any 95% interval, miss the truth for some draws (seeds 0 and 2).
NOISE_SEED = 1


def grid(n=4, m=4):
    N, D = np.meshgrid(np.geomspace(1e4, 1e6, n), np.geomspace(1e3, 1e5, m))
    return N.ravel(), D.ravel()


def law(p, N, D):
    return p["E"] + p["A"] * N ** -p["alpha"] + p["B"] * D ** -p["beta"]


@pytest.fixture(scope="module")
def clean():
    N, D = grid()
    loss = law(TRUE, N, D)
    return N, D, loss, fit_power_law(N, D, loss, bootstrap=0)


@pytest.fixture(scope="module")
def noisy():
    N, D = grid()
    loss = law(TRUE, N, D) + np.random.default_rng(NOISE_SEED).normal(0.0, SIGMA, N.shape)
    return N, D, loss, fit_power_law(N, D, loss, bootstrap=200, seed=0)


def test_noise_free_recovers_every_parameter(clean):
    *_, fit = clean
    assert fit.converged and fit.message == "ok"
    for name, true in TRUE.items():
        assert abs(getattr(fit, name) - true) / true < 1e-3, name
    assert fit.num_points == 16 and fit.dof == 11
    assert fit.r2 == pytest.approx(1.0)


def test_other_exponents_recovered():
    # Not tuned to one answer: a steep N-term and a shallow D-term.
    N, D = grid()
    fit = fit_power_law(N, D, law(OTHER, N, D), bootstrap=0)
    for name, true in OTHER.items():
        assert abs(getattr(fit, name) - true) / true < 1e-3, name


def test_noisy_truth_within_three_stderr(noisy):
    *_, fit = noisy
    assert fit.converged
    for name, true in TRUE.items():
        se = fit.stderr[name]
        assert math.isfinite(se) and se > 0, name
        assert abs(getattr(fit, name) - true) <= 3 * se, (name, getattr(fit, name), se)
    # sigma^2 = rss / dof estimates the noise variance
    assert 0.3 * SIGMA < math.sqrt(fit.rss / fit.dof) < 3 * SIGMA
    cov = np.array(fit.covariance)
    assert cov.shape == (5, 5) and np.allclose(cov, cov.T)
    assert np.allclose(np.sqrt(np.diag(cov)), [fit.stderr[p] for p in PARAMS])


def test_bootstrap_intervals_contain_truth(noisy):
    *_, fit = noisy
    assert fit.bootstrap_requested == 200 and fit.bootstrap_succeeded > 190
    for name, true in TRUE.items():
        low, high = fit.bootstrap[name]
        assert low <= getattr(fit, name) <= high, name
        assert low <= true <= high, (name, low, high)


def test_bootstrap_is_seeded():
    N, D = grid()
    loss = law(TRUE, N, D) + np.random.default_rng(5).normal(0.0, SIGMA, N.shape)
    a = fit_power_law(N, D, loss, n_starts=4, bootstrap=20, seed=3)
    b = fit_power_law(N, D, loss, n_starts=4, bootstrap=20, seed=3)
    c = fit_power_law(N, D, loss, n_starts=4, bootstrap=20, seed=4)
    assert a.bootstrap == b.bootstrap
    assert a.bootstrap != c.bootstrap


def test_predict_reproduces_synthetic_values(clean):
    N, D, loss, fit = clean
    np.testing.assert_allclose(fit.predict(N, D), loss, rtol=1e-9)
    assert isinstance(fit.predict(1e5, 1e4), float)
    assert fit.predict(1e5, 1e4) == pytest.approx(law(TRUE, 1e5, 1e4), rel=1e-9)
    assert fit.predict(1e6, np.array([1e3, 1e5])).shape == (2,)  # broadcasts


def test_to_dict_round_trips_through_json(noisy):
    *_, fit = noisy
    text = json.dumps(fit.to_dict(), allow_nan=False)  # strict JSON
    back = PowerLawFit.from_dict(json.loads(text))
    assert back == fit
    assert json.loads(text)["stderr"].keys() == set(PARAMS)


def test_summary_is_a_markdown_table(noisy):
    *_, fit = noisy
    text = fit.summary()
    assert "| parameter | value | ± stderr | 95% bootstrap" in text
    for name in PARAMS:
        assert f"| {name} |" in text


def test_equal_weights_change_nothing(clean):
    N, D, loss, fit = clean
    weighted = fit_power_law(N, D, loss, weights=np.full(N.shape, 3.0), bootstrap=0)
    for name in PARAMS:
        assert getattr(weighted, name) == pytest.approx(getattr(fit, name), rel=1e-6)


def test_singular_design_reports_instead_of_crashing():
    # 2 N x 3 D values: an additive law on this grid has 2 + 3 - 1 = 4 identifiable numbers < 5.
    N, D = grid(2, 3)
    fit = fit_power_law(N, D, law(TRUE, N, D), bootstrap=0)
    assert np.allclose(fit.predict(N, D), law(TRUE, N, D), atol=1e-8)
    assert all(math.isinf(se) for se in fit.stderr.values())
    assert np.isnan(np.array(fit.covariance)).all()
    assert "singular" in fit.message
    json.dumps(fit.to_dict(), allow_nan=False)  # inf/nan stay JSON-safe


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda N, D, L: (N[:-1], D, L), "same length"),
        (lambda N, D, L: (N[:5], D[:5], L[:5]), "at least 6 points"),
        (lambda N, D, L: (np.where(np.arange(16) == 3, 0.0, N), D, L), r"N must be finite and > 0.*\[3\]"),
        (lambda N, D, L: (N, np.where(np.arange(16) == 2, -1.0, D), L), r"D must be finite and > 0.*\[2\]"),
        (lambda N, D, L: (np.where(np.arange(16) == 0, np.inf, N), D, L), "N must be finite"),
        (lambda N, D, L: (N, D, np.where(np.arange(16) == 7, np.nan, L)), r"loss must be finite.*\[7\]"),
        (lambda N, D, L: (np.full(16, 1e5), D, L), "N takes only 1 distinct value"),
        (lambda N, D, L: (N, np.full(16, 1e4), L), "D takes only 1 distinct value"),
    ],
)
def test_validation_errors(clean, change, match):
    N, D, loss, _ = clean
    with pytest.raises(ValueError, match=match):
        fit_power_law(*change(N.copy(), D.copy(), loss.copy()), bootstrap=0)


def test_option_errors(clean):
    N, D, loss, _ = clean
    with pytest.raises(ValueError, match="weights"):
        fit_power_law(N, D, loss, weights=np.zeros(16), bootstrap=0)
    with pytest.raises(ValueError, match="loss_floor"):
        fit_power_law(N, D, loss, loss_floor=loss.min(), bootstrap=0)
    with pytest.raises(ValueError, match="n_starts"):
        fit_power_law(N, D, loss, n_starts=0)


def test_plot_writes_png(noisy, tmp_path):
    N, D, loss, fit = noisy
    out = plot_power_law(fit, N, D, loss, tmp_path / "plots" / "scaling.png")
    assert out == tmp_path / "plots" / "scaling.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    assert [p.name for p in out.parent.iterdir()] == ["scaling.png"]  # no temp file left behind


def test_module_does_not_import_torch():
    # The package's own __init__ (and the scaling study) import torch; the fit and the helpers it
    # uses must not. Stub packages stand in for both __init__ files, so only those modules run.
    root = Path(__file__).resolve().parents[1] / "hf_depthgrow"
    code = (
        "import importlib, sys, types\n"
        f"for name, path in (('hf_depthgrow', {str(root)!r}), ('hf_depthgrow.scaling', {str(root / 'scaling')!r})):\n"
        "    pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg\n"
        "importlib.import_module('hf_depthgrow.scaling.fit')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
