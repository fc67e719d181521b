"""A checkpoint is resumed only if it is consistent with itself: its files match the digest written at save, and
its step counts (folder name, trainer state, micro-batches, history, scheduler, optimizer) agree. Anything else is
refused with one line before a weight changes; an untouched checkpoint resumes bit-identically. Tiny models, CPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training.checkpoints import DIGEST, check_counts, write_digest
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.checkpoints import CheckpointIntegrityError, CheckpointMismatchError
from hf_depthgrow.training.trainer import train

STEPS = 6


def lm_rows(n: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (n, 12), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def config(out: Path | None, **kw) -> TrainConfig:
    base = dict(max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1,
                progress_bar=False, fallback=False, save_final_model=False, output_dir=str(out) if out else None)
    return TrainConfig(**{**base, **kw})


def grown():
    return grow_depth(tiny_model("llama", attention_dropout=0.1), [2], block="native")


def new_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in new_block_parameters(model)}


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6, and its final new-block weights."""
    out = tmp_path_factory.mktemp("run") / "out"
    result = train(grown(), lm_rows(), config=config(out, save_steps=2))
    return out, new_weights(result.model)


@pytest.fixture
def out(saved_run, tmp_path) -> Path:
    """A copy of the saved run's output folder, this test's to edit."""
    copy = tmp_path / "out"
    shutil.copytree(saved_run[0], copy)
    return copy


def edit_state(checkpoint: Path, redigest: bool = False, **changes) -> None:
    file = checkpoint / "trainer_state.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}, indent=2, sort_keys=True))
    if redigest:  # as if the digest had been rewritten too: the consistency checks must still catch it
        write_digest(checkpoint)


def refused(out: Path, checkpoint: str, match: str) -> None:
    """Resuming from `out/checkpoint` raises `CheckpointIntegrityError` matching `match`; the model and `out` are untouched."""
    model, before = grown(), tree(out)
    weights = new_weights(model)
    with pytest.raises(CheckpointIntegrityError, match=match) as err:
        train(model, lm_rows(), config=config(out, save_steps=2, resume_from_checkpoint=str(out / checkpoint)))
    assert str(err.value).startswith(f"cannot resume from {out / checkpoint}: ") and "\n" not in str(err.value)
    assert isinstance(err.value, CheckpointMismatchError)  # handled wherever a foreign checkpoint is
    assert tree(out) == before
    assert all(torch.equal(weights[n], p) for n, p in new_weights(model).items())


def test_an_untouched_checkpoint_resumes_bit_identically(saved_run, out):
    digest = json.loads((out / "checkpoint-4" / DIGEST).read_text())
    assert sorted(digest["files"]) == ["optimizer.pt", "rng_state_0.pt", "scheduler.pt", "trainable.safetensors", "trainer_state.json"]
    result = train(grown(), lm_rows(), config=config(out, save_steps=2, resume_from_checkpoint=str(out / "checkpoint-4")))
    assert result.resumed_from == str(out / "checkpoint-4")
    straight = saved_run[1]  # dropout on: the RNG streams were restored too
    assert all(torch.equal(straight[n], p) for n, p in new_weights(result.model).items())
    assert (out / "checkpoint-6" / DIGEST).is_file()  # re-saved with its digest


def test_an_edited_global_step_is_refused_by_the_cli_with_one_line(out, capsys):
    """Before: `global_step` 4 -> 100 resumed with exit 0 and reported step 100 after 4 real steps."""
    import datasets

    from hf_depthgrow.cli.train import main
    from hf_depthgrow.hub.serialization import save_pretrained

    base, data, cli_out = out.parent / "base", out.parent / "ds", out.parent / "cli"
    save_pretrained(tiny_model("llama"), base)
    rows = lm_rows()
    datasets.Dataset.from_dict({k: torch.stack([r[k] for r in rows]).numpy() for k in rows[0]}).save_to_disk(str(data))
    args = ["--model", str(base), "--positions", "2", "--dataset", str(data), "--max-steps", "6", "--save-steps", "2",
            "--no-progress", "--fallback", "false", "--output-dir", str(cli_out)]
    assert main(args) == 0
    edit_state(cli_out / "checkpoint-4", global_step=100)
    before = tree(cli_out)
    capsys.readouterr()
    assert main([*args, "--resume-from-checkpoint", str(cli_out / "checkpoint-4")]) == 2
    err = capsys.readouterr().err  # the model loads before the checkpoint is read: its progress bar comes first
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (f"hf-depthgrow train: cannot resume from {cli_out / 'checkpoint-4'}: trainer_state.json does not match its sha256 "
                   "in digest.json (edited or damaged on disk). Resume from an earlier checkpoint by its path, or start afresh "
                   "without resume_from_checkpoint.")
    assert tree(cli_out) == before


@pytest.mark.parametrize(
    "changes, match",
    [
        # With the digest rewritten as well, the trainer state must still agree with itself.
        (dict(global_step=100), "the folder is step 4, its trainer_state.json says global_step 100"),
        (dict(global_step=2, micro_batches=4, history=[], eval_history=[]), "the folder is step 4, its trainer_state.json says global_step 2"),
        (dict(micro_batches=5), "global_step 4 with 2 micro-batches a step, but micro_batches 5"),
        (dict(history=[{"step": 9, "loss": 1.0}]), "its history records step 9, after global_step 4"),
        (dict(global_step=True), "its global_step is True, not a step count >= 1"),
    ],
)
def test_a_trainer_state_that_contradicts_itself_is_refused(out, changes, match):
    edit_state(out / "checkpoint-4", redigest=True, **changes)
    refused(out, "checkpoint-4", match)


def test_a_step_beyond_max_steps_or_the_schedulers_count_is_refused(out):
    # Renamed to match: only max_steps can tell.
    (out / "checkpoint-4").rename(out / "checkpoint-100")
    edit_state(out / "checkpoint-100", redigest=True, global_step=100, micro_batches=200)
    refused(out, "checkpoint-100", "global_step 100 is beyond the run's max_steps 6")
    # Step 4's files under step 3's name and state: the scheduler's own count disagrees.
    (out / "checkpoint-100").rename(out / "checkpoint-3")
    edit_state(out / "checkpoint-3", redigest=True, global_step=3, micro_batches=6, history=[], eval_history=[])
    refused(out, "checkpoint-3", "global_step 3, but its scheduler has taken 4 steps")


def test_an_optimizer_count_that_disagrees_is_refused(out):
    checkpoint = out / "checkpoint-4"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    for per_param in state["state"].values():
        per_param["step"] = torch.tensor(5.0)
    torch.save(state, checkpoint / "optimizer.pt")
    write_digest(checkpoint)
    refused(out, "checkpoint-4", "global_step 4, but its optimizer has taken 5 steps")


def flip_a_weight_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    header = int.from_bytes(data[:8], "little")  # safetensors: 8-byte header length, JSON header, then the tensors
    data[8 + header + 5] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda c: flip_a_weight_byte(c / "trainable.safetensors"), r"trainable.safetensors does not match its sha256 in digest.json \(edited or damaged on disk\)"),
        (lambda c: (c / "rng_state_0.pt").unlink(), r"its files are not the ones digest.json lists \(rng_state_0.pt missing or added\)"),
        (lambda c: shutil.copy(c / "scheduler.pt", c / "scaler.pt"), r"its files are not the ones digest.json lists \(scaler.pt missing or added\)"),
        (lambda c: (c / DIGEST).unlink(), r"it has no digest.json \(written by an older version, or copied in part\), so its files cannot be checked"),
        (lambda c: (c / DIGEST).write_text("{"), "its digest.json cannot be read"),
    ],
)
def test_damaged_files_are_refused(out, damage, match):
    damage(out / "checkpoint-4")
    refused(out, "checkpoint-4", match)


def test_latest_that_is_damaged_is_refused_not_skipped(out):
    flip_a_weight_byte(out / "checkpoint-6" / "trainable.safetensors")
    model = grown()
    with pytest.raises(CheckpointIntegrityError, match="checkpoint-6: trainable.safetensors does not match"):
        train(model, lm_rows(), config=config(out, save_steps=2, resume_from_checkpoint="latest"))


def test_counts_under_a_grad_scaler_may_lag_the_scheduler():
    # fp16: an overflowing step is skipped by the optimizer, never by the scheduler.
    state = {"state": {0: {"step": torch.tensor(3.0)}, 1: {"step": torch.tensor(4.0)}}}
    check_counts("c", 4, scheduler_steps=4, optimizer_state=state, scaled=True)
    with pytest.raises(CheckpointIntegrityError, match="its optimizer has taken 5 steps"):
        check_counts("c", 4, scheduler_steps=4, optimizer_state={"state": {0: {"step": torch.tensor(5.0)}}}, scaled=True)
    with pytest.raises(CheckpointIntegrityError, match="its optimizer has taken 3 steps"):
        check_counts("c", 4, scheduler_steps=4, optimizer_state={"state": {0: {"step": torch.tensor(3.0)}}}, scaled=False)
