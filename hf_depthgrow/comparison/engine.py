"""Where trials run. The serial engine runs them here, one after another (the default on one machine).

An engine takes trial specs and returns their results; what to run next (grid extensions) and how results
combine (`aggregate`) are the caller's. Successive halving is a scheduling decision, so it lives here: the
serial engine runs an arm's rates in step (`trial_steps`) and at each rung stops the worse half on
held-out loss; a stopped trial is a prefix of the full one, so the survivor is what training it alone gives.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

from .grids import _finite
from .trial import TrialInputs, TrialResult, TrialSpec, run_trial, trial_steps

__all__ = ["engine_for", "run_serial"]


def _learn(known: list, result: TrialResult) -> TrialResult:
    """Keep the original's losses `result` took, for the next trial on the same rows."""
    taken = result.original_losses
    if taken is not None and all(k.key != taken.key for k in known):
        known.append(taken)
    return result


def _halving(specs: list[TrialSpec], inputs: TrialInputs, known: list) -> list[TrialResult]:
    """An arm's rates in step; at each rung the better half (held-out loss; ties: the smaller rate) goes on."""
    by_name = {s.name: s for s in specs}
    done, paused = {}, OrderedDict()
    for spec in specs:
        steps = trial_steps(spec, inputs, original_losses=tuple(known))
        try:
            paused[spec.name] = (steps, next(steps))
        except StopIteration as end:
            done[spec.name] = end.value
    while paused:
        ranked = sorted(paused, key=lambda n: (_finite(paused[n][1][1]), by_name[n].learning_rate))
        keep = set(ranked[: math.ceil(len(ranked) / 2)])
        going = OrderedDict()
        for name, (steps, _) in paused.items():
            try:
                going[name] = (steps, steps.send(name in keep))
            except StopIteration as end:
                done[name] = end.value
        paused = going
    return [_learn(known, done[s.name]) for s in specs]


def run_serial(specs: list[TrialSpec], inputs: TrialInputs, *, halving: bool = False, bar=None, checkpoints=None,
               known: list | None = None) -> list[TrialResult]:
    """Run `specs` in this process, in order (with `halving`, each arm's rates in step); results in the specs' order.

    `checkpoints` (a `TrialStore`, without halving): each trial is checkpointed there and continues from its
    latest checkpoint where the store resumes (`TrialStore.hooks`). `known`: the `OriginalLosses` earlier trials
    of the sweep took (each trial reuses the one on its rows), extended with those these trials take.

    Example:
        ```python
        >>> results = run_serial([TrialSpec(arm, lr, 0, (20,)) for lr in (1e-3, 3e-3)], inputs)
        >>> [r.spec.learning_rate for r in results]
        [0.001, 0.003]
        ```
    """
    known = [] if known is None else known
    if not halving:
        out = []
        for spec in specs:
            if bar is not None:
                bar.set_postfix_str(spec.name)
            hooks = checkpoints.hooks(spec) if checkpoints is not None else {}
            out.append(_learn(known, run_trial(spec, inputs, original_losses=tuple(known), **hooks)))
            if bar is not None:
                bar.update(1)
        return out
    results = {}
    for arm in dict.fromkeys(s.arm.name for s in specs):
        group = [s for s in specs if s.arm.name == arm]
        for spec, result in zip(group, _halving(group, inputs, known)):
            results[spec.name] = result
            if bar is not None:
                bar.update(1)
    return [results[s.name] for s in specs]


def engine_for(cfg, store=None):
    """The engine `cfg.engine` names, with the trial store `store` (or `None`): `serial` (here, each trial stored as it
    finishes), `ray` (`comparison.ray_engine`) or `stored` (every trial read from the store, none trained)."""
    if cfg.engine == "ray":
        from .ray_engine import run_ray

        return functools.partial(run_ray, address=cfg.ray_address, max_concurrent_trials=cfg.max_concurrent_trials, store=store,
                                 resources_per_trial=cfg.resources_per_trial, workers_per_trial=cfg.workers_per_trial,
                                 accelerate_config=cfg.accelerate_config)
    from .store import stored, stored_or_run

    if cfg.engine == "stored":
        if store is None or not store.enabled:
            raise ValueError("engine 'stored' trains nothing and reads every trial from trials_dir: set trials_dir (or use compare --gather DIR)")
        return lambda specs, inputs, *, halving=False, bar=None: stored_or_run(store, specs, None, bar=bar)

    # One list for the whole sweep: the original's losses the first trial takes serve every later trial on its rows.
    return stored(functools.partial(run_serial, known=[]), store)
