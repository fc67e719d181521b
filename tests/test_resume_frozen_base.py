"""A checkpoint holds the trainable set only: a resume on another frozen base is refused, not trained on.

A grown run's checkpoints (unsharded, and the DeepSpeed engine's) hold the new blocks, the optimizer
and the schedule; the frozen base of a resumed run is the starting model's (under FSDP the sharded
checkpoint holds every weight too: tests/test_distributed.py). A base of the same architecture with
other weights (another seed, a fine-tune, a revision) used to pass the run fingerprint, which saw only
names, shapes and dtypes, and the resumed run paired the checkpoint's trained blocks with a base they
were never trained on. Tiny models, CPU, offline, one process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.checkpoints import CheckpointMismatchError
from hf_depthgrow.training.trainer import GrownTrainer, train


def lm_rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 128, (n, 12), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def config(out: Path, **kw) -> TrainConfig:
    base = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, progress_bar=False,
                fallback=False, output_dir=str(out), save_steps=2, save_final_model=False)
    return TrainConfig(**{**base, **kw})


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def abandoned_after_step_3(model, out: Path) -> None:
    """A run given up after step 3 (checkpoint-2 on disk, no final save), as a crash after that step leaves it."""
    trainer = GrownTrainer(model, config(out), lm_rows(16))
    trainer.begin()
    trainer.run_steps(3)
    trainer.close()


def fine_tuned_base():
    """The same tiny Llama with one frozen matrix nudged by 0.1%: what a further fine-tune of the base looks like to the run."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.001)
    return model


@pytest.mark.parametrize("other_base", [lambda: tiny_model("llama", seed=1), fine_tuned_base], ids=["other-seed", "fine-tuned"])
def test_resume_on_another_base_is_refused(tmp_path, other_base):
    out = tmp_path / "out"
    abandoned_after_step_3(grow_depth(tiny_model("llama"), [2]), out)
    before = tree(out)
    with pytest.raises(CheckpointMismatchError) as err:
        train(grow_depth(other_base(), [2]), lm_rows(16), config=config(out, resume_from_checkpoint="latest"))
    message = str(err.value)
    assert message.startswith(f"cannot resume from {out / 'checkpoint-2'}: it was written by a different run: the starting model's weights differ")
    assert "\n" not in message
    assert tree(out) == before  # nothing written, nothing deleted


def test_resume_on_the_same_base_matches_an_uninterrupted_run(tmp_path):
    """The check does not refuse the base the run started from (a fresh copy of it, grown again)."""
    straight = train(grow_depth(tiny_model("llama"), [2]), lm_rows(16), config=config(tmp_path / "a"))
    abandoned_after_step_3(grow_depth(tiny_model("llama"), [2]), tmp_path / "b")
    resumed = train(grow_depth(tiny_model("llama"), [2]), lm_rows(16), config=config(tmp_path / "b", resume_from_checkpoint="latest"))
    assert resumed.resumed_from == str(tmp_path / "b" / "checkpoint-2")
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_without_the_base_hash_is_refused_as_an_older_versions(tmp_path):
    out = tmp_path / "out"
    abandoned_after_step_3(grow_depth(tiny_model("llama"), [2]), out)
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["fingerprint"]["base"]  # as a version without the check wrote it
    state_file.write_text(json.dumps(state))
    before = tree(out)
    with pytest.raises(CheckpointMismatchError, match=r"different run: the checkpoint records no hash of its base's weights \(written by an older version\)"):
        train(grow_depth(tiny_model("llama"), [2]), lm_rows(16), config=config(out, resume_from_checkpoint="latest"))
    assert tree(out) == before
