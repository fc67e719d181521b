"""Placement policies held to oracle sweeps: the worst-case regret rule, the committed default, and the reports."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from hf_depthgrow.probe.placement_policy import (
    DEFAULT_PLACEMENT,
    DEFAULT_TRACK_RECORD,
    TaskOracle,
    choose_default,
    load_task,
    policy_table,
    track_record,
    track_record_line,
    track_record_markdown,
)
from hf_depthgrow.probe.result import recommend

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("placement_track_record", ROOT / "docs" / "decisions" / "placement" / "track_record.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["placement_track_record"] = module
    spec.loader.exec_module(module)
    return module


def _tasks():
    # "steady" picks the second best everywhere and ranks the rest badly (Spearman -0.4 on each task); "bold" ranks two
    # tasks perfectly and the third upside down.
    gains = {"a": [0.0, 0.1, 0.2, 0.3, 0.4], "b": [0.4, 0.3, 0.2, 0.1, 0.0], "c": [0.0, 0.2, 0.4, 0.1, 0.3]}
    steady = {"a": [3, 2, 1, 4, 0], "b": [0, 4, 1, 2, 3], "c": [4, 2, 1, 3, 5]}
    bold = {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2, 3, 4], "c": [0, 2, 4, 1, 3]}
    return [TaskOracle(t, [0, 1, 2, 3, 4], g, {"z": steady[t], "lookahead": bold[t]}) for t, g in gains.items()]


def test_the_smallest_worst_case_regret_wins_over_a_higher_mean_spearman():
    rows = {r["policy"]: r for r in policy_table(_tasks())}
    bold, steady = rows["lookahead"], rows["z"]
    assert bold["mean_spearman"] > steady["mean_spearman"]
    assert bold["worst_relative_regret"] == pytest.approx(1.0) and bold["worst_task"] == "b"
    assert steady["worst_relative_regret"] == pytest.approx(0.25)
    assert choose_default(list(rows.values()))["policy"] == "z"
    assert steady["tasks"]["a"] == {"pick": 3, "regret": pytest.approx(0.1), "relative_regret": pytest.approx(0.25), "spearman": pytest.approx(-0.4)}


def test_regret_is_relative_to_each_task_range_and_random_is_its_expectation():
    small = TaskOracle("small", [0, 1, 2, 3], [0.0, 0.01, 0.02, 0.04], {})
    large = TaskOracle("large", [0, 1, 2, 3], [4.0, 3.0, 2.0, 0.0], {})
    rows = {r["policy"]: r for r in policy_table([small, large])}
    assert rows["depth"]["tasks"]["large"]["regret"] == pytest.approx(4.0)
    assert rows["depth"]["tasks"]["small"]["relative_regret"] == 0.0
    assert rows["bottom"]["tasks"]["small"]["relative_regret"] == pytest.approx(1.0)
    assert rows["random"]["tasks"]["small"]["regret"] == pytest.approx((0.04 + 0.03 + 0.02 + 0.0) / 4)
    assert rows["random"]["tasks"]["large"]["relative_regret"] == pytest.approx((0 + 1 + 2 + 4) / 4 / 4)
    assert rows["random"]["mean_spearman"] == 0.0


def test_a_policy_measured_on_fewer_tasks_is_never_the_default():
    tasks = _tasks()
    tasks[0].scores["adept"] = [0, 1, 2, 3, 4]  # perfect where measured, missing on two tasks
    rows = policy_table(tasks)
    adept = next(r for r in rows if r["policy"] == "adept")
    assert not adept["complete"] and adept["worst_relative_regret"] == 0.0 and rows[-1] is adept
    assert choose_default(rows)["policy"] == "z"
    assert "1 of 3 tasks" in track_record_markdown(track_record(tasks))


def test_ties_in_the_worst_case_go_to_the_smaller_mean_then_the_cheaper_policy():
    task = TaskOracle("t", [0, 1, 2, 3], [0.0, 0.1, 0.2, 0.3], {"z": [0, 1, 2, 3], "lookahead": [0, 1, 2, 3]})
    assert choose_default(policy_table([task]))["policy"] == "depth"  # all three regret 0; depth costs nothing


def test_bad_inputs_are_one_clear_error():
    with pytest.raises(ValueError, match="one value per position"):
        TaskOracle("t", [0, 1, 2], [0.1, 0.2, 0.3], {"z": [1.0, 2.0]})
    with pytest.raises(ValueError, match="unknown placement policies"):
        policy_table(_tasks(), ["nope"])
    with pytest.raises(ValueError, match="distinct"):
        policy_table([_tasks()[0], _tasks()[0]])


def test_the_default_is_the_winner_on_the_committed_tasks():
    script = _script()
    record = script.committed_record()
    assert record["default"] == DEFAULT_PLACEMENT
    row = script.default_row(record)
    assert row.keys() == DEFAULT_TRACK_RECORD.keys()
    for key, value in row.items():
        assert DEFAULT_TRACK_RECORD[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    committed = json.loads((ROOT / "docs" / "decisions" / "placement" / "track_record.json").read_text())
    assert committed["default"] == DEFAULT_PLACEMENT
    # The committed table is this code's, to the last bits another CPU's summation order may change.
    assert committed["policies"] == _approx(json.loads(json.dumps(record["policies"])))
    assert {"t": [{"regret": 0.25 + 1e-6}]} != _approx({"t": [{"regret": 0.25}]})  # a real change still fails it


def _approx(value):
    """`value` with each float a `pytest.approx` of itself (rel 1e-9, abs 1e-12), for nested dicts and lists."""
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_approx(v) for v in value]
    return pytest.approx(value, rel=1e-9, abs=1e-12) if isinstance(value, float) else value


def test_committed_spearman_and_regret_agree_with_the_oracle_tables():
    # The policy table's numbers for the validation's own predictors are the ones probe_validation.json printed.
    for name, folder in _script().TASKS.items():
        validation = json.loads((folder / "probe_validation.json").read_text())
        rows = {r["policy"]: r["tasks"][name] for r in policy_table([load_task(folder, name)])}
        for printed in validation["table"]:
            if printed["predictor"] in rows and printed["predictor"] != "random":
                got = rows[printed["predictor"]]
                assert got["regret"] == pytest.approx(printed["regret"], abs=1e-12), (name, printed["predictor"])
                if not math.isnan(float(printed["spearman"])):
                    assert got["spearman"] == pytest.approx(printed["spearman"], abs=1e-12), (name, printed["predictor"])


def test_the_probe_recommends_by_the_default_policy_and_prints_its_track_record():
    positions, z, improvable = [0, 1, 2, 3], [0.5, 3.0, 2.5, 1.0], [True, True, True, False]
    rec = recommend(positions, z, improvable, signal=[9.0, 1.0, 2.0, 3.0], num_layers=3)
    from hf_depthgrow.probe.placement_policy import probe_policy_scores

    scores = probe_policy_scores(DEFAULT_PLACEMENT, positions, z=z, signal=[9.0, 1.0, 2.0, 3.0], num_layers=3)
    assert rec["policy"] == DEFAULT_PLACEMENT
    assert rec["best"] == max((k for k, ok in zip(positions, improvable) if ok), key=lambda k: scores[k])
    assert recommend(positions, z, improvable, policy="depth")["positions"] == [2, 1, 0]
    with pytest.raises(ValueError, match="which the probe does not compute"):
        recommend(positions, z, improvable, policy="lookahead")

    from hf_depthgrow.probe.signal import probe
    from hf_depthgrow.testing import tiny_inputs, tiny_model

    model = tiny_model("llama")
    result = probe(model, [tiny_inputs(model, seed=s) for s in range(4)], progress=False, covariance=False)
    result.recommendation = recommend(result.positions, [1.0] * len(result.positions), [True] * len(result.positions))
    line = track_record_line()
    assert line in result.summary()
    assert f"{DEFAULT_TRACK_RECORD['worst_relative_regret']:.2f}" in line and DEFAULT_TRACK_RECORD["worst_task"] in line


def test_the_run_summary_prints_the_track_record_when_the_default_placed_the_blocks():
    from hf_depthgrow.pipeline.summary import placement_policy_summary, summary_markdown

    summary = {"decision": "grew", "positions": [2], "why": "grow at k=2", "selected": "new", "delta_erm": 0.0,
               "probe": {"best": 2, "best_signal": 0.1, "best_z": 3.0, "num_improvable": 1, "num_positions": 3},
               "train_losses": {"new": 1.0}, "held_out_loss": {"before": 1.0, "after": 0.9},
               "test": {"loss_old": 1.0, "loss_new": 0.9, "delta": 0.1, "intervals": {}}, "timings_s": {"total": 1.0},
               "placement_policy": placement_policy_summary(DEFAULT_PLACEMENT)}
    assert f"| placement policy | {track_record_line()} |" in summary_markdown(summary)
    assert placement_policy_summary(None) is None  # the user placed the blocks: no track record claimed
    assert "placement policy" not in summary_markdown({**summary, "placement_policy": None})


def test_added_scores_sit_on_the_oracles_positions_and_say_how_they_were_made():
    for name, folder in _script().TASKS.items():
        path = folder / "placement_scores.json"
        if not path.is_file():
            continue
        added = json.loads(path.read_text())
        validation = json.loads((folder / "probe_validation.json").read_text())
        assert added["positions"] == validation["positions"], name
        assert added["command"].startswith("python docs/decisions/placement/scores.py " + name), name
        assert not set(added["scores"]) & set(validation["scores"]), name  # added, never a second version of a committed score
        assert all(len(v) == len(validation["positions"]) for v in added["scores"].values()), name
