"""The trial unit of every sweep: one arm at one learning rate and seed, trained once, scored at every budget.

`run_trial(spec, inputs)` turns a `TrialSpec` into a `TrialResult`; `compare_plans` is a loop over trials
plus one aggregation (`comparison.aggregate`), so an engine that runs trials elsewhere gives the same result.

A trial trains on the warmup-stable-decay schedule of its largest budget. At the end of each smaller
budget's stable phase it branches that budget's decay (`training.branching`), scores it and carries on;
each budget is therefore the run that budget would be if trained alone. With one budget and a cosine
schedule it is simply that run. At every budget the fallback rule picks between the trained model and
the original on training loss; the result holds the held-out loss, the pick, and the per-example test
and retention losses of what was picked. The held-out loss is also taken at `spec.rungs` (a quarter and
a half of each budget): the held-out curve, from which successive halving's choice can be replayed.

`trial_steps` is the same trial as a generator that pauses at each rung (successive halving stops it there) and
checkpoints after each budget and rung (`comparison.trial_checkpoint`).

A trial writes into nothing it is given: the original's losses its trainer takes before the first step come back
on the result (`TrialResult.original_losses`), and the engine hands them to the next trial on the same rows.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .arms import ARM_KINDS, Arm, check_growth_count, grow_arm
from .trial_record import BudgetScore, TrialResult, TrialSpec  # the trial's types, imported from here by the sweep's modules


@dataclass
class TrialInputs:
    """What every trial of a comparison shares: the base model, the rows, the settings, the original's losses.

    `original` holds the original's per-example test (and retention) losses and held-out loss (what a budget
    where the fallback rule kept the original scores); trials only read it.
    """

    base: nn.Module
    train_rows: list
    eval_rows: list
    test_rows: list
    retention_rows: list | None
    batch_size: int
    selection_max_examples: int | None
    lora_target_modules: list[str] | None
    grow_kwargs: dict | None
    original: dict
    tracking: dict = field(default_factory=dict)
    gradient_checkpointing: bool = False  # memory only: the same gradients, so not part of a stored trial's identity


def train_config(spec: TrialSpec, inputs: TrialInputs):
    """The `TrainConfig` of a trial: its arm's trainable set, rate and seed, on the schedule of its largest budget."""
    from ..training.config import TrainConfig

    arm = spec.arm
    mode = ARM_KINDS[arm.kind].trainable
    extra = {"trainable_layers": arm.layers} if arm.kind == "layers" else {}
    if arm.kind == "lora":
        extra.update(lora_r=arm.lora_r, lora_alpha=2 * arm.lora_r, lora_target_modules=inputs.lora_target_modules)
    total = max(spec.budgets)
    return TrainConfig(
        trainable=mode, learning_rate=spec.learning_rate, max_steps=total, per_device_train_batch_size=inputs.batch_size,
        lr_scheduler=spec.scheduler, warmup_steps=spec.warmup_steps, decay_ratio=spec.decay_ratio, seed=spec.seed,
        fallback=True, selection_max_examples=inputs.selection_max_examples, save_final_model=False, progress_bar=False,
        logging_steps=total, gradient_checkpointing=inputs.gradient_checkpointing, **inputs.tracking, run_name=f"{spec.arm.name}-lr{spec.learning_rate:g}-seed{spec.seed}", **extra,
    )


def block_seed(grow_kwargs: dict | None, seed: int) -> int:
    """The seed of a growth trial's new blocks: the growth seed given (default 0) plus the trial's seed, so seeds
    vary the new parameters' initialisation as well as the data order (seed 0 grows what `grow_depth` grows)."""
    return int((grow_kwargs or {}).get("seed", 0)) + seed


def fresh_model(base: nn.Module, arm: Arm, grow_kwargs: dict | None, seed: int = 0) -> nn.Module:
    """The model an arm trains: a grown copy for growth arms (new blocks seeded by `block_seed`), a plain copy
    for the controls (LoRA's random factor is drawn after the trainer seeds the run)."""
    import copy

    if arm.kind == "growth":
        grown = grow_arm(base, arm, {**(grow_kwargs or {}), "seed": block_seed(grow_kwargs, seed)})
        check_growth_count(arm, grown)
        return grown
    return copy.deepcopy(base)


def _events(spec: TrialSpec) -> list[tuple[int, str, int]]:
    """`(step, what, budget)` in the order the trunk reaches them: rungs, then branch points, then the end."""
    from ..training.schedules import stable_end

    total = max(spec.budgets)
    events = [(r, "rung", 0) for r in sorted(set(spec.rungs)) if 0 < r < total]
    events += [(stable_end(b, spec.decay_ratio), "branch", b) for b in spec.budgets if b < total]
    events.append((total, "end", total))
    order = {"rung": 0, "branch": 1, "end": 2}
    return sorted(events, key=lambda e: (e[0], order[e[1]], e[2]))


def trial_steps(spec: TrialSpec, inputs: TrialInputs, *, original_losses=(), checkpoint=None, resume=None):
    """The trial as a generator: yields `(step, held-out loss)` at each rung, returns the `TrialResult`.

    Send `False` at a rung to stop the trial there (it returns with `stopped_at` set and no scores).
    `original_losses`: `OriginalLosses` of earlier trials; the one taken on this trial's rows is reused.
    `checkpoint`: called with a `TrialCheckpoint` after each event but the last; `resume`: a `TrialCheckpoint`
    of this spec to continue from (its earlier rungs are not yielded again).
    """
    from ..training.branching import restore_branch_point, retarget, save_branch_point
    from ..training.trainer import GrownTrainer

    from .trial_checkpoint import capture

    started = time.perf_counter() - (resume.seconds if resume is not None else 0.0)
    if len(spec.budgets) > 1 and spec.scheduler != "wsd":
        raise ValueError(f"a trial scored at several budgets needs lr_scheduler='wsd', not {spec.scheduler!r}")
    trainer = GrownTrainer(fresh_model(inputs.base, spec.arm, inputs.grow_kwargs, spec.seed), train_config(spec, inputs), inputs.train_rows, inputs.eval_rows)
    # Every trial starts from the original: its held-out loss and L_S(f_old) on the same rows are the same for all.
    trainer.reuse_original_losses(next((o for o in original_losses if o.key == trainer.losses_key), None))
    result = TrialResult(spec)
    try:
        trainer.begin()
        result.trainable_parameters = trainer.num_trainable
        result.original_losses = trainer.taken_original_losses()
        events, first = _events(spec), 0
        if resume is not None:
            _check_resume(spec, events, resume)
            resume.restore(trainer, result)
            first = resume.events_done
        for done, (step, what, budget) in enumerate(events[first:], first + 1):
            trainer.run_steps(step)
            if what == "rung":
                loss = trainer.heldout_loss() if not trainer.stopped else math.inf
                result.heldout_curve.append((step, loss))
                if (yield step, loss) is False:
                    result.stopped_at = step
                    break
            elif what == "branch" and not trainer.stopped:
                point = save_branch_point(trainer)
                retarget(trainer, budget)
                trainer.run_steps(budget)
                result.scores[budget] = _score(trainer, budget, inputs, started, result)
                restore_branch_point(trainer, point)
            else:  # the end, or a branch of a trunk that diverged (the fallback rule keeps the original)
                result.scores[budget] = _score(trainer, budget, inputs, started, result)
            if checkpoint is not None and what != "end" and (taken := capture(trainer, result, done, time.perf_counter() - started)):
                checkpoint(taken)
    finally:
        trainer.close()
        del trainer
        gc.collect()
    result.seconds = time.perf_counter() - started
    return result


def run_trial(spec: TrialSpec, inputs: TrialInputs, *, original_losses=(), checkpoint=None, resume=None) -> TrialResult:
    """Run a trial to its end (no early stop) and return its `TrialResult` (the rest: as `trial_steps`).

    Example:
        ```python
        >>> result = run_trial(TrialSpec(arm, 3e-3, seed=0, budgets=(8, 16), scheduler="wsd"), inputs)
        >>> sorted(result.scores), result.scores[8].selected
        ([8, 16], 'new')
        ```
    """
    steps = trial_steps(spec, inputs, original_losses=original_losses, checkpoint=checkpoint, resume=resume)
    try:
        next(steps)
        while True:
            steps.send(True)
    except StopIteration as done:
        return done.value


def _check_resume(spec: TrialSpec, events: list, resume) -> None:
    if resume.name != spec.name or not 0 < resume.events_done < len(events) or events[resume.events_done - 1][0] != resume.step:
        raise ValueError(f"checkpoint of {resume.name} after {resume.events_done} events at step {resume.step} is not one of trial {spec.name}")


def _score(trainer, budget: int, inputs: TrialInputs, started: float, result: TrialResult) -> BudgetScore:
    """The fallback rule's pick at this budget, and its held-out, test and retention losses."""
    from ..training.selection import pick

    old = trainer.baseline["old"]
    new = math.nan if trainer.nonfinite is not None else trainer.selection_loss()
    losses = {"new": new, "old": old}
    selected = pick(losses, exclude=("new",) if trainer.nonfinite is not None else ())[0]
    original = inputs.original
    trained_heldout = trainer.heldout_loss() if trainer.nonfinite is None else math.inf  # logged at every budget
    if selected == "old":  # the original's own losses, computed once for every trial
        heldout, (test, weight), retention = original["heldout"], original["test"], original.get("retention")
    else:
        heldout = trained_heldout
        test, weight = example_losses(trainer.model, inputs.test_rows, inputs.batch_size)
        retention = example_losses(trainer.model, inputs.retention_rows, inputs.batch_size) if inputs.retention_rows else None
    result.heldout_curve.append((budget, heldout))
    trainer.tracking.log({**{f"selection/loss_{k}": v for k, v in losses.items()}, "eval/loss_selected": heldout}, budget)
    ret, ret_weight = retention if retention is not None else (None, None)
    units = trainer.units_seen if trainer.nonfinite is None else _planned_units(trainer, budget)
    return BudgetScore(steps=budget, units_seen=units, heldout_loss=heldout, selected=selected, train_losses=losses,
                       test=test, test_weight=weight, retention=ret, retention_weight=ret_weight,
                       seconds=time.perf_counter() - started)


def _planned_units(trainer, budget: int) -> int:
    """What `budget` steps feed the model when a run stopped early (diverged): its budget, as for every other arm."""
    from ..training.data_order import fetch, input_count

    accum, world = trainer.config.gradient_accumulation_steps, trainer.accelerator.num_processes
    return sum(input_count(fetch(trainer.train_dataset, trainer.order.local_indices(p, r)), trainer.causal)
               for p in range(budget * accum) for r in range(world))


# ---------------------------------------------------------------------------- scoring


@torch.no_grad()
def example_losses(model: nn.Module, rows: list[dict], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(per-example loss, per-example weight)` of `model` on `rows` (weight: supervised tokens, or 1).

    Example:
        ```python
        >>> per_example, weight = example_losses(model, test_rows, 8)
        >>> float((per_example * weight).sum() / weight.sum())  # the token-weighted data-set loss
        4.83
        ```
    """
    from ..chunked_loss import batch_example_losses
    from ..data.batches import as_batches, to_device
    from ..evaluation.checks import split_batch
    from ..evaluation.paired import eval_mode

    device = next(model.parameters()).device
    per, weights = [], []
    with eval_mode(model):
        for batch in as_batches(rows, batch_size=batch_size):
            batch = to_device(split_batch(batch)[0], device)
            el = batch_example_losses(model, batch)
            per.append(el.per_example.double().cpu())
            weights.append(el.weight.double().cpu())
    return torch.cat(per).numpy(), torch.cat(weights).numpy()
