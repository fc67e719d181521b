"""Scaling study: a 2 x 2 grid at tiny sizes, its outputs, resume, and two processes.

Cells train through `hf_depthgrow.training.train` (the one training loop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.scaling import StudyConfig, TaskGrid, run_study
from hf_depthgrow.scaling.cells import local_accelerator, train_config
from hf_depthgrow.scaling.report import _spearman, findings
from hf_depthgrow.scaling.tasks import build_model, load_task_data

REPO = Path(__file__).resolve().parents[1]

TINY = {
    "digits": dict(task="vit", dataset="digits", patch_size=4, depths=[1, 2], widths=[16, 32], data_sizes=[300],
                   train_steps=30, grow_steps=15, eval_every=15, batch_size=32, heldout_size=150, test_size=200,
                   probe_batches=3, probe_batch_size=32, selection_examples=200),
    "lm": dict(task="lm", depths=[1, 2], widths=[16, 32], data_sizes=[60], block_size=24, train_steps=30, grow_steps=15,
               eval_every=15, batch_size=16, heldout_size=40, test_size=60, probe_batches=3, probe_batch_size=16,
               selection_examples=60),
}


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    cfg = StudyConfig(output_dir=str(out), fit_bootstrap=0, progress=False, tasks=TINY)
    summary = run_study(cfg)
    return cfg, out, summary


def test_tiny_grid_outputs(tiny_study):
    cfg, out, summary = tiny_study
    cells = sorted((out / "cells").glob("*.json"))
    assert len(cells) == 8 and summary["num_cells"] == 8
    for path in cells:
        row = json.loads(path.read_text())
        p = row["probe"]
        assert p["positions"] == list(range(row["depth"] + 1))
        assert len(p["z"]) == len(p["offdiag_share"]) == len(p["population"]) == row["depth"] + 1
        assert all(0.0 <= v <= 1.0 for v in p["offdiag_share"])
        # The block went where the probe's z was largest.
        assert row["growth"]["position"] == p["positions"][max(range(len(p["z"])), key=lambda i: p["z"][i])]
        t = row["test"]
        assert t["delta"] == pytest.approx(t["loss_base"] - t["loss_grown"], abs=1e-9)
        if row["growth"]["selected"] == "f_old":  # the fallback rule: then the "grown" result is the base
            assert t["delta"] == 0.0
        else:
            assert row["growth"]["train_loss_new"] <= row["growth"]["train_loss_old"]
        assert row["N_grown"] > row["N"]
        # Both trainings train: the base from scratch, and the grown model starts at f_old.
        base, grown = row["base"], row["growth"]
        assert base["steps"] == [0, 15, 30] and base["curve"][-1] < base["curve"][0]
        assert base["train_curve"][-1] < base["train_curve"][0]
        assert grown["steps"] == [0, 15] and grown["curve"][0] == pytest.approx(base["curve"][-1], rel=1e-5)
        assert grown["delta_erm"] == pytest.approx(grown["train_loss_old"] - grown["train_loss_new"])
        unit = 1 if row["task"] == "vit" else TINY["lm"]["block_size"] - 1
        assert row["D"] == row["data_size"] * unit
    # Every finding is decided, and the report says so.
    for name in TINY:
        assert set(summary["findings"][name]) == {"covariance_near_diagonal", "signal_decays_with_depth",
                                                  "z_grows_with_width", "joint_scaling_beats_depth_alone"}
        assert all(isinstance(f["reproduced"], bool) for f in summary["findings"][name].values())
        # Four points cannot carry a five-parameter law: the fit is skipped with the reason.
        assert set(summary["fits"][name]) == {"skipped"}
    text = (out / "RESULTS.md").read_text()
    assert text.count("| digits |") >= 4 + 4 and "covariance near-diagonal" in text
    for key in ("covariance", "signal_depth", "z_width", "growth_paths"):
        png = Path(summary["figures"][key])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["tasks"]["lm"]["block_size"] == 24


def test_non_embedding_count_is_the_layer_stack(tiny_study):
    cfg, out, _ = tiny_study
    grid = cfg.tasks["lm"]
    data = load_task_data(grid, 0)
    model = build_model(grid, data, 2, 32, 0)
    _, stack, _ = resolve_family(model)
    row = json.loads((out / "cells" / "lm_L2_d32_n60.json").read_text())
    assert row["N"] == sum(p.numel() for p in stack.parameters())
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32


def test_rerun_reuses_cells_and_aggregate_only(tiny_study):
    cfg, out, _ = tiny_study
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    run_study(cfg)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    (out / "RESULTS.md").unlink()
    run_study(cfg, only_aggregate=True)
    assert (out / "RESULTS.md").exists()


def test_splits_are_disjoint():
    grid = TaskGrid(**TINY["lm"])
    data = load_task_data(grid, 0)
    key = lambda r: tuple(r["input_ids"].tolist())  # noqa: E731
    train, held, test = ({key(r) for r in rows} for rows in (data.train, data.heldout, data.test))
    assert not (train & test) and not (train & held) and not (held & test)
    grid = TaskGrid(**TINY["digits"])
    data = load_task_data(grid, 0)
    assert len(data.train) == 300 and len(data.test) == 200 and data.train[0]["pixel_values"].shape == (1, 8, 8)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(task="rnn"), "task must be one of"),
        (dict(task="vit", dataset="shakespeare"), "does not fit task"),
        (dict(widths=[24]), "multiples of head_dim"),
        (dict(depths=[]), "non-empty list"),
        (dict(depths=[2, 2]), "repeated"),
        (dict(data_sizes=[0]), "positive integers"),
        (dict(learning_rate=0), "positive number"),
    ],
)
def test_grid_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        TaskGrid(**bad)


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="at least one task"):
        StudyConfig(tasks={})
    with pytest.raises(ValueError, match="unknown keys"):
        StudyConfig.from_dict({"tasks": {"a": {"task": "vit", "dpeths": [1]}}})
    for path in (REPO / "recipes" / "configs" / "scaling").glob("*.yaml"):
        cfg = StudyConfig.from_yaml(path)
        assert cfg.tasks and all(g.cells() for g in cfg.tasks.values()), path


def test_train_configs_follow_the_grid():
    grid = TaskGrid(**TINY["digits"])
    base, grown = train_config(grid, 20, grown=False, seed=3), train_config(grid, 300, grown=True, seed=3)
    assert (base.trainable, base.fallback, base.max_steps, base.learning_rate) == ("full", False, 30, grid.learning_rate)
    assert base.per_device_train_batch_size == 20  # never more than the training set
    assert (grown.trainable, grown.fallback, grown.max_steps, grown.learning_rate) == ("new", True, 15, grid.grow_learning_rate)
    assert grown.selection_max_examples == 200 and grown.seed == 4 and grown.warmup_steps == 1
    assert base.lr_scheduler == grown.lr_scheduler == "cosine" and base.mixed_precision == "no"


def test_local_accelerator_ignores_the_launcher(monkeypatch):
    """Each process trains its own cells: no process group, no DDP, whatever torchrun set."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999", "ACCELERATE_MIXED_PRECISION": "bf16"}.items():
        monkeypatch.setenv(key, value)
    acc = local_accelerator("cpu")
    assert acc.num_processes == 1 and acc.device.type == "cpu" and acc.mixed_precision == "no"
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert "ACCELERATE_TORCH_DEVICE" not in os.environ


def test_spearman_and_findings_criteria():
    assert _spearman([1, 2, 4], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert _spearman([1, 2, 4], [1.0, 1.0, 1.0]) != _spearman([1, 2, 4], [1.0, 1.0, 1.0])  # nan: undefined

    def cell(L, d, n, loss, z, pop, off):
        return {"name": "t", "depth": L, "width": d, "data_size": n, "test": {"loss_grown": loss},
                "probe": {"positions": list(range(L + 1)), "z": z, "population": pop, "offdiag_share": off}}

    rows = [cell(1, 16, 10, 2.0, [1.0, 2.0], [0.5, 0.4], [0.1, 0.2]), cell(2, 16, 10, 2.1, [1.0, 1.5, 0.5], [0.2, 0.1, 0.1], [0.3] * 3),
            cell(1, 32, 10, 1.9, [3.0, 4.0], [0.3, 0.2], [0.2] * 2), cell(2, 32, 10, 1.8, [2.0, 5.0, 1.0], [0.1] * 3, [0.2] * 3)]
    f = findings(rows)["t"]
    assert f["covariance_near_diagonal"]["reproduced"] and f["covariance_near_diagonal"]["median"] == pytest.approx(0.2)
    assert f["signal_decays_with_depth"]["reproduced"]  # 0.5 -> 0.2 and 0.3 -> 0.1
    assert f["z_grows_with_width"]["reproduced"]  # 2 -> 4, 1.5 -> 5
    g = f["joint_scaling_beats_depth_alone"]
    assert g["joint_losses"] == [2.0, 1.8] and g["narrow_losses"] == [2.0, 2.1] and g["reproduced"]


@pytest.mark.slow
def test_two_processes_split_the_grid_and_agree_with_one(tmp_path, tiny_study):
    """`torchrun --nproc_per_node 2`: each process takes half the cells; the cells equal the one-process run's."""
    cfg, out_one, _ = tiny_study
    data = cfg.to_dict()
    data["tasks"] = {"digits": data["tasks"]["digits"]}
    data["output_dir"] = str(tmp_path / "two")
    data["progress"] = False
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29741",
           str(REPO / "recipes" / "scaling_study.py"), "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    # torchrun's own summary fills the tail of stderr: show the workers' first traceback too.
    first = proc.stderr.find("Traceback")
    assert proc.returncode == 0, (proc.stderr[first : first + 4000] if first >= 0 else "") + proc.stderr[-2000:]
    assert "torchrun --nproc_per_node 2" in (tmp_path / "two" / "RESULTS.md").read_text()
    for cell in (tmp_path / "two" / "cells").glob("*.json"):
        a, b = json.loads(cell.read_text()), json.loads((out_one / "cells" / cell.name).read_text())
        assert a["test"]["loss_base"] == pytest.approx(b["test"]["loss_base"], rel=1e-6)
        assert a["growth"]["position"] == b["growth"]["position"]
    assert len(list((tmp_path / "two" / "cells").glob("*.json"))) == 4
