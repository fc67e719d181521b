"""A trial spans processes (--workers-per-trial N, a Ray Train TorchTrainer of N gloo workers)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_depthgrow.comparison import build_arms, ray_engine
from hf_depthgrow.comparison.runner import example_losses
from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, run_trial
from hf_depthgrow.testing import fsdp2_cpu_config, tiny_inputs, tiny_model
from ray_kill import kill_after_second_checkpoint

# Two workers each take half of every global batch; DDP all-reduces the halves' gradients (the trainer scales
# each half's token sum by world / global weight), which is the full batch's mean gradient up to float
# reassociation (a sum of two partial sums, then a mean). Across the steps of a trial that reassociation
# moves fp32 losses by ~1e-7 relative here; 1e-4 leaves room, and is 100 times below what training moved the
# test losses (up to 0.05 nats of ~4.9); workers that each trained alone on their half (what Accelerate did
# before the workers got ACCELERATE_USE_CPU) ended 0.023 nats away, and would not pass.
RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The in-process trial runs as a Ray worker does: one torch thread, and no Accelerate state an earlier test left
    (AcceleratorState is a process singleton; see tests/test_ray_engine.py)."""
    import torch
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    AcceleratorState._reset_state(reset_partial_state=True)



def lm_rows(model, n: int, seed: int, seq: int = 12) -> list[dict]:
    batch = tiny_inputs(model, batch=n, seq=seq, seed=seed)
    batch["labels"] = batch["input_ids"].clone()
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def trial_setup(train: int, test: int):
    """A tiny Llama, its original test losses, and a maker of fresh `TrialInputs` (a trial fills `original` in)."""
    base = tiny_model("llama")
    rows = {"train": lm_rows(base, train, 0), "heldout": lm_rows(base, 8, 1), "test": lm_rows(base, test, 2)}
    original = {"test": example_losses(base, rows["test"], 4), "heldout": 4.0}

    def inputs():
        return TrialInputs(base=base, train_rows=rows["train"], eval_rows=rows["heldout"], test_rows=rows["test"], retention_rows=None,
                           batch_size=4, selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original=dict(original))

    return base, original, inputs


@pytest.mark.ray
def test_a_two_worker_trial_equals_the_one_process_trial_and_a_killed_one_resumes_identical(local_ray, tmp_path):
    """A 2-worker trial equals the one-process trial (up to DDP's reassociation). Then a worker of the same trial is
    SIGKILLed after its second checkpoint: the trial fails, Tune runs it again from that checkpoint on both workers,
    and it ends bit for bit as the uninterrupted 2-worker trial."""
    import threading

    pytest.importorskip("ray.train.torch")
    base, original, inputs = trial_setup(train=24, test=12)
    # Three budgets (a branched decay) and a rung: every piece of the trial runs under DDP. Checkpoints follow the
    # rung and each branch. The killer sees the second checkpoint only once the Tune trial has persisted it while the
    # workers train on: 40 steps after it (under a second on 2 cores) were sometimes all done before the kill.
    budgets = (4, 8, 400)
    spec = TrialSpec(build_arms(base, ["at:2"], [])[1], 1e-2, 0, budgets, warmup_steps=1, scheduler="wsd", rungs=(2,))
    one = run_trial(spec, inputs())
    (want,) = ray_engine.run_ray([spec], inputs(), workers_per_trial=2, max_failures=0)
    assert sorted(want.scores) == list(budgets) and [s for s, _ in want.heldout_curve] == [s for s, _ in one.heldout_curve]
    np.testing.assert_allclose([v for _, v in want.heldout_curve], [v for _, v in one.heldout_curve], rtol=RTOL)
    for b in budgets:
        assert want.scores[b].selected == one.scores[b].selected == "new"
        assert want.scores[b].units_seen == one.scores[b].units_seen
        np.testing.assert_allclose(want.scores[b].test, one.scores[b].test, rtol=RTOL)
    # The trained model moved well past the tolerance: the equality above is not the untrained model's.
    assert np.abs(want.scores[8].test - original["test"][0]).max() > 20 * RTOL * np.abs(original["test"][0]).max()

    killed, storage = [], tmp_path / "tune"
    killer = threading.Thread(target=kill_after_second_checkpoint, args=(storage, killed), kwargs={"title": "RayTrainWorker"})
    killer.start()
    with pytest.warns(UserWarning, match=r"trial at:2@lr0\.01@seed0 failed \(1 time\(s\)\): Ray runs it again from its checkpoint at step \d+"):
        (got,) = ray_engine.run_ray([spec], inputs(), workers_per_trial=2, storage=str(storage))
    killer.join()
    assert killed and got.heldout_curve == want.heldout_curve and sorted(got.scores) == list(budgets)
    for budget in want.scores:
        assert got.scores[budget].units_seen == want.scores[budget].units_seen
        np.testing.assert_array_equal(got.scores[budget].test, want.scores[budget].test)
    with pytest.raises(ValueError, match=r"2 workers per trial with 2 CPU each need 4 CPU, but the Ray cluster has 2"):
        ray_engine.run_ray([spec], inputs(), workers_per_trial=2, resources_per_trial=2)


@pytest.mark.ray
def test_a_two_worker_fsdp2_trial_equals_the_one_process_trial(local_ray, tmp_path):
    """--accelerate-config: the workers shard the model with FSDP2 (a worker that ran anything else fails the trial:
    accelerate 1.16 runs DDP for an FSDP plugin on CPU unless the package's FSDP2 path takes over), same numbers."""
    pytest.importorskip("ray.train.torch")
    base, original, inputs = trial_setup(train=16, test=8)

    config = fsdp2_cpu_config(tmp_path)  # recipes/accelerate_configs/fsdp.yaml in full precision
    spec = TrialSpec(build_arms(base, ["at:2"], [])[1], 1e-2, 0, (3, 6), warmup_steps=1, scheduler="wsd")
    want = run_trial(spec, inputs())
    (got,) = ray_engine.run_ray([spec], inputs(), workers_per_trial=2, max_failures=0, accelerate_config=str(config))
    for b in (3, 6):
        assert got.scores[b].selected == want.scores[b].selected == "new"
        np.testing.assert_allclose(got.scores[b].test, want.scores[b].test, rtol=RTOL)
    assert np.abs(got.scores[6].test - original["test"][0]).max() > 20 * RTOL * np.abs(original["test"][0]).max()


def test_accelerate_config_is_read_by_accelerates_launcher_and_checked_before_any_work(tmp_path):
    from hf_depthgrow.comparison import CompareConfig
    from hf_depthgrow.comparison.ray_workers import launch_env

    env = launch_env("recipes/accelerate_configs/fsdp.yaml", 2)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2" and env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS"} & set(env)  # Ray Train's to set
    zero2 = launch_env("recipes/accelerate_configs/deepspeed/zero2.yaml", 2)
    assert zero2["ACCELERATE_USE_DEEPSPEED"] == "true" and zero2["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert "ACCELERATE_USE_FSDP" not in launch_env("recipes/accelerate_configs/multi_gpu.yaml", 2)  # DDP: nothing to shard
    with pytest.raises(ValueError, match=r"single_gpu.yaml: not a multi-process accelerate config \(it sets up a single process"):
        launch_env("recipes/accelerate_configs/single_gpu.yaml", 2)
    with pytest.raises(ValueError, match=r"accelerate_config .*nope.yaml: no such file"):
        launch_env(str(tmp_path / "nope.yaml"), 2)
    if not ray_engine.ray_available():
        return
    fsdp = "recipes/accelerate_configs/fsdp.yaml"
    for kw, message in ((dict(accelerate_config=fsdp), "needs workers_per_trial >= 2, got 1"),
                        (dict(accelerate_config=fsdp, workers_per_trial=2, controls=["layers", "lora:8"]),
                         r"shards the model, and the trainer trains LoRA \(lora:8\) only unsharded")):
        with pytest.raises(ValueError, match=message):
            CompareConfig(engine="ray", **kw)
    CompareConfig(engine="ray", workers_per_trial=2, accelerate_config="recipes/accelerate_configs/multi_gpu.yaml", controls=["lora"])


def test_workers_per_trial_is_checked_before_any_work():
    from hf_depthgrow.comparison import CompareConfig

    for kw, message in ((dict(workers_per_trial=0), "workers_per_trial must be an int >= 1, got 0"),
                        (dict(workers_per_trial=1.5), "workers_per_trial must be an int >= 1, got 1.5"),
                        (dict(workers_per_trial=2), "workers_per_trial 2 needs engine 'ray' .* but engine is 'serial'"),
                        (dict(workers_per_trial=3, engine="ray", batch_size=8), "batch_size 8 does not split over 3 workers")):
        if kw.get("engine") == "ray" and not ray_engine.ray_available():
            continue
        with pytest.raises(ValueError, match=message):
            CompareConfig(**kw)


def test_cli_workers_per_trial_with_the_serial_engine_is_one_line_and_writes_nothing(tmp_path, capsys):
    from hf_depthgrow.cli import main

    out = tmp_path / "out"
    assert main(["compare", "--workers-per-trial", "2", "--output-dir", str(out), "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hf-depthgrow compare: --workers-per-trial 2 needs engine 'ray' (a trial spans processes as a Ray Train "
                   "TorchTrainer), but engine is 'serial'")
    assert not out.exists()
