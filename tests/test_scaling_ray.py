"""The scaling study's cells on compare's engines: Ray cells equal the serial ones, stored cells are verified."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from hf_depthgrow.comparison import ray_engine
from hf_depthgrow.scaling import StudyConfig, run_study

REPO = Path(__file__).resolve().parents[1]
# The smallest study with two cells: a character Llama at depths 1 and 2, a few steps each.
GRID = dict(task="lm", depths=[1, 2], widths=[16], data_sizes=[60], block_size=24, train_steps=10, grow_steps=5, eval_every=5,
            batch_size=16, heldout_size=40, test_size=60, probe_batches=3, probe_batch_size=16, selection_examples=60)
TIMES = ("seconds", "sha256")  # wall-clock times differ between runs (and with them the digest); nothing else may


def study(out, **kw) -> StudyConfig:
    return StudyConfig(output_dir=str(out), fit_bootstrap=0, progress=False, tasks={"lm": GRID}, **kw)


@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """The serial cells start from what a Ray trial's fresh process has: no Accelerate state left by an earlier test
    (AcceleratorState is a process singleton: a bf16 run before would put these cells under bf16 autocast)."""
    import torch
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_study sets the study's `threads`



@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    return out, run_study(study(out))


def same(a, b) -> bool:
    """Equal as JSON (a finding undefined on a tiny grid is NaN, which equals itself only there)."""
    return json.dumps(timeless(a), sort_keys=True) == json.dumps(timeless(b), sort_keys=True)


def timeless(value):
    """A stored cell (or summary) without its wall-clock times."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k not in TIMES and not k.endswith("_seconds")}
    return [timeless(v) for v in value] if isinstance(value, list) else value


def cells(out) -> dict:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))}


def report(out) -> str:
    """RESULTS.md without the cells' seconds column (the last one)."""
    return re.sub(r"\| [0-9]+ \|$", "|", (out / "RESULTS.md").read_text(), flags=re.M)


@pytest.mark.ray
def test_ray_cells_equal_the_serial_cells_and_the_report_is_the_same(local_ray, serial, tmp_path, monkeypatch):
    out_serial, summary_serial = serial
    out = tmp_path / "ray"
    summary = run_study(study(out, engine="ray", max_concurrent_trials=2))
    ran, on_ray = cells(out_serial), cells(out)
    assert sorted(on_ray) == ["lm_L1_d16_n60.json", "lm_L2_d16_n60.json"]
    assert {k: timeless(v) for k, v in on_ray.items()} == {k: timeless(v) for k, v in ran.items()}
    assert same(summary["findings"], summary_serial["findings"]) and same(summary["fits"], summary_serial["fits"])
    assert report(out) == report(out_serial)
    # Stored cells are verified and reused: the same study again runs no cell on Ray.
    monkeypatch.setattr("hf_depthgrow.scaling.ray_cells.run_cells_ray", None)
    assert same(run_study(study(out, engine="ray"))["findings"], summary["findings"])


def test_a_stored_cell_is_verified_before_reuse(serial, tmp_path):
    out_serial, _ = serial
    out = tmp_path / "edited"
    (out / "cells").mkdir(parents=True)
    for name, row in cells(out_serial).items():
        (out / "cells" / name).write_text(json.dumps(row))
    # Edited by hand: it fails its digest, is run again with a warning, and ends as the serial run's.
    edited = out / "cells" / "lm_L1_d16_n60.json"
    row = json.loads(edited.read_text())
    row["test"]["loss_grown"] = 0.0
    edited.write_text(json.dumps(row))
    with pytest.warns(UserWarning, match=r"lm_L1_d16_n60\.json is unreadable \(its content does not match its sha256 digest\)"):
        run_study(study(out))
    assert timeless(json.loads(edited.read_text())) == timeless(cells(out_serial)["lm_L1_d16_n60.json"])
    # The report is aggregated from verified cells only: an edited one is refused, not reported.
    row = json.loads(edited.read_text())
    row["test"]["delta"] = 1.0
    edited.write_text(json.dumps(row))
    with pytest.raises(ValueError, match=r"lm_L1_d16_n60\.json: its content does not match its sha256 digest"):
        run_study(study(out), only_aggregate=True)
    edited.write_text(json.dumps(cells(out_serial)["lm_L1_d16_n60.json"]))
    # A cell of another study in the same folder is refused before anything runs or is written.
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"lm_L1_d16_n60\.json holds a cell computed with grid\.train_steps=10, this study has 11"):
        run_study(StudyConfig(output_dir=str(out), fit_bootstrap=0, progress=False, tasks={"lm": {**GRID, "train_steps": 11}}))
    assert before == {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _recipe(monkeypatch):
    # The recipe sets the study's command for its report when none is set: set here, so that it ends with the test
    # (a later torchrun test's report would otherwise name this one's command).
    monkeypatch.setenv("HF_DEPTHGROW_STUDY_COMMAND", "python recipes/scaling_study.py (test)")
    spec = importlib.util.spec_from_file_location("scaling_study_recipe", REPO / "recipes" / "scaling_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_ray_without_ray_is_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "tasks": {"lm": GRID}}))
    main = _recipe(monkeypatch).main
    monkeypatch.setattr(ray_engine, "ray_available", lambda: False)
    assert main(["--config", str(config), "--engine", "ray", "--max-concurrent-trials", "2"]) == 2
    assert capsys.readouterr().err == 'scaling_study.py: engine \'ray\' needs Ray, which is not installed: pip install "hf_depthgrow[ray]"\n'
    assert not (tmp_path / "out").exists()
    # The Ray settings are compare's, checked the same way; Ray spreads the cells itself, so not under a launcher.
    monkeypatch.setattr(ray_engine, "ray_available", lambda: True)
    assert main(["--config", str(config), "--engine", "ray", "--resources-per-trial", "0"]) == 2
    assert capsys.readouterr().err == "scaling_study.py: resources_per_trial must be an int >= 1, got 0\n"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--config", str(config), "--engine", "ray"]) == 2
    assert "engine 'ray' spreads the cells itself: run it in one process, not under a launcher" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unreachable_ray_address_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray")
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "tasks": {"lm": GRID}}))
    assert _recipe(monkeypatch).main(["--config", str(config), "--engine", "ray", "--ray-address", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("scaling_study.py: ray_address 127.0.0.1:1: no Ray cluster reachable there")
    assert not (tmp_path / "out").exists()
