"""The probe verdict's calibration against certified gains (scaling cells), on constructed cells with a known answer."""

import json

import pytest

from hf_depthgrow.probe.signal import Z_THRESHOLD
from hf_depthgrow.scaling.calibration import agreement, calibrate, main, verdict_rows


def _cell(path, task, z, low):
    path.write_text(json.dumps({"task": task, "probe": {"positions": [0, 1], "z": [9.0, z]},
                                "growth": {"position": 1}, "test": {"bootstrap": [low, low + 0.1]}}))


def test_calibration_chooses_leave_one_task_out(tmp_path, capsys):
    # LM: certified iff z > 0.5; ViT: certified iff z > -1.2. Each threshold is learnt on the other task.
    for i, z in enumerate([-2.0, 0.0, 1.0, 3.0]):
        _cell(tmp_path / f"lm{i}.json", "lm", z, 0.01 if z > 0.5 else -0.01)
    for i, z in enumerate([-1.7, -1.0, 0.4, 2.5]):
        _cell(tmp_path / f"vit{i}.json", "vit", z, 0.01 if z > -1.2 else -0.01)
    (tmp_path / "unfinished.json").write_text(json.dumps({"task": "lm", "probe": {}}))
    rows = verdict_rows(tmp_path)
    assert len(rows) == 8 and rows[2]["z"] == 1.0  # the z at the grown position, not the best z
    assert agreement([r for r in rows if r["task"] == "lm"], 2.0) == 0.75
    out = calibrate(rows)
    assert out["lm"]["threshold"] == -1.5 and out["lm"]["after"] == 0.75  # ViT's best (-1.5) is too low for LM
    assert out["vit"]["threshold"] == 0.5 and out["vit"]["after"] == 0.5  # ties (0.5 and 0) go to the larger
    assert out["lm"]["before"] == 0.75 and out["vit"]["before"] == 0.5
    assert main([str(tmp_path)]) == 0 and "| lm | 4 | 2 |" in capsys.readouterr().out


def test_no_cells_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no finished cell"):
        verdict_rows(tmp_path)


def test_default_threshold_is_the_calibrated_one():
    assert Z_THRESHOLD == -1.0
