"""Where trials run. The serial engine runs them here, one after another (the default on one machine).

An engine takes trial specs and returns their results; what to run next (grid extensions) and how results
combine (`aggregate`) are the caller's. Successive halving is a scheduling decision, so it lives here: the
serial engine runs an arm's rates in step (`trial_steps`) and at each rung stops the worse half on
held-out loss; a stopped trial is a prefix of the full one, so the survivor is what training it alone gives.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from .trial import TrialInputs, TrialResult, TrialSpec, run_trial, trial_steps

__all__ = ["run_serial"]


def _finite(x) -> float:
    return x if x is not None and math.isfinite(x) else math.inf


def _halving(specs: list[TrialSpec], inputs: TrialInputs) -> list[TrialResult]:
    """An arm's rates in step; at each rung the better half (held-out loss; ties: the smaller rate) goes on."""
    by_name = {s.name: s for s in specs}
    done, paused = {}, OrderedDict()
    for spec in specs:
        steps = trial_steps(spec, inputs)
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
    return [done[s.name] for s in specs]


def run_serial(specs: list[TrialSpec], inputs: TrialInputs, *, halving: bool = False, bar=None, checkpoints=None) -> list[TrialResult]:
    """Run `specs` in this process, in order (with `halving`, each arm's rates in step); results in the specs' order.

    `checkpoints` (a `TrialStore`, without halving): each trial is checkpointed there and continues from its
    latest checkpoint where the store resumes (`TrialStore.hooks`).

    Example:
        ```python
        >>> results = run_serial([TrialSpec(arm, lr, 0, (20,)) for lr in (1e-3, 3e-3)], inputs)
        >>> [r.spec.learning_rate for r in results]
        [0.001, 0.003]
        ```
    """
    if not halving:
        out = []
        for spec in specs:
            if bar is not None:
                bar.set_postfix_str(spec.name)
            out.append(run_trial(spec, inputs, **(checkpoints.hooks(spec) if checkpoints is not None else {})))
            if bar is not None:
                bar.update(1)
        return out
    by_arm: OrderedDict[str, list[TrialSpec]] = OrderedDict()
    for spec in specs:
        by_arm.setdefault(spec.arm.name, []).append(spec)
    results = {}
    for group in by_arm.values():
        for spec, result in zip(group, _halving(group, inputs)):
            results[spec.name] = result
            if bar is not None:
                bar.update(1)
    return [results[s.name] for s in specs]
