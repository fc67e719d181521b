"""Where trials run and which run next. The serial engine runs them here, one after another (the default on one
machine); `engine_for` names the engine a config asks for (serial, Ray, or the store alone).

An engine takes trial specs and returns their results. The scheduling policies live here too: `run_grids` runs
every arm's learning-rate grid and then extends a grid whose choice sits at its edge (`grids.extension`), and
successive halving runs an arm's rates in step (`trial_steps`), at each rung stopping the worse half on held-out
loss; a stopped trial is a prefix of the full one, so the survivor is what training it alone gives. How results
combine is `aggregate`'s.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

from .aggregate import rungs_of
from .grids import _finite, best_rate, edge, extension
from .trial import TrialInputs, TrialResult, TrialSpec, run_trial, trial_steps

__all__ = ["engine_for", "run_grids", "run_serial", "trial_spec"]


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


def trial_spec(arm, lr: float, cfg) -> TrialSpec:
    """The trial of `arm` at rate `lr` under `cfg` (a `CompareConfig`): its seed, budgets, schedule and halving rungs."""
    rungs = sorted({r for b in cfg.sweep for r in rungs_of(b)})
    return TrialSpec(arm, float(lr), cfg.seed, tuple(cfg.sweep), warmup_steps=cfg.warmup, scheduler=cfg.scheduler,
                     decay_ratio=cfg.decay_ratio, rungs=tuple(rungs))


def _grid_state(trials: list[TrialResult], budgets: list[int]) -> tuple[list[float], list]:
    """The rates an arm tried, and per budget whether its choice sits at an edge of them."""
    rates = sorted(t.spec.learning_rate for t in trials)
    edges = []
    for b in budgets:
        chosen = best_rate({t.spec.learning_rate: t.scores[b].heldout_loss for t in trials if b in t.scores})
        edges.append(edge(rates, chosen))
    return rates, edges


def run_grids(trained: list, cfg, inputs: TrialInputs | None, engine, *, forgetting: bool) -> tuple[list[TrialResult], dict]:
    """Every arm of `trained` at its grid on `engine`, then x3 extensions for arms whose choice sits at an edge, until
    interior, the limit or the cap (`grids.extension`); with `forgetting` (a retention set) each grid also reaches
    below its lowest rate (`CompareConfig.grid`). Returns the trials and, per arm, its grid and why it stopped."""
    from tqdm.auto import tqdm

    grids = {arm.name: {"grid": cfg.grid(arm.kind, retention=forgetting), "below": cfg.forgetting_rates if forgetting else 0,
                        "added": [], "stopped": None} for arm in trained}
    specs = [trial_spec(arm, lr, cfg) for arm in trained for lr in grids[arm.name]["grid"]]
    with tqdm(total=len(specs), desc="compare trials", disable=not cfg.progress, unit="trial") as bar:
        trials = engine(specs, inputs, halving=cfg.successive_halving, bar=bar)
        while True:
            more = []
            for arm in trained:
                info = grids[arm.name]
                if info["stopped"] is not None:
                    continue
                rates, edges = _grid_state([t for t in trials if t.spec.arm.name == arm.name], cfg.sweep)
                rate, why = extension(rates, edges, added=len(info["added"]), limit=cfg.lr_extensions, cap=cfg.max_learning_rate)
                if rate is None:
                    info.update(stopped=why, rates=rates, edges=dict(zip(cfg.sweep, edges)))
                else:
                    info["added"].append(rate)
                    more.append(trial_spec(arm, rate, cfg))
            if not more:
                break
            bar.total += len(more)
            trials += engine(more, inputs, halving=False, bar=bar)
    return trials, grids
