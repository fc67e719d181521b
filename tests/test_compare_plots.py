"""The budget sweep's two figures (gain x forgetting plane, learning curves with fits)."""

from __future__ import annotations

import copy
import json
import os
import stat

import numpy as np
import pytest
from PIL import Image

from hf_depthgrow.comparison.crossover import predict_crossover
from hf_depthgrow.comparison.plots import (
    _curves_caption,
    _loss_interval,
    _lower_envelope,
    plot_gain_forgetting,
    plot_learning_curves,
)

STEPS = (20, 40, 80)
TOKENS = [512 * s for s in STEPS]
ORIGINAL = 4.7
# name: (kind, E, A, alpha, forgetting per doubling of the budget)
ARMS = {
    "probe:1": ("growth", 3.15, 30.0, 0.3, 0.002),
    "interleave:2": ("growth", 3.25, 27.0, 0.3, 0.004),
    "lora": ("lora", 3.5, 13.0, 0.3, 0.03),
    "lora:r64": ("lora", 3.45, 14.5, 0.3, 0.05),
    "layers": ("layers", 3.6, 13.0, 0.3, 0.0),
    "full": ("full", 3.3, 17.0, 0.3, 0.09),
}


def make_sweep(n=120):
    """A 3-budget sweep in exactly the JSON form the comparison writes, from known curves plus noise."""
    rng = np.random.default_rng(0)
    per_example = {name: [] for name in ARMS}
    budgets = []
    for steps, D in zip(STEPS, TOKENS):
        arms = {"original": {"kind": "original", "gain": None, "forgetting": None, "test_loss": ORIGINAL,
                             "test_interval": [ORIGINAL - 0.05, ORIGINAL + 0.05]}}
        for name, (kind, E, A, alpha, per_doubling) in ARMS.items():
            losses = E + A * D**-alpha + rng.normal(0.0, 0.3, n)
            per_example[name].append(losses)
            mean, se = float(losses.mean()), float(losses.std() / np.sqrt(n))
            gain = ORIGINAL - mean
            f = per_doubling * np.log2(D / 5000)
            arms[name] = {
                "kind": kind, "gain": {"mean": gain, "low": gain - 2 * se, "high": gain + 2 * se},
                "forgetting": {"mean": f, "low": f - 0.01, "high": f + 0.01},
                "test_loss": mean, "test_interval": [mean - 2 * se, mean + 2 * se],
            }
        budgets.append({"steps": steps, "tokens": D, "arms": arms, "frontier": ["layers", "probe:1"]})
    out = predict_crossover(
        TOKENS, per_example, growth=["probe:1", "interleave:2"], controls=["lora", "lora:r64", "layers", "full"],
        best_growth="probe:1", best_control="lora", controls_within=["layers"], best_control_within="layers",
        n_bootstrap=20,
    )
    fits = out.pop("fits")
    sweep = {"budgets": budgets, "fits": fits, "crossover": out}
    return json.loads(json.dumps(sweep))  # what a reader of compare.json gets back: "inf" strings, no numpy


@pytest.fixture(scope="module")
def full_sweep():
    return make_sweep()


def variant(sweep, forgetting=True, fits=True):
    """`sweep` without a retention set (forgetting None) and/or without fits (fewer than 3 budgets' worth)."""
    sweep = copy.deepcopy(sweep)
    if not forgetting:
        for budget in sweep["budgets"]:
            for arm in budget["arms"].values():
                arm["forgetting"] = None
    if not fits:
        del sweep["fits"], sweep["crossover"]
    return sweep


def check_png(path):
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".")]  # no temp file left behind
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert 800 <= width <= 2000 and 500 <= height <= 1400
        rgb = np.asarray(image.convert("RGB")).astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    # both colour families are drawn: blues for growth, oranges and reds for the controls
    assert ((b > r + 60) & (b > g)).sum() > 200
    assert ((r > b + 80) & (r > g)).sum() > 200


@pytest.fixture(autouse=True)
def usual_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("forgetting", [True, False])
@pytest.mark.parametrize("fits", [True, False])
def test_both_plots_write_a_png(tmp_path, full_sweep, forgetting, fits):
    sweep = variant(full_sweep, forgetting=forgetting, fits=fits)
    if fits:
        assert sweep["crossover"]["on_gain"]["status"] in ("crossover", "none", "ahead")
    out = plot_gain_forgetting(sweep, tmp_path / "plots" / "frontier.png")
    assert out == tmp_path / "plots" / "frontier.png"
    check_png(out)
    check_png(plot_learning_curves(sweep, tmp_path / "plots" / "curves.png"))


def test_optional_parts_missing_or_partial(tmp_path, full_sweep):
    sweep = copy.deepcopy(full_sweep)
    first = sweep["budgets"][0]["arms"]
    first["lora"]["forgetting"] = None  # one arm at one budget without forgetting
    del first["full"]["test_interval"]
    sweep["fits"]["layers"] = {"E": None, "A": None, "alpha": None, "flat": False}  # a fit that failed
    sweep["fits"]["full"]["flat"] = True
    del sweep["budgets"][1]["frontier"]
    del sweep["crossover"]["within_forgetting"]
    check_png(plot_gain_forgetting(sweep, tmp_path / "frontier.png"))
    check_png(plot_learning_curves(sweep, tmp_path / "curves.png"))


def test_the_comparisons_own_rows_draw(tmp_path, full_sweep):
    # compare's per-budget rows carry no test_interval, and give the original a zero gain and forgetting: the loss
    # bars then come from each gain's interval (paired with the original), and the caption says so.
    sweep = copy.deepcopy(full_sweep)
    for budget in sweep["budgets"]:
        for arm in budget["arms"].values():
            del arm["test_interval"]
        budget["arms"]["original"].update(gain={"mean": 0.0, "low": 0.0, "high": 0.0}, forgetting={"mean": 0.0, "low": 0.0, "high": 0.0})
    check_png(plot_gain_forgetting(sweep, tmp_path / "frontier.png"))
    check_png(plot_learning_curves(sweep, tmp_path / "curves.png"))
    gain = sweep["budgets"][0]["arms"]["lora"]["gain"]
    assert _loss_interval(sweep["budgets"][0]["arms"]["lora"], ORIGINAL, used := set()) == pytest.approx(
        (ORIGINAL - gain["high"], ORIGINAL - gain["low"])
    )
    assert used == {"gain"}
    caption = _curves_caption(sweep, sweep["fits"], False, used)
    assert caption.startswith("On gain: " + sweep["crossover"]["on_gain"]["text"])
    assert "Within the forgetting budget: " in caption and "gain's interval carried to the test loss" in caption


@pytest.mark.parametrize("forgetting", [True, False])
def test_an_interval_that_excludes_its_mean_draws(tmp_path, full_sweep, forgetting):
    """A percentile bootstrap's interval can exclude its point estimate (seen with 5 resamples in the regime
    study's smoke run): matplotlib refuses the negative bar, so that side draws none instead of failing the save."""
    sweep = variant(full_sweep, forgetting=forgetting)
    arm = sweep["budgets"][0]["arms"]["probe:1"]
    arm["gain"] = {**arm["gain"], "high": arm["gain"]["mean"] - 0.01}
    if forgetting:
        arm["forgetting"] = {"mean": 0.01, "low": 0.02, "high": 0.03}
    check_png(plot_gain_forgetting(sweep, tmp_path / "frontier.png"))


def test_comparison_plot_with_an_interval_that_excludes_its_mean(tmp_path):
    from types import SimpleNamespace

    from hf_depthgrow.plots import plot_comparison

    arms = [SimpleNamespace(name="original", kind="original", arm={}), SimpleNamespace(name="at:2", kind="growth", arm={"positions": [2]}),
            SimpleNamespace(name="at:3", kind="growth", arm={"positions": [3]}), SimpleNamespace(name="full", kind="full", arm={})]
    rows = {"at:2": {"mean": 0.1, "low": 0.12, "high": 0.2}, "at:3": {"mean": 0.05, "low": 0.0, "high": 0.04},
            "full": {"mean": 0.3, "low": 0.2, "high": 0.4}}
    result = SimpleNamespace(arms=arms, statistics={"vs_original": {"method": "holm", "arms": rows}}, probe=None)
    assert plot_comparison(result, tmp_path / "compare.png").is_file()


def test_an_existing_file_is_replaced(tmp_path, full_sweep):
    target = tmp_path / "curves.png"
    target.write_bytes(b"old")
    plot_learning_curves(variant(full_sweep, fits=False), target)
    check_png(target)


def test_control_curve_is_the_lower_envelope():
    # (gain, forgetting, name): "dominated" has less gain and more forgetting than "lora", so it is off the curve
    points = [(0.8, 0.15, "lora"), (0.6, 0.2, "dominated"), (0.76, 0.0, "layers"), (0.89, 0.45, "full")]
    assert [p[2] for p in _lower_envelope(points)] == ["layers", "lora", "full"]
    assert _lower_envelope([(0.5, 0.1, "a"), (0.5, 0.1, "b")]) == [(0.5, 0.1, "a"), (0.5, 0.1, "b")]
