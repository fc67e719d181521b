"""Experiment tracking (`report_to`): what the trainer, `run` and `compare` write through Accelerate's trackers.

TensorBoard event files are read back with TensorBoard's own `EventAccumulator` and compared with the
numbers the trainer, the probe and the evaluation returned. Offline, CPU, tiny models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_depthgrow import grow_depth
from hf_depthgrow.comparison import CompareConfig
from hf_depthgrow.config import ConfigError, ConfigParser, ScriptArguments, load_config
from hf_depthgrow.pipeline import RunConfig
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.guards import run_fingerprint
from hf_depthgrow.training.tracking import NO_TRACKING, log_probe_run, start_tracking, tracking_run
from hf_depthgrow.training.trainer import train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TRAIN_TAGS = {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s"}
END_TAGS = {"eval/loss", "selection/loss_new", "selection/loss_old", "selection/delta_erm", "eval/loss_selected"}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100)
    return LlamaForCausalLM(config).eval()


def lm_rows(n: int, seq: int = 16, seed: int = 0) -> list[dict]:
    ids = torch.randint(2, 100, (n, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of one TensorBoard run folder: `{tag: [(step, value), ...]}`."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def close(logged: float, expected: float) -> bool:
    return math.isfinite(logged) and math.isclose(logged, expected, rel_tol=1e-6, abs_tol=1e-7)  # event files hold float32


def quick(tmp_path, **kw) -> TrainConfig:
    settings = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, eval_steps=2,
                    progress_bar=False, output_dir=str(tmp_path / "out"), save_final_model=False)
    return TrainConfig(**{**settings, **kw})


# --------------------------------------------------------------------------- settings and flags


def test_report_to_takes_a_name_a_list_or_none_and_names_the_valid_ones():
    assert TrainConfig().report_to == ["none"]
    assert TrainConfig(report_to="tensorboard", output_dir="x").report_to == ["tensorboard"]
    assert TrainConfig(report_to=["wandb", "tensorboard"], output_dir="x").report_to == ["wandb", "tensorboard"]
    assert TrainConfig(report_to=None).report_to == ["none"]
    for cls in (TrainConfig, RunConfig, CompareConfig):
        with pytest.raises(ValueError, match=r"unknown tracker 'tensorbord'; valid: 'none' or one or more of 'tensorboard', 'wandb'"):
            cls(report_to="tensorbord")
        with pytest.raises(ValueError, match="cannot be combined"):
            cls(report_to=["none", "wandb"])
    assert RunConfig(report_to="tensorboard").report_to == ["tensorboard"]
    assert CompareConfig(report_to="wandb").report_to == ["wandb"]
    with pytest.raises(ValueError, match="neither logging_dir nor output_dir"):
        TrainConfig(report_to="tensorboard")  # TensorBoard writes files: somewhere must be given
    assert TrainConfig(report_to="tensorboard", logging_dir="logs").resolved_logging_dir() == "logs"
    assert TrainConfig(output_dir="runs/k24").resolved_logging_dir() == str(Path("runs/k24/runs"))
    assert TrainConfig(output_dir="runs/k24").resolved_run_name() == "k24"
    with pytest.raises(ValueError, match="project_name"):
        TrainConfig(project_name=" ")


def test_tracking_settings_do_not_change_the_run_fingerprint():
    """A checkpoint may be resumed with tracking switched on or off: it changes no weight."""
    model, rows = tiny_llama(), lm_rows(4)
    plain = run_fingerprint(model, rows, TrainConfig(output_dir="a"))
    tracked = run_fingerprint(model, rows, TrainConfig(output_dir="a", report_to="tensorboard", logging_dir="l", run_name="r", project_name="p"))
    assert plain == tracked


def test_report_to_is_a_flag_and_a_yaml_key_of_train_run_and_compare(tmp_path):
    from hf_depthgrow.cli.compare import build_parser as compare_parser
    from hf_depthgrow.cli.run import build_parser as run_parser
    from hf_depthgrow.cli.train import build_parser as train_parser

    _, config, _ = train_parser().parse(["--report-to", "tensorboard", "wandb", "--output-dir", "o", "--run-name", "k24"])
    assert config.report_to == ["tensorboard", "wandb"] and config.run_name == "k24"
    (run,) = run_parser().parse(["--report-to", "tensorboard", "--logging-dir", "logs", "--project-name", "grow"])
    assert (run.report_to, run.logging_dir, run.project_name) == (["tensorboard"], "logs", "grow")
    _, compare = compare_parser().parse(["--report-to", "none"])
    assert compare.report_to == ["none"]
    with pytest.raises(ConfigError, match=r"'tensorbord' is not one of \['none', 'tensorboard', 'wandb'\]; did you mean 'tensorboard'"):
        run_parser().parse(["--report-to", "tensorbord"])
    path = tmp_path / "run.yaml"
    path.write_text("report_to: tensorboard\noutput_dir: out\n")
    _, config = load_config(path, ScriptArguments, TrainConfig)
    assert config.report_to == ["tensorboard"]
    assert ConfigParser([RunConfig]).read_yaml(path)["report_to"] == ["tensorboard"]


# --------------------------------------------------------------------------- the trainer


def test_trainer_logs_losses_learning_rate_and_selection_to_tensorboard(tmp_path):
    model = grow_depth(tiny_llama(), [2])
    train_rows, eval_rows = lm_rows(16, seed=0), lm_rows(8, seed=1)
    result = train(model, train_rows, eval_data=eval_rows, config=quick(tmp_path, report_to="tensorboard", run_name="k2"))
    logged = scalars(tmp_path / "out" / "runs" / "k2")
    assert TRAIN_TAGS | END_TAGS <= set(logged)
    # One point per logging step, equal to the losses the trainer returned.
    assert [s for s, _ in logged["train/loss"]] == [h["step"] for h in result.history] == [1, 2, 3, 4]
    for (_, value), entry in zip(logged["train/loss"], result.history):
        assert close(value, entry["loss"])
    for (_, value), entry in zip(logged["train/learning_rate"], result.history):
        assert close(value, entry["lr"])
    assert logged["train/learning_rate"][-1][1] == 0.0  # cosine to zero at the last step
    # Held-out loss before training, at eval_steps, and after.
    assert [s for s, _ in logged["eval/loss"]] == [e["step"] for e in result.eval_history] == [0, 2, 4]
    for (_, value), entry in zip(logged["eval/loss"], result.eval_history):
        assert close(value, entry["eval_loss"])
    assert close(logged["eval/loss"][0][1], result.eval_loss_before)
    # The fallback rule at the last step.
    assert logged["selection/delta_erm"] == [(4, pytest.approx(result.delta_erm, rel=1e-6))]
    assert close(logged["selection/loss_old"][0][1], result.train_losses["old"])
    assert close(logged["eval/loss_selected"][0][1], result.eval_loss_selected)
    assert all(math.isfinite(v) for points in logged.values() for _, v in points)


def test_report_to_none_creates_and_writes_nothing(tmp_path):
    model = grow_depth(tiny_llama(), [2])
    train(model, lm_rows(8), eval_data=lm_rows(4, seed=1), config=quick(tmp_path, max_steps=2))
    assert not list(tmp_path.rglob("events.out.tfevents*")) and not (tmp_path / "out" / "runs").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train_config.json", "train_result.json"]
    assert tracking_run("none", logging_dir=str(tmp_path / "logs")) is NO_TRACKING
    NO_TRACKING.log({"x": 1.0}, 0)  # every method is a no-op
    NO_TRACKING.finish()
    assert not (tmp_path / "logs").exists()


def test_trainer_writes_into_trackers_its_caller_started_and_leaves_them_open(tmp_path):
    """What `hf-depthgrow run` does: one run holds the training and the evaluation after it."""
    shared = tracking_run("tensorboard", logging_dir=str(tmp_path / "logs"), run_name="grown", config={"lr": 1e-2})
    model = grow_depth(tiny_llama(), [2])
    result = train(model, lm_rows(8), config=quick(tmp_path, max_steps=2, eval_steps=0, report_to="tensorboard"), accelerator=shared.accelerator)
    assert shared.accelerator.trackers  # still open: the caller finishes it
    shared.log({"test/delta": 0.25}, 2)
    shared.finish()
    logged = scalars(tmp_path / "logs" / "grown")
    assert [s for s, _ in logged["train/loss"]] == [1, 2] and close(logged["train/loss"][1][1], result.history[1]["loss"])
    assert logged["test/delta"] == [(2, 0.25)]
    assert not (tmp_path / "out" / "runs").exists()  # nothing written beside the shared run


# --------------------------------------------------------------------------- probe and evaluation


def test_probe_statistics_and_evaluation_are_logged(tmp_path):
    from hf_depthgrow.evaluation import evaluate_delta
    from hf_depthgrow.probe.signal import probe

    model, rows = tiny_llama(), lm_rows(16)
    result = probe(model, rows, batch_size=4, num_splits=4, progress=False)
    log_probe_run(result, "tensorboard", logging_dir=str(tmp_path))
    logged = scalars(tmp_path / "probe")
    assert [s for s, _ in logged["probe/signal"]] == list(result.positions) == [0, 1, 2, 3, 4]
    assert all(close(v, x) for (_, v), x in zip(logged["probe/signal"], result.signal))
    assert all(close(v, x) for (_, v), x in zip(logged["probe/z"], result.z))

    grown = grow_depth(model, [2])
    with torch.no_grad():  # give the new block a non-zero effect, so the delta is not exactly 0
        next(p for n, p in grown.named_parameters() if "layers.2.mlp.down_proj" in n).normal_(0, 0.05)
    evaluation = evaluate_delta(grown, lm_rows(12, seed=2), loss_bound=10.0, n_bootstrap=50, use_evaluate=False)
    tracking = tracking_run(["tensorboard"], logging_dir=str(tmp_path), run_name="grown")
    tracking.log_evaluation(evaluation, step=7)
    tracking.finish()
    logged = scalars(tmp_path / "grown")
    for key in ("loss_old", "loss_new", "delta", "mean_delta"):
        assert logged[f"test/{key}"] == [(7, pytest.approx(getattr(evaluation, key), rel=1e-6, abs=1e-7))], key
    for name, (low, high) in evaluation.intervals.items():
        assert close(logged[f"test/{name}_low"][0][1], low) and close(logged[f"test/{name}_high"][0][1], high), name
    assert evaluation.delta != 0


# --------------------------------------------------------------------------- compare and run


def test_compare_logs_every_arm_the_probe_and_the_corrected_deltas(tmp_path):
    from hf_depthgrow.comparison import compare_plans

    model = tiny_llama()
    with pytest.raises(ValueError, match="logging_dir is not set"):
        compare_plans(model, lm_rows(8), lm_rows(4), lm_rows(4), growth=["top:1"], controls=[], report_to="tensorboard")
    result = compare_plans(
        model, lm_rows(24), lm_rows(8, seed=1), lm_rows(12, seed=2), growth=["probe:1", "top:1"], controls=["layers"], batch_size=4,
        learning_rates=[1e-3, 5e-3], max_steps=4, progress=False, n_bootstrap=100, report_to="tensorboard", logging_dir=str(tmp_path),
        lr_extensions=0,
    )
    runs = sorted(p.name for p in tmp_path.iterdir())
    expected = [f"{arm}-lr{lr}-seed0" for arm in ("layers", "probe:1", "top:1") for lr in ("0.001", "0.005")]
    assert runs == sorted(expected + ["compare-seed0", "probe-seed0"])
    assert [s for s, _ in scalars(tmp_path / "probe-seed0")["probe/z"]] == result.probe["positions"]
    compared = scalars(tmp_path / "compare-seed0")
    for arm in result.arms[1:]:
        row = result.statistics["vs_original"]["arms"][arm.name]
        assert close(compared[f"compare/{arm.name}/test_loss"][0][1], arm.test_loss)
        assert close(compared[f"compare/{arm.name}/delta_vs_original"][0][1], row["mean"])
        assert close(compared[f"compare/{arm.name}/delta_vs_original_low"][0][1], row["low"])
    # Each learning rate's run: held-out losses up to where it stopped (the budget, or a halving rung); the selection at the end.
    for arm in result.arms[1:]:
        for lr, tried in arm.tried.items():
            logged = scalars(tmp_path / f"{arm.name}-lr{lr:g}-seed0")
            assert logged["eval/loss"][0][0] == 0 and logged["eval/loss"][-1][0] == tried["stopped_at"]
            if tried["stopped_at"] == 4:
                assert [s for s, _ in logged["train/loss"]] == [4] and close(logged["eval/loss_selected"][0][1], tried["heldout_loss"])
            else:
                assert "train/loss" not in logged and close(logged["eval/loss"][-1][1], tried["heldout_loss"])


def test_run_pipeline_logs_probe_training_evaluation_and_control(tmp_path):
    from tiny_lm import make_tiny_lm

    from hf_depthgrow.pipeline import run_pipeline

    work = make_tiny_lm(tmp_path / "work", max_chars=20_000)
    cfg = RunConfig(model=str(work / "tiny"), data=str(work / "sample.txt"), output_dir=str(tmp_path / "out"), block_size=16,
                    max_examples=64, batch_size=8, train_steps=4, eval_steps=2, stone_max_batches=2, probe_max_batches=4,
                    progress=False, loss_bound=10.0, force=True, report_to="tensorboard")
    summary = run_pipeline(cfg).summary
    logs = tmp_path / "out" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["control", "grown", "probe"]
    grown = scalars(logs / "grown")
    train_result = summary["held_out_loss"]
    assert [s for s, _ in grown["train/loss"]] == [4] and [s for s, _ in grown["eval/loss"]] == [0, 2, 4]  # logging_steps=10
    assert close(grown["eval/loss"][0][1], train_result["before"]) and close(grown["eval/loss"][-1][1], train_result["after"])
    assert close(grown["test/delta"][0][1], summary["test"]["delta"]) and grown["test/delta"][0][0] == 4
    for name, (low, high) in summary["test"]["intervals"].items():
        assert close(grown[f"test/{name}_low"][0][1], low) and close(grown[f"test/{name}_high"][0][1], high)
    probed = json.loads((tmp_path / "out" / "probe" / "probe.json").read_text())
    logged = scalars(logs / "probe")["probe/signal"]
    assert [s for s, _ in logged] == probed["positions"] and all(close(v, x) for (_, v), x in zip(logged, probed["signal"]))
    assert "train/loss" in scalars(logs / "control")
    assert not list((tmp_path / "out").glob(".*tmp*"))  # the staged folder moved into place with the logs


def test_cli_compare_writes_tracker_logs_into_its_output_folder(tmp_path, capsys):
    from tiny_lm import make_tiny_lm

    from hf_depthgrow.cli import main

    work = make_tiny_lm(tmp_path / "work", max_chars=20_000)
    out = tmp_path / "out"
    argv = ["compare", "--model", str(work / "tiny"), "--data", str(work / "sample.txt"), "--output-dir", str(out), "--block-size", "16",
            "--max-examples", "48", "--max-steps", "2", "--learning-rates", "3e-3", "--n-bootstrap", "50", "--no-progress",
            "--growth", "top:1", "--controls", "layers", "--retention-data", "none", "--report-to", "tensorboard"]
    assert main(argv) == 0, capsys.readouterr().err
    runs = sorted(p.name for p in (out / "logs").iterdir())
    assert runs == ["compare-seed0", "layers-lr0.003-seed0", "top:1-lr0.003-seed0"]
    assert "compare/top:1/delta_vs_original" in scalars(out / "logs" / "compare-seed0")
    assert json.loads((out / "compare.json").read_text())["config"]["logging_dir"] == "logs"  # not the staged folder's path
    assert str(tmp_path) not in (out / "compare.json").read_text()


# --------------------------------------------------------------------------- W&B, offline, only where installed


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = grow_depth(tiny_llama(), [2])
    train(model, lm_rows(8), config=quick(tmp_path, max_steps=2, eval_steps=0, report_to="wandb", logging_dir=str(tmp_path / "logs")))
    assert list((tmp_path / "logs" / "wandb").glob("offline-run-*/*.wandb"))


def test_start_tracking_refuses_tensorboard_without_a_folder():
    from hf_depthgrow.training.tracking import make_accelerator

    with pytest.raises(ValueError, match="logging_dir is not set"):
        start_tracking(make_accelerator(), "tensorboard", logging_dir=None)


def test_a_trainer_after_a_bf16_trainer_trains_in_its_own_precision(tmp_path):
    """Accelerate's state is a process singleton: before, a run with `mixed_precision=None` after a bf16 run
    trained under the bf16 autocast the first one left (and an explicit "no" raised). Each run gets its own."""

    def trained(precision, seed=0):
        model = grow_depth(tiny_llama(seed), positions=[1])
        train(model, lm_rows(8), config=quick(tmp_path, mixed_precision=precision, eval_steps=0))
        return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])

    fp32 = trained(None)
    half = trained("bf16")
    after = trained(None)
    assert not torch.equal(half, fp32)  # the bf16 run really differs, so equality below means something
    assert torch.equal(after, fp32)
    assert torch.equal(trained("no"), fp32)  # an explicit precision after a bf16 run no longer raises
