"""Bad inputs and faults for `train` / `TrainConfig`: each one clear error, before anything is lost or written.

Every case asserts the exact error class and message, that nothing outside `tmp_path` changed, and
that no final model was written. Tiny models, CPU, offline.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.testing import model_output, tiny_inputs, tiny_model
from hf_depthgrow.training.checkpoints import list_checkpoints
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.guards import (
    LOCK_NAME,
    CheckpointMismatchError,
    NonFiniteTrainingLossError,
    OutputDirLockedError,
    OutputLock,
)
from hf_depthgrow.training.selection import pick
from hf_depthgrow.training.trainer import train

REPO = Path(__file__).resolve().parents[1]


def lm_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (n, 12), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def quick(**kw) -> TrainConfig:
    base = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, progress_bar=False, fallback=False)
    return TrainConfig(**{**base, **kw})


def grown():
    return grow_depth(tiny_model("llama"), [2], block="native")


def diverging_from(model, step: int):
    """`model`, whose first new-block weight gets a NaN gradient from optimizer step `step` on: a run that diverges
    at a known step on any CPU. (A learning rate of 1e6 did it before, but whether that overflows depends on the
    CPU's kernels: on an Intel AVX-512 machine the loss saturated at a finite value instead and nothing diverged.)"""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return torch.full_like(grad, float("nan")) if calls[0] >= step else grad

    _, weight = next(iter(new_block_parameters(model)))  # (name, parameter) pairs
    weight.register_hook(hook)
    return model


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """Runs the test in tmp_path and asserts afterwards that the repository's top level did not change."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(REPO))
    yield
    assert sorted(os.listdir(REPO)) == before


def finished_run(out: Path, rows, **kw) -> dict[str, str]:
    """A finished run with checkpoints in `out`; returns the files of `out` (hashed)."""
    train(grown(), rows, config=quick(output_dir=str(out), save_steps=2, save_final_model=False, **kw))
    return tree(out)


# ----------------------------------------------------------------------------- TrainConfig


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(learning_rate=INF), "learning_rate must be a finite number > 0, got inf"),
        (dict(learning_rate=NAN), "learning_rate must be a finite number > 0, got nan"),
        (dict(learning_rate=True), "learning_rate must be a finite number > 0, got True"),
        (dict(learning_rate=-1e-3), "learning_rate must be a finite number > 0, got -0.001"),
        (dict(weight_decay=INF), "weight_decay must be a finite number >= 0, got inf"),
        (dict(max_grad_norm=NAN), "max_grad_norm must be None or a finite number >= 0, got nan"),
        (dict(num_train_epochs=INF), "num_train_epochs must be a finite number > 0, got inf"),
        (dict(adam_beta1=True), "adam_beta1 must be a number in [0, 1), got True"),
        (dict(adam_epsilon=NAN), "adam_epsilon must be a finite number > 0, got nan"),
        (dict(warmup_ratio=NAN), "warmup_ratio must be a number in [0, 1), got nan"),
        (dict(lora_dropout=INF), "lora_dropout must be a number in [0, 1), got inf"),
        (dict(seed=-1), "seed must be an int >= 0, got -1"),
        (dict(seed=True), "seed must be an int >= 0, got True"),
        (dict(per_device_train_batch_size=2.0), "per_device_train_batch_size must be an int >= 1, got 2.0"),
        (dict(max_steps=False), "max_steps must be -1 or >= 1, got False"),
        (dict(fallback="false"), "fallback must be True or False, got 'false'"),
        (dict(progress_bar=1), "progress_bar must be True or False, got 1"),
        (dict(trainable="adapter"), "trainable must be one of ('new', 'new+lora', 'full', 'layers', 'lora'), got 'adapter'"),
        (dict(trainable="layers"), "trainable='layers' needs trainable_layers, a non-empty list of distinct layer indices >= 0, got None"),
        (dict(trainable="new", trainable_layers=[1]), "trainable_layers is only used with trainable='layers' (trainable='new')"),
        (dict(trainable="lora", prefix_cache="memory"), "prefix_cache needs a frozen prefix, but trainable='lora' adapts every layer; use prefix_cache='auto' or 'off'."),
        (dict(save_steps=5), "save_steps > 0 needs output_dir (checkpoints are written there)"),
    ],
)
def test_config_refuses(bad, message, outside):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TrainConfig(**bad)


# ----------------------------------------------------------------------------- another run's checkpoints (#3, #6)


def test_resume_from_a_foreign_checkpoint_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    before = finished_run(out, lm_rows(16, seed=1))
    with pytest.raises(CheckpointMismatchError) as err:
        train(grown(), lm_rows(20), config=quick(output_dir=str(out), save_steps=2, resume_from_checkpoint="latest"))
    message = str(err.value)
    assert message.startswith(f"cannot resume from {out / 'checkpoint-4'}: it was written by a different run: the training data differs (checkpoint: 16 rows")
    assert "this run: 20 rows" in message and message.endswith(
        "Resume with the settings it was written with, or use a fresh output_dir, or delete the old checkpoints "
        "yourself (hf_depthgrow never deletes what another run wrote)."
    )
    assert tree(out) == before  # nothing deleted, nothing written, no model


def test_resume_from_another_model_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    before = finished_run(out, lm_rows(16))
    other = grow_depth(tiny_model("llama"), [1], block="native")
    with pytest.raises(CheckpointMismatchError, match=r"different run: the model differs \(architecture, growth or parameter shapes\)\. "):
        train(other, lm_rows(16), config=quick(output_dir=str(out), resume_from_checkpoint="latest"))
    assert tree(out) == before


def test_fresh_run_beside_foreign_checkpoints_is_refused_and_prunes_nothing(tmp_path, outside):
    out = tmp_path / "out"
    before = finished_run(out, lm_rows(16, seed=1))
    with pytest.raises(CheckpointMismatchError) as err:
        train(grown(), lm_rows(16), config=quick(output_dir=str(out), save_steps=1, save_total_limit=1))
    assert str(err.value) == (
        f"{out} holds checkpoints of a different run (checkpoint-2, checkpoint-4); writing this run's checkpoints "
        "beside them would mix the two runs on resume: use a fresh output_dir, or delete the old checkpoints "
        "yourself (hf_depthgrow never deletes what another run wrote)."
    )
    assert tree(out) == before


def test_checkpoint_without_fingerprint_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    finished_run(out, lm_rows(16))
    state_file = out / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["fingerprint"]  # as an older version wrote it
    state_file.write_text(json.dumps(state))
    before = tree(out)
    with pytest.raises(CheckpointMismatchError, match=r"different run: the checkpoint has no run fingerprint \(written by another tool or an older version\)\."):
        train(grown(), lm_rows(16), config=quick(output_dir=str(out), resume_from_checkpoint="latest"))
    assert tree(out) == before


def test_resume_with_a_changed_learning_rate_or_seed_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    before = finished_run(out, lm_rows(16))
    with pytest.raises(CheckpointMismatchError) as err:
        train(grown(), lm_rows(16), config=quick(output_dir=str(out), learning_rate=2e-2, seed=3, resume_from_checkpoint="latest"))
    assert "different run: learning_rate: checkpoint 0.01, this run 0.02; seed: checkpoint 0, this run 3. " in str(err.value)
    assert tree(out) == before


def test_resume_may_change_logging_and_saving(tmp_path, outside):
    out = tmp_path / "out"
    finished_run(out, lm_rows(16), max_steps=6, stop_after_step=None)
    # Same run, other logging/saving settings: accepted (nothing to do after the last step but finish).
    result = train(grown(), lm_rows(16), config=quick(max_steps=6, output_dir=str(out), save_steps=3, logging_steps=2,
                                                     save_final_model=False, resume_from_checkpoint="latest"))
    assert result.resumed_from == str(out / "checkpoint-6")


# ----------------------------------------------------------------------------- non-finite losses


def test_diverging_run_stops_with_an_error_and_writes_no_model(tmp_path, outside):
    out = tmp_path / "out"
    with pytest.raises(NonFiniteTrainingLossError) as err:
        train(diverging_from(grown(), 4), lm_rows(16), config=quick(max_steps=8, max_grad_norm=None, output_dir=str(out), save_steps=1))
    assert re.fullmatch(r"training diverged: (the loss at step \d+ is (nan|inf)|trainable weights are non-finite after step \d+ \(.+\))", str(err.value))
    assert err.value.step in (4, 5)  # the weights are NaN after step 4: caught then or at step 5's loss
    assert not (out / "model").exists() and not (out / "train_result.json").exists()
    assert not (out / LOCK_NAME).exists()  # released on the error
    assert list_checkpoints(out)  # the steps before the divergence were saved
    for ckpt in list_checkpoints(out):  # what is on disk is finite
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "trainable.safetensors")).values())
        assert int(ckpt.name.split("-")[1]) < err.value.step


def test_diverging_run_with_fallback_never_selects_the_diverged_model(tmp_path, outside):
    out = tmp_path / "out"
    model = diverging_from(grown(), 4)
    inputs = tiny_inputs(model)
    expected = model_output(model, inputs)
    with pytest.warns(UserWarning, match=r"training diverged: .*; training stops here and the fallback rule selects among the other candidates"):
        result = train(model, lm_rows(16), config=quick(max_steps=8, max_grad_norm=None, fallback=True, output_dir=str(out)))
    assert result.selected == "old" and result.nonfinite is not None
    assert result.global_step == result.nonfinite["step"]
    torch.testing.assert_close(model_output(result.model, inputs), expected, rtol=0, atol=1e-6)
    saved = json.loads((out / "train_result.json").read_text())
    assert saved["selected"] == "old" and saved["nonfinite"]["step"] == result.nonfinite["step"]


def test_fallback_refuses_when_every_candidate_is_nonfinite():
    with pytest.raises(NonFiniteTrainingLossError, match=r"^the fallback rule has no candidate with a finite training loss .*nothing safe to select$"):
        pick({"new": math.nan, "old": math.inf})
    with pytest.raises(NonFiniteTrainingLossError):
        pick({"new": 1.0, "old": math.nan}, exclude=("new",))
    assert pick({"new": math.nan, "old": 2.0}) == ("old", "old", pytest.approx(math.nan, nan_ok=True))


# ----------------------------------------------------------------------------- one run per output_dir


def test_second_concurrent_run_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    out.mkdir()
    # A live process on this host holds the lock.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "started": 0}))
        before = tree(out)
        with pytest.raises(OutputDirLockedError) as err:
            train(grown(), lm_rows(16), config=quick(output_dir=str(out), save_steps=1))
        assert str(err.value) == (
            f"{out} is in use by another hf_depthgrow run (pid {holder.pid} on {socket.gethostname()}): two runs writing "
            "one output_dir would overwrite each other's checkpoints and model. Wait for it to finish or use another "
            f"output_dir; if that run is gone, delete {out / LOCK_NAME}."
        )
        assert tree(out) == before  # the other run's lock is kept, nothing written
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path, outside):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    with pytest.warns(UserWarning, match="taking over the stale lock"):
        result = train(grown(), lm_rows(16), config=quick(output_dir=str(out)))
    assert result.model_path == str(out / "model")
    assert not (out / LOCK_NAME).exists()


def test_lock_is_exclusive_within_one_process(tmp_path):
    first = OutputLock(tmp_path).acquire()
    try:
        with pytest.raises(OutputDirLockedError):
            OutputLock(tmp_path).acquire()
    finally:
        first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    OutputLock(tmp_path).acquire().release()


def test_pruning_never_deletes_checkpoints_of_another_run(tmp_path, outside):
    from accelerate import Accelerator

    from hf_depthgrow.training.checkpoints import save_checkpoint

    foreign = tmp_path / "checkpoint-1"  # another run's (no fingerprint), e.g. written by an older version
    foreign.mkdir()
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    before = tree(foreign)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for step in (2, 3):
        save_checkpoint(Accelerator(cpu=True), tmp_path, step, sharded=False, named=[("w", weight)], optimizer=optimizer,
                        scheduler=scheduler, trainer_state={"global_step": step, "fingerprint": {"run": "a"}}, save_total_limit=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3"]
    assert tree(foreign) == before


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_training(tmp_path):
    # Before: token ids beyond the embedding gave a raw IndexError inside the trainer.
    from hf_depthgrow import grow_depth, train
    from hf_depthgrow.testing import tiny_model

    model = tiny_model("llama")
    grow_depth(model, [2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.full((4, 8), vocab + 5, dtype=torch.long)
    with pytest.raises(ValueError, match="the tokenizer does not match the model"):
        train(model, {"input_ids": ids, "labels": ids}, max_steps=1, output_dir=str(tmp_path / "out"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "out" / "model").exists()
