"""Branch a decay off a running warmup-stable-decay run, then carry on as if it never happened.

A budget sweep trains each arm and learning rate once, on the schedule of its largest budget, and at the
end of a smaller budget's stable phase saves a `BranchPoint` (trainable weights, optimizer and scheduler
state, RNG, counters), decays for that budget (`retarget`), scores the result, and restores the point.
Everything a step reads is in the point, and the data order is indexed by the step, so the branch is the
standalone WSD run of that budget (bit for bit on CPU in fp32: `tests/test_budget_sweep.py`) and the trunk
continues exactly as if it had not branched.

FSDP2 runs branch too (each rank saves and restores its own shards); DeepSpeed runs are refused: their optimizer
state lives in the engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .schedules import wsd_lambdas


@dataclass
class BranchPoint:
    """What a trainer needs to continue from `step` as if nothing happened after it."""

    step: int
    weights: list[torch.Tensor]
    optimizer: dict
    scheduler: dict
    lambdas: list
    rng: torch.Tensor
    units_seen: int
    history: int
    eval_history: int
    stopped: bool = False
    nonfinite: object = None


def _check(trainer) -> None:
    # FSDP2 keeps each parameter and its optimizer moments as DTensors of this rank's shard, which clone, copy and
    # load like tensors (every rank saves and restores its own shard); DeepSpeed keeps them inside its engine.
    if getattr(trainer, "deepspeed", False):
        raise NotImplementedError("branching a decay needs the optimizer state outside DeepSpeed's engine: run budget sweeps "
                                  "with DDP, FSDP2 or one process")
    if trainer.config.lr_scheduler != "wsd":
        raise ValueError(f"a decay branches only off a warmup-stable-decay run (lr_scheduler='wsd'), not {trainer.config.lr_scheduler!r}")


@torch.no_grad()
def save_branch_point(trainer) -> BranchPoint:
    """The trainer's state after its last step (`trainer.begin()` must have run)."""
    _check(trainer)
    return BranchPoint(
        step=trainer._step, weights=[p.detach().clone() for _, p in trainer.trainable_named],
        optimizer=copy.deepcopy(trainer.optimizer.state_dict()), scheduler=copy.deepcopy(trainer.scheduler.state_dict()),
        lambdas=list(trainer.scheduler.lr_lambdas), rng=torch.get_rng_state(), units_seen=trainer.units_seen,
        history=len(trainer.history), eval_history=len(trainer.eval_history), stopped=trainer.stopped, nonfinite=trainer.nonfinite,
    )


def retarget(trainer, total: int) -> None:
    """From the next step on, follow the WSD schedule of a run of `total` steps (same warm-up and peak).

    Called at the end of that run's stable phase, where both schedules are at the peak rate.
    """
    _check(trainer)
    if total > trainer.total_steps:
        raise ValueError(f"a branch of {total} steps is longer than the run ({trainer.total_steps} steps)")
    count = len(trainer.scheduler.lr_lambdas)
    trainer.scheduler.lr_lambdas = wsd_lambdas(count, warmup=trainer.warmup, total=total, decay_ratio=trainer.config.decay_ratio)


@torch.no_grad()
def restore_branch_point(trainer, point: BranchPoint) -> None:
    """Put the trainer back to `point` (weights, optimizer, schedule, RNG, counters, histories)."""
    for (_, p), saved in zip(trainer.trainable_named, point.weights):
        p.copy_(saved)
    trainer.optimizer.load_state_dict(copy.deepcopy(point.optimizer))
    trainer.scheduler.load_state_dict(copy.deepcopy(point.scheduler))
    trainer.scheduler.lr_lambdas = list(point.lambdas)
    torch.set_rng_state(point.rng)
    trainer.units_seen = point.units_seen
    del trainer.history[point.history :], trainer.eval_history[point.eval_history :]
    # A branch that diverged does not stop the trunk; a trunk that had diverged stays stopped.
    trainer._step, trainer.stopped, trainer.nonfinite = point.step, point.stopped, point.nonfinite
