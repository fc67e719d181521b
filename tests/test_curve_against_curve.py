"""Curve against curve: every trained point (arm x rate x budget) on the gain x forgetting comparison, matched controls
for every growth arm, and corrections family-wise across budgets. Built from synthetic trial results (no training)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_depthgrow.comparison import CompareConfig, build_arms
from hf_depthgrow.comparison.aggregate import aggregate
from hf_depthgrow.comparison.arms import Arm
from hf_depthgrow.comparison.trial import BudgetScore, TrialResult, TrialSpec
from hf_depthgrow.testing import tiny_model

N = 200  # test and retention examples
BASE_TEST, BASE_RET, BASE_HELDOUT = 3.0, 2.0, 3.0


def _original(rng) -> dict:
    test = BASE_TEST + 0.05 * rng.standard_normal(N)
    ret = BASE_RET + 0.05 * rng.standard_normal(N)
    return {"test": (test, np.ones(N)), "retention": (ret, np.ones(N)), "heldout": BASE_HELDOUT}


def _trial(arm: Arm, lr: float, points: dict, original: dict, rng) -> TrialResult:
    """A trial whose score at each budget `steps: (gain, forgetting)` is that gain on held-out and test, that forgetting on retention."""
    budgets = tuple(sorted(points))
    scores = {}
    for steps, (gain, forgetting) in points.items():
        test = original["test"][0] - gain + 0.01 * rng.standard_normal(N)
        ret = original["retention"][0] + forgetting + 0.01 * rng.standard_normal(N)
        scores[steps] = BudgetScore(steps=steps, units_seen=8 * steps, heldout_loss=BASE_HELDOUT - gain, selected="new", train_losses={},
                                    test=test, test_weight=np.ones(N), retention=ret, retention_weight=np.ones(N), seconds=0.0)
    spec = TrialSpec(arm, lr, seed=0, budgets=budgets, scheduler="wsd" if len(budgets) > 1 else "cosine")
    return TrialResult(spec=spec, scores=scores, heldout_curve=[(s, scores[s].heldout_loss) for s in budgets],
                       trainable_parameters=arm.trainable_parameters)


def _compare(arms: list[Arm], table: dict, budgets: list[int], **cfg):
    """`aggregate` over synthetic trials: `table[arm name][lr] = {steps: (gain, forgetting)}`."""
    rng = np.random.default_rng(0)
    original = _original(rng)
    trials = [_trial(a, lr, pts, original, rng) for a in arms[1:] for lr, pts in table[a.name].items()]
    config = CompareConfig(growth=[a.name for a in arms if a.kind == "growth"], controls=["layers", "full"], n_bootstrap=400,
                           budgets=budgets if len(budgets) > 1 else None, max_steps=budgets[-1], **cfg)
    grids = {a.name: {"grid": sorted(table[a.name]), "added": [], "stopped": "interior"} for a in arms[1:]}
    return aggregate(arms, trials, original, config, grids=grids, extra={"probe": None, "seconds": {}, "num_examples": {}})


def _arms() -> list[Arm]:
    return [Arm("original", "original"), Arm("probe:1", "growth", trainable_parameters=100),
            Arm("layers", "layers", layers=[3], trainable_parameters=100, matched_to="probe:1"),
            Arm("full", "full", trainable_parameters=1000)]


# full at its gain-optimal rate gains most and forgets most; at a low rate it gains a little more than growth and forgets
# far less: that low-rate point dominates growth, which the gain-optimal rows alone put well below their curve.
DOMINATED = {
    "probe:1": {1e-2: {20: (0.50, 0.03)}},
    "layers": {3e-4: {20: (0.30, 0.30)}},
    "full": {1e-5: {20: (0.55, 0.005)}, 1e-4: {20: (0.70, 0.40)}, 3e-4: {20: (0.90, 0.60)}},
}


def test_a_low_rate_control_that_dominates_growth_is_named_by_the_verdict():
    result = _compare(_arms(), DOMINATED, [20])
    assert result.arm("full").learning_rate == 3e-4  # the table keeps the gain-optimal rate
    curve = result.views[-1].frontier["control_curve"]
    row = curve["arms"]["probe:1"]
    assert row["status"] != "off the curve" and row["margin"]["mean"] < 0
    assert row["dominated_by"] == "full@lr1e-05@20steps"
    assert "probe:1 is dominated by full@lr1e-05@20steps" in result.verdict
    assert "off the curve of every control point (forgets less at matched gain): none" in result.verdict


def test_the_forgetting_budget_choice_ranges_over_every_control_rate():
    result = _compare(_arms(), DOMINATED, [20], max_forgetting=0.05)
    frontier = result.views[-1].frontier
    # Growth is within 0.05 nats, but the low-rate full point gains more and is within it too: it is the choice.
    assert frontier["best_within"] == "full@lr1e-05@20steps"
    assert frontier["points"]["probe:1@lr0.01@20steps"]["forgetting_high"] <= 0.05
    assert "the best within forgetting 0.05 nats is full@lr1e-05@20steps" in result.verdict
    claim = frontier["best_within_test"]  # the claim is on the test parts
    assert claim["gain"]["low"] > 0.5 and claim["forgetting"]["high"] < 0.05
    assert set(frontier["frontier"]) == {"full@lr1e-05@20steps", "full@lr0.0001@20steps", "full@lr0.0003@20steps", "original"}


def test_growth_off_the_whole_curve_is_still_said():
    table = {**DOMINATED, "probe:1": {1e-2: {20: (0.50, -0.02)}}}  # growth forgets less than every control point at its gain
    result = _compare(_arms(), table, [20])
    row = result.views[-1].frontier["control_curve"]["arms"]["probe:1"]
    assert row["status"] == "off the curve" and row["dominated_by"] is None
    assert "forgets less at matched gain): probe:1" in result.verdict


def test_corrections_are_family_wise_across_budgets_and_every_budget_point_is_a_candidate():
    table = {
        "probe:1": {1e-2: {10: (0.40, 0.20), 20: (0.50, 0.25)}},
        "layers": {3e-4: {10: (0.20, 0.30), 20: (0.30, 0.30)}},
        # full at a low rate and the smaller budget: within the budget, and more gain than any point of the larger budget within it.
        "full": {1e-5: {10: (0.60, 0.01), 20: (0.45, 0.30)}, 3e-4: {10: (0.80, 0.50), 20: (0.90, 0.60)}},
    }
    result = _compare(_arms(), table, [10, 20], max_forgetting=0.05)
    for view in result.views:
        stats = view.statistics
        assert stats["family"] == {"delta": 0.05, "blocks": 2, "delta_per_block": 0.025}
        assert stats["vs_original"]["level"] == pytest.approx(0.05 / (3 * 2))  # 3 trained arms x 2 budgets
        assert stats["retention"]["level"] == pytest.approx(0.05 / (3 * 2))
        assert view.frontier["family"]["points"] == 8  # 4 trials x 2 budgets: every point is a candidate
        assert view.frontier["control_curve"]["tests"] == 2 * 2  # growth points per budget, and once more sweep-wide
    assert result.views[-1].frontier["best_within"] == "original"
    assert result.overall["best_within"] == "full@lr1e-05@10steps"
    assert "Over every trained point of every budget (8 arm x rate x budget)" in result.verdict
    assert "Bonferroni over 2 budgets x seeds" in result.to_markdown()


def test_every_growth_arm_gets_a_matched_control_unless_turned_off():
    from hf_depthgrow.comparison.arms import matched_control

    model = tiny_model("llama")
    arms = build_arms(model, ["top:1", "interleave:2"], ["lora", "full"])
    by_name = {a.name: a for a in arms}
    assert matched_control(arms, "top:1") == "lora"
    assert matched_control(arms, "interleave:2") == "layers[interleave:2]"
    match = by_name["layers[interleave:2]"]
    assert match.kind == "layers" and match.matched_to == "interleave:2"
    assert match.trainable_parameters == by_name["interleave:2"].trainable_parameters  # native blocks: an exact match
    assert len(match.layers) == 2
    same = build_arms(model, ["top:1", "bottom:1"], ["layers"])  # one block each: the reference's layers control matches both
    assert [a.name for a in same] == ["original", "top:1", "bottom:1", "layers"]
    off = build_arms(model, ["top:1", "interleave:2"], ["lora"], matched=False)
    assert [a.name for a in off] == ["original", "top:1", "interleave:2", "lora"]


def test_the_verdict_compares_each_growth_arm_with_its_match():
    arms = [*_arms(), Arm("interleave:2", "growth", trainable_parameters=200),
            Arm("layers[interleave:2]", "layers", layers=[1, 3], trainable_parameters=200, matched_to="interleave:2")]
    table = {**DOMINATED, "interleave:2": {1e-2: {20: (0.60, 0.10)}}, "layers[interleave:2]": {3e-4: {20: (0.40, 0.30)}}}
    result = _compare(arms, table, [20])
    assert result.statistics["matched"] == {"probe:1": "layers", "interleave:2": "layers[interleave:2]"}
    vs = result.statistics["vs_matched"]["arms"]
    assert vs["interleave:2"]["mean"] == pytest.approx(0.20, abs=0.01) and vs["interleave:2"]["certified"]
    assert "interleave:2 vs layers[interleave:2]: " in result.verdict and "(certified better)" in result.verdict
    assert result.verdict.startswith("growth did NOT beat the best control (full)")  # and the best control overall


def test_cli_flag_turns_matched_controls_off():
    from hf_depthgrow.cli.compare import build_parser

    _, cfg = build_parser().parse(["--no-matched-controls", "--forgetting-rates", "0"])
    assert cfg.matched_controls is False and cfg.forgetting_rates == 0
    assert CompareConfig().matched_controls is True
    with pytest.raises(ValueError, match="forgetting_rates must be an int >= 0"):
        CompareConfig(forgetting_rates=-1)


def test_with_a_retention_set_each_grid_reaches_below_its_lowest_rate():
    cfg = CompareConfig()
    assert cfg.grid("full", retention=True) == [3.33333e-6, 1e-5, 3e-5, 1e-4, 3e-4]
    assert cfg.grid("full") == [3e-5, 1e-4, 3e-4]  # no forgetting measured: no curve to trace
    assert CompareConfig(forgetting_rates=0).grid("growth", retention=True) == [1e-3, 3e-3, 1e-2]
