"""Trials on Ray Tune give the serial result exactly; --gather rebuilds it from stored trials; bad Ray settings are one line."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from hf_depthgrow.comparison import CompareConfig, compare_plans
from hf_depthgrow.comparison import ray_engine
from hf_depthgrow.testing import tiny_inputs, tiny_model
from ray_kill import kill_after_second_checkpoint


def lm_rows(model, n: int, seed: int, seq: int = 12) -> list[dict]:
    batch = tiny_inputs(model, batch=n, seq=seq, seed=seed)
    batch["labels"] = batch["input_ids"].clone()
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Serial runs here start from what a Ray trial's fresh process has: the one torch thread it gets
    (resources_per_trial=1; a reduction over another thread count rounds differently) and no Accelerate state
    left by an earlier test (AcceleratorState is a process singleton: a bf16 run before this module made the
    serial trials here run under bf16 autocast, 1e-4 away from the Ray trials, in the full suite only)."""
    import torch
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: lm_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 12, 2), ("ret", 10, 3))}
    return model, rows


SETTINGS = dict(growth=["at:2"], controls=["layers"], learning_rates=[1e-3, 1e-2], lr_extensions=0, forgetting_rates=0, budgets=[4, 8],
                warmup_steps=1, batch_size=4, selection_max_examples=None, n_bootstrap=200, progress=False,
                allow_repeated_data=True)


def _run(setting, **kw):
    model, rows = setting
    return compare_plans(model, rows["train"], rows["eval"], rows["test"], retention_data=rows["ret"], **{**SETTINGS, **kw})


def assert_same(a, b):
    """The same comparison: every number of every budget, and every per-example loss bit for bit."""
    assert a.to_dict()["budgets"] == b.to_dict()["budgets"]
    assert a.grids == b.grids
    for va, vb in zip(a.views, b.views, strict=True):
        for x, y in zip(va.arms, vb.arms, strict=True):
            assert x.name == y.name and x.learning_rate == y.learning_rate
            np.testing.assert_array_equal(x.test_per_example, y.test_per_example)
            np.testing.assert_array_equal(x.retention_per_example, y.retention_per_example)


@pytest.fixture(scope="module")
def serial(setting):
    return _run(setting)


@pytest.mark.ray
def test_two_concurrent_ray_trials_give_exactly_the_serial_result_and_gather_rebuilds_it(local_ray, setting, serial, tmp_path, monkeypatch):
    trials = tmp_path / "trials"
    on_ray = _run(setting, engine="ray", max_concurrent_trials=2, trials_dir=trials)
    assert_same(on_ray, serial)
    # Gathered from the store: nothing trains (a trial run would fail here), the same result.
    monkeypatch.setattr("hf_depthgrow.comparison.trial.trial_steps", None)
    assert_same(_run(setting, engine="stored", trials_dir=trials), serial)
    with pytest.raises(ValueError, match=r"2 of 4 trials are not stored in .*: at:2@lr0\.003@seed0, layers@lr0\.003@seed0"):
        _run(setting, engine="stored", trials_dir=trials, learning_rates=[1e-3, 3e-3])


@pytest.mark.ray
def test_a_stored_trial_is_not_run_again_on_ray(local_ray, setting, serial, tmp_path, monkeypatch):
    trials = tmp_path / "trials"
    _run(setting, trials_dir=trials)  # serial, stored
    ran, real = [], ray_engine._tune
    monkeypatch.setattr(ray_engine, "_tune", lambda specs, *a: ran.extend(s.name for s in specs) or real(specs, *a))
    assert_same(_run(setting, engine="ray", trials_dir=trials), serial)
    assert ran == []


@pytest.mark.ray
def test_impossible_resources_and_halving_are_refused_under_ray(local_ray, setting):
    with pytest.raises(ValueError, match="asks 3 CPU per trial, but the Ray cluster has 2"):
        _run(setting, engine="ray", resources_per_trial=3)
    with pytest.raises(ValueError, match="asks 1 GPU per trial, but the Ray cluster has 0"):
        ray_engine.run_ray([SimpleNamespace(name="t")], None, resources_per_trial={"cpu": 1, "gpu": 1})
    with pytest.raises(ValueError, match="successive_halving runs on the serial engine only"):
        _run(setting, engine="ray", successive_halving=True, budgets=None, max_steps=8)


@pytest.mark.ray
def test_a_killed_trial_resumes_from_its_checkpoint_and_ends_identical(local_ray, setting, tmp_path, caplog):
    """Trial 0 is SIGKILLed after its second checkpoint: Tune retries it from its checkpoint. Trial 1 continues from the
    checkpoint a trial store holds (`--resume` after the driver died). Both end bit for bit as the uninterrupted trials."""
    import logging
    import threading

    from hf_depthgrow.comparison import build_arms
    from hf_depthgrow.comparison.runner import example_losses
    from hf_depthgrow.comparison.store import TrialStore
    from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, run_trial

    base, rows = setting
    original = {"test": example_losses(base, rows["test"], 4), "heldout": 4.0}
    inputs = lambda: TrialInputs(base=base, train_rows=rows["train"], eval_rows=rows["eval"], test_rows=rows["test"], retention_rows=None,  # noqa: E731
                                 batch_size=4, selection_max_examples=None, lora_target_modules=None, grow_kwargs=None,
                                 original=dict(original))
    arm = build_arms(base, ["at:2"], [])[1]
    # Checkpoints after the branches of budgets 4 and 8; 58 more steps after the second leave time to kill it.
    killed_spec, resumed_spec = (TrialSpec(arm, lr, 0, budgets, warmup_steps=1, scheduler="wsd")
                                 for lr, budgets in ((3e-3, (4, 8, 64)), (1e-3, (4, 8))))
    want = run_trial(killed_spec, inputs())
    saved = []
    want_resumed = run_trial(resumed_spec, inputs(), checkpoint=saved.append)
    store = TrialStore(tmp_path / "trials", inputs(), resume=True)
    store.save_checkpoint(resumed_spec, saved[0])  # what an interrupted sweep left
    killed, storage = [], tmp_path / "tune"
    killer = threading.Thread(target=kill_after_second_checkpoint, args=(storage, killed))
    killer.start()
    with caplog.at_level(logging.INFO, logger=ray_engine.__name__):
        with pytest.warns(UserWarning, match=r"trial at:2@lr0\.003@seed0 failed \(1 time\(s\)\): Ray runs it again from its checkpoint at step \d+"):
            got, got_resumed = ray_engine.run_ray([killed_spec, resumed_spec], inputs(), max_concurrent_trials=1, storage=str(storage), store=store)
    killer.join()
    assert killed
    continued = {r.getMessage() for r in caplog.records if "continued from its checkpoint" in r.getMessage()}
    assert {m.rsplit(" ", 1)[0] for m in continued} == {f"trial {s.name} continued from its checkpoint at step" for s in (killed_spec, resumed_spec)}
    assert f"trial {resumed_spec.name} continued from its checkpoint at step {saved[0].step}" in continued
    for a, b in ((got, want), (got_resumed, want_resumed)):
        assert a.heldout_curve == b.heldout_curve and sorted(a.scores) == sorted(b.scores)
        for budget in b.scores:
            assert a.scores[budget].units_seen == b.scores[budget].units_seen
            np.testing.assert_array_equal(a.scores[budget].test, b.scores[budget].test)
    # Both stored, and their checkpoints gone with it.
    assert store.load(killed_spec) is not None and store.load(resumed_spec) is not None
    assert not any((tmp_path / "trials" / "checkpoints").iterdir())


@pytest.mark.ray
def test_a_trial_that_fails_on_ray_is_named_with_its_error(local_ray, setting):
    from hf_depthgrow.comparison import build_arms
    from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec

    base, rows = setting
    inputs = TrialInputs(base=base, train_rows=rows["train"], eval_rows=rows["eval"], test_rows=rows["test"], retention_rows=None,
                         batch_size=4, selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original={})
    bad = TrialSpec(build_arms(base, ["at:2"], [])[1], 3e-3, 0, (4, 8), scheduler="cosine")  # several budgets need wsd: raises in the trial
    with pytest.raises(RuntimeError, match=r"trial at:2@lr0\.003@seed0 failed under Ray \(0 retries\): .*needs lr_scheduler='wsd'"):
        ray_engine.run_ray([bad], inputs, max_failures=0)


def test_resume_needs_a_trials_dir_holding_something_of_this_comparison(setting, tmp_path, monkeypatch):
    (tmp_path / "trials" / "trials" / ("0" * 64)).mkdir(parents=True)  # another comparison's trial
    monkeypatch.setattr("hf_depthgrow.comparison.trial.trial_steps", None)  # nothing may train
    with pytest.raises(ValueError, match=r"resume: nothing to resume in .*: none of the 4 trials is stored or checkpointed there"):
        _run(setting, trials_dir=tmp_path / "trials", resume=True)
    with pytest.raises(ValueError, match="resume continues the trials stored in trials_dir: set trials_dir"):
        _run(setting, resume=True)


def test_engine_settings_are_checked_before_any_work(monkeypatch):
    for kw, message in ((dict(engine="spark"), "engine must be one of"), (dict(ray_address="head:6379"), "is for engine 'ray'"),
                        (dict(engine="ray", ray_address="head"), "host:port, ray://host:port or auto"),
                        (dict(max_concurrent_trials=0), "max_concurrent_trials must be an int >= 1"),
                        (dict(resources_per_trial=1.5), "resources_per_trial must be an int >= 1")):
        with pytest.raises(ValueError, match=message):
            CompareConfig(**kw)
    monkeypatch.setattr(ray_engine, "ray_available", lambda: False)
    with pytest.raises(ValueError, match=r"engine 'ray' needs Ray, which is not installed: pip install \"hf_depthgrow\[ray\]\""):
        CompareConfig(engine="ray")


def test_cli_engine_ray_without_ray_is_one_line_before_anything_loads(monkeypatch, tmp_path, capsys):
    from hf_depthgrow.cli import main

    monkeypatch.setattr(ray_engine, "ray_available", lambda: False)
    out = tmp_path / "out"
    assert main(["compare", "--engine", "ray", "--output-dir", str(out), "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'hf-depthgrow compare: engine \'ray\' needs Ray, which is not installed: pip install "hf_depthgrow[ray]"'
    assert not out.exists()


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from tiny_lm import make_tiny_lm

    return make_tiny_lm(tmp_path_factory.mktemp("ray"), max_chars=30_000)


def _argv(lm_dir, out, *extra):
    return ["compare", "--model", str(lm_dir / "tiny"), "--data", str(lm_dir / "sample.txt"), "--output-dir", str(out),
            "--block-size", "16", "--max-examples", "64", "--max-steps", "2", "--learning-rates", "3e-3", "--growth", "top:1",
            "--controls", "layers", "--retention-data", "none", "--n-bootstrap", "200", "--no-progress", *extra]


def _one_line(capsys, *fragments, only: bool = False):
    """The error is one line (the last; a refusal found once the model is loaded follows its loading bar; `only`: the
    only line), no traceback."""
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("hf-depthgrow compare: ") and "Traceback" not in err, err
    assert not only or err == last, err
    for fragment in fragments:
        assert fragment in last, err


def _never_load(monkeypatch):
    """The CLI's loader, replaced by one that fails the test: a refusal must come before the model loads."""
    monkeypatch.setattr("hf_depthgrow.cli.compare._load", lambda *a: pytest.fail("the model was loaded before the refusal"))


@pytest.mark.ray
def test_cli_refuses_an_unreachable_address_and_impossible_resources_then_runs_on_ray(local_ray, lm_dir, tmp_path, capsys, monkeypatch):
    from hf_depthgrow.cli import main

    out, trials = tmp_path / "out", tmp_path / "trials"
    with monkeypatch.context() as before_loading:
        _never_load(before_loading)
        assert main(_argv(lm_dir, out, "--engine", "ray", "--ray-address", "127.0.0.1:1", "--trials-dir", str(trials))) == 2
        _one_line(capsys, "ray_address 127.0.0.1:1: no Ray cluster reachable there", only=True)
        assert main(_argv(lm_dir, out, "--engine", "ray", "--resources-per-trial", "8", "--trials-dir", str(trials))) == 2
        _one_line(capsys, "asks 8 CPU per trial, but the Ray cluster has 2", only=True)
    assert not out.exists() and not trials.exists()
    # The same command with settings the cluster can give runs; its stdout is the report, and neither stream names
    # Tune's temporary results folder (gone when the run ends) or a TensorBoard command for it.
    assert main(_argv(lm_dir, out, "--engine", "ray", "--max-concurrent-trials", "2", "--trials-dir", str(trials))) == 0
    printed = capsys.readouterr()
    assert "Comparison at an equal budget" in printed.out and "Configuration for experiment" not in printed.out
    assert not any(s in printed.out + printed.err for s in ("View detailed results here", "tensorboard --logdir", "hf_depthgrow-ray-"))
    assert main(_argv(lm_dir, tmp_path / "gathered", "--gather", str(trials))) == 0
    ran, gathered = (json.loads((d / "compare.json").read_text()) for d in (out, tmp_path / "gathered"))
    assert gathered["budgets"] == ran["budgets"] and gathered["rows"] == ran["rows"]


def test_cli_resume_after_the_driver_is_killed_and_gather_give_the_uninterrupted_result(lm_dir, tmp_path, capsys, monkeypatch):
    """A compare (serial engine) SIGKILLed once its first trial is stored and its second has a checkpoint: `--resume`
    trains only the rest of the second trial and writes exactly the uninterrupted result; so does `--gather` of its
    trials, which names the trials it lacks."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import hf_depthgrow.comparison.engine as engine
    from hf_depthgrow.cli import main
    from hf_depthgrow.training.trainer import GrownTrainer

    # Refused before anything loads: --resume without a trials folder, with an empty one, with --gather.
    with monkeypatch.context() as before_loading:
        _never_load(before_loading)
        for extra, message in ((("--resume",), "add --trials-dir DIR"), (("--resume", "--trials-dir", str(tmp_path / "none")), "nothing to resume in"),
                               (("--resume", "--gather", str(tmp_path)), "drop one of --resume and --gather")):
            assert main(_argv(lm_dir, tmp_path / "refused", *extra)) == 2
            _one_line(capsys, message, only=True)
    assert not (tmp_path / "refused").exists() and not (tmp_path / "none").exists()

    trials = tmp_path / "trials"
    # 16 steps: checkpoints at the rungs 4 and 8, the kill lands with 8 or more steps of the second trial to go.
    argv = lambda out, *extra: _argv(lm_dir, out, "--max-steps", "16", "--allow-repeated-data", *extra)  # noqa: E731
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    driver = subprocess.Popen([sys.executable, "-c", "import sys; from hf_depthgrow.cli import main; sys.exit(main(sys.argv[1:]))",
                               *argv(tmp_path / "killed", "--trials-dir", str(trials))], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while driver.poll() is None and time.monotonic() < deadline:
        stored = {p.name for p in (trials / "trials").glob("*/digest.json") for p in [p.parent]}
        if stored and any(p.parent.parent.name not in stored for p in (trials / "checkpoints").glob("*/*/digest.json")):
            os.kill(driver.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    assert driver.wait(timeout=60) == -signal.SIGKILL, driver.stderr.read().decode()[-2000:]
    assert len(stored) == 1 and not (tmp_path / "killed").exists()

    runs, steps, real_step = [], [], GrownTrainer.training_step
    monkeypatch.setattr(engine, "run_trial", lambda spec, inputs, **kw: runs.append((spec.name, kw["resume"])) or real_run(spec, inputs, **kw))
    real_run = engine.trial_steps.__globals__["run_trial"]
    monkeypatch.setattr(GrownTrainer, "training_step", lambda self, step: steps.append(step) or real_step(self, step))
    assert main(argv(tmp_path / "resumed", "--trials-dir", str(trials), "--resume")) == 0
    (name, resume), = runs
    assert name == "layers@lr0.003@seed0" and resume is not None and steps == list(range(resume.step + 1, 17)) and resume.step in (4, 8)
    monkeypatch.setattr(engine, "run_trial", real_run)
    monkeypatch.setattr(GrownTrainer, "training_step", real_step)
    assert main(argv(tmp_path / "whole")) == 0  # uninterrupted, no store
    assert main(argv(tmp_path / "gathered", "--gather", str(trials))) == 0
    whole = _timeless(json.loads((tmp_path / "whole" / "compare.json").read_text()))
    for other in ("resumed", "gathered"):
        report = _timeless(json.loads((tmp_path / other / "compare.json").read_text()))
        assert report["budgets"] == whole["budgets"] and report["rows"] == whole["rows"], other
    # The folder records its comparison: --gather rebuilds it from the folder alone, with no model or data to load.
    with monkeypatch.context() as no_model:
        _never_load(no_model)
        alone = ["--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no-data.txt")]
        assert main(argv(tmp_path / "alone", "--gather", str(trials), *alone)) == 0
    report = _timeless(json.loads((tmp_path / "alone" / "compare.json").read_text()))
    assert report["budgets"] == whole["budgets"] and report["rows"] == whole["rows"]
    capsys.readouterr()
    out = tmp_path / "other"
    assert main(argv(out, "--gather", str(trials), "--learning-rates", "1e-3")) == 2
    _one_line(capsys, "learning_rates [0.001] (recorded: [0.003]) differ from the comparison recorded there")
    (trials / "sweeps").rename(tmp_path / "sweeps-aside")  # an older store, without the record: rebuilt with the model and data
    assert main(argv(out, "--gather", str(trials), "--learning-rates", "1e-3")) == 2
    _one_line(capsys, "2 of 2 trials are not stored in", "top:1@lr0.001@seed0, layers@lr0.001@seed0")
    assert main(argv(out, "--gather", str(tmp_path / "nowhere"))) == 2
    _one_line(capsys, "is not a folder of stored trials")
    assert not out.exists()


def _timeless(report):
    """A report without its wall-clock seconds (the only numbers two runs of the same comparison may differ in)."""
    if isinstance(report, dict):
        return {k: _timeless(v) for k, v in report.items() if "seconds" not in k}
    return [_timeless(v) for v in report] if isinstance(report, list) else report


def test_a_ray_that_cannot_start_is_one_line(monkeypatch):
    """Ray raises a bare `Exception` when its node times out starting up (seen on an overloaded machine): one line."""
    import types

    from hf_depthgrow.comparison.ray_engine import _connect

    def init(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the Ray processes\nfailed")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    with pytest.raises(ValueError, match=r"^Ray could not start a local instance \(The current node timed out during startup\. [^\n]*\)$"):
        _connect(fake, None)


@pytest.mark.ray
def test_the_oracle_sweep_on_ray_equals_the_serial_one(local_ray, setting):
    """validate_probe submits every position x seed trial in one engine call: on Ray they run at once, same numbers."""
    from hf_depthgrow.comparison import validate_probe

    model, rows = setting

    def oracle(**kw):
        cfg = CompareConfig(budgets=[4], warmup_steps=1, batch_size=4, selection_max_examples=None, n_bootstrap=200,
                            progress=False, **kw)
        return validate_probe(model, rows["train"], rows["eval"], rows["test"], positions=[0, 1, 2, 3], seeds=[0],
                              learning_rate=1e-2, config=cfg, predictors=("depth",), n_permutations=100)

    serial, on_ray = oracle(), oracle(engine="ray", max_concurrent_trials=2)
    assert on_ray.realized == serial.realized and on_ray.realized_by_seed == serial.realized_by_seed
    assert on_ray.table == serial.table and len(set(serial.realized)) > 1  # the positions really differ


def test_rows_that_view_one_token_stream_ship_compact():
    """Bug: blocks cut from one stream by `view` (data.causal_lm_blocks) each pickled the whole stream into Ray's
    object store, so the regime study's 38,702 Shakespeare rows asked for ~1.5 TB and filled the machine's memory."""
    import pickle

    import torch

    from hf_depthgrow.comparison.trial import TrialInputs

    stream = torch.arange(200 * 16, dtype=torch.long).view(200, 16)
    ones = torch.ones(16, dtype=torch.long)
    rows = [{"input_ids": b, "attention_mask": ones, "labels": b} for b in stream]
    inputs = TrialInputs(base=None, train_rows=rows, eval_rows=rows[:4], test_rows=rows[4:8], retention_rows=None, batch_size=4,
                         selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original={})
    shipped = ray_engine._shippable(inputs)
    size = len(pickle.dumps(shipped.train_rows))
    assert size < 10 * stream.nbytes, size  # each row pickled the stream: 200 x 25.6 kB; now ~0.4 kB of pickling per tensor
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(shipped.train_rows, rows))
    first = shipped.train_rows[0]
    assert first["input_ids"] is first["labels"] and first["attention_mask"] is ones  # shared stays shared
    assert rows[0]["input_ids"].untyped_storage().nbytes() == stream.nbytes  # the caller's rows are not changed
    compact = [{"x": torch.zeros(3)}]
    assert ray_engine._compact(compact) is compact


def test_quiet_fit_drops_tunes_snapshot_advice_only_and_only_while_it_fits(caplog, monkeypatch):
    import logging

    from hf_depthgrow.comparison.ray_engine import quiet_fit

    snapshots = logging.getLogger("ray.tune.execution.experiment_state")

    def fit():
        # Tune's printing is off while it fits, and the environment is the caller's after.
        assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0"
        snapshots.warning("Experiment state snapshotting has been triggered multiple times in the last 5.0 seconds")
        snapshots.warning("a trial's folder could not be synced")
        logging.getLogger("ray.tune").info("Tune's own chatter")
        return "grid"

    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    with caplog.at_level(logging.INFO):
        assert quiet_fit(fit) == "grid"
        snapshots.warning("Experiment state snapshotting has been triggered after the fit")
    assert "RAY_AIR_NEW_OUTPUT" not in os.environ
    monkeypatch.setenv("RAY_AIR_NEW_OUTPUT", "1")
    quiet_fit(lambda: None)
    assert os.environ["RAY_AIR_NEW_OUTPUT"] == "1"
    assert [r.getMessage() for r in caplog.records] == ["a trial's folder could not be synced",
                                                         "Experiment state snapshotting has been triggered after the fit"]


def test_a_trial_killed_for_memory_is_one_line_saying_what_is_kept_and_what_to_change(local_ray, monkeypatch, capsys):
    from hf_depthgrow.cli.common import run_command
    from hf_depthgrow.comparison import ray_engine

    killed = ("Caught unexpected exception: 1 worker(s) were killed due to the node running low on memory. Memory on the node "
              "(IP: 192.0.2.2, ID: f3ed) was 22.38GB used / 23.54GB limit (0.950810)\nRefer to the documentation ...")

    def fit(_):
        raise RuntimeError(killed)

    monkeypatch.setattr(ray_engine, "quiet_fit", fit)
    with pytest.raises(MemoryError, match=r"1 worker\(s\) were killed .* low on memory: run fewer trials at once .* every trial that finished is kept"):
        ray_engine.tune_units(lambda unit, shipped: {}, [0], {}, {"cpu": 1}, ["u"], what="trial", keep=lambda i, m: m)

    def body(argv):
        ray_engine.tune_units(lambda unit, shipped: {}, [0], {}, {"cpu": 1}, ["u"], what="trial", keep=lambda i, m: m)

    assert run_command("compare", body, []) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-depthgrow compare: 1 worker(s) were killed") and "\n" not in err and "max_concurrent_trials" in err

    def bare(argv):
        raise MemoryError()

    with pytest.raises(MemoryError):  # the allocator's own, saying nothing, keeps its traceback
        run_command("compare", bare, [])

    monkeypatch.setattr(ray_engine, "quiet_fit", lambda _: (_ for _ in ()).throw(RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="something else"):  # any other failure keeps its traceback
        ray_engine.tune_units(lambda unit, shipped: {}, [0], {}, {"cpu": 1}, ["u"], what="trial", keep=lambda i, m: m)


def test_a_trial_process_imports_and_runs_a_trial_without_the_datasets_library():
    # A Ray trial process imports the engine and runs trials on rows; `datasets` (with pandas and pyarrow, about a
    # second of its start-up) is for loading data, which the driver does.
    import os
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "import hf_depthgrow.comparison.ray_engine\n"
            "from hf_depthgrow.comparison import build_arms\n"
            "from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, run_trial\n"
            "from hf_depthgrow.testing import tiny_model, tiny_rows\n"
            "base = tiny_model('llama')\n"
            "rows = tiny_rows(base, 8, 0)\n"
            "inputs = TrialInputs(base=base, train_rows=rows, eval_rows=rows[:4], test_rows=rows[4:], retention_rows=None, batch_size=4,\n"
            "                     selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original={})\n"
            "spec = TrialSpec(build_arms(base, ['at:1'], [])[1], 1e-3, 0, (2,), warmup_steps=0, scheduler='wsd')\n"
            "assert sorted(run_trial(spec, inputs).scores) == [2]\n"
            "assert 'datasets' not in sys.modules, 'datasets was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
