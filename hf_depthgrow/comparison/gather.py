"""`hf-depthgrow compare --gather DIR`: the comparison rebuilt from stored trials, training nothing.

A sweep whose trials ran elsewhere (earlier runs, other machines, a Ray cluster writing to a shared `--trials-dir`) is
aggregated by running the same command with `--gather DIR`: `compare_plans` runs as usual, with the engine
`stored`, which reads every trial from the `TrialStore` under DIR (each verified against its digest and keyed
by spec, model, data and settings) and refuses to train: a trial not stored, or stored for another model,
data or settings, is one line naming the missing trials. `gather_comparison(DIR)` needs neither: it reads
the record `compare_plans` keeps beside the trials (config, arms, the original's losses, documents).
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from ..utils import json_number
from .aggregate import aggregate
from .arms import Arm
from .config import CompareConfig
from .engine import engine_for, run_grids
from .store import SWEEPS, TrialStore

__all__ = ["gather_comparison", "gathering"]


def gathering(script, cfg):
    """`(script, cfg)` of `compare --gather DIR`: the trials read from DIR with the `stored` engine."""
    folder = Path(script.gather)
    if not folder.is_dir():
        raise ValueError(f"gather: {script.gather} is not a folder of stored trials (compare --trials-dir writes one)")
    if script.trials_dir is not None and Path(script.trials_dir).resolve() != folder.resolve():
        raise ValueError(f"gather {script.gather} and trials_dir {script.trials_dir} differ: --gather reads the trials from its folder")
    if script.oracle_positions:
        raise ValueError("gather rebuilds the comparison only, and the oracle sweep would train: drop --oracle-positions")
    if cfg.engine != "serial":
        raise ValueError(f"gather trains nothing, so engine {cfg.engine!r} has nothing to run: drop --engine")
    return replace(script, trials_dir=script.gather), replace(cfg, engine="stored")


def recorded_in(trials_dir) -> bool:
    """Whether `trials_dir` holds a comparison's own record (`compare_plans` with `trials_dir` writes one beside its
    trials), so that `gather_comparison` can rebuild it from the folder alone."""
    from ..storage import ENTRY_FILE

    return any(Path(trials_dir, SWEEPS).glob(f"*/{ENTRY_FILE}"))


def gather_comparison(trials_dir):
    """The `CompareResult` whose trials `trials_dir` holds, rebuilt from that folder alone: no model, no data, nothing trained.

    It reads the record `compare_plans(..., trials_dir=...)` keeps beside the trials (the latest where several
    comparisons share the folder), then every trial through the same grid steps as the run that stored them, each
    verified against its digest: the same `CompareResult`, with engine `stored`. A trial not stored is one
    `ValueError` naming it.

    Example:
        ```python
        >>> result = gather_comparison("runs/sweep-trials")
        >>> print(result.verdict)
        ```
    """
    store, meta, tensors = TrialStore.sweep_in(trials_dir)
    names = {f.name for f in fields(CompareConfig)}
    settings = {k: json_number(v) for k, v in meta["config"].items() if k in names}
    # Where the trials ran is not part of the result: read here, with none of Ray's settings.
    settings.update(engine="stored", ray_address=None, max_concurrent_trials=None, resources_per_trial=1, workers_per_trial=1, accelerate_config=None)
    cfg = CompareConfig(**settings)
    arms = [Arm.from_dict(a) for a in meta["arms"]]
    original = {"heldout": json_number(meta["heldout"])}
    for name in ("test", "retention"):
        if name in tensors:
            original[name] = (tensors[name].numpy(), tensors[f"{name}_weight"].numpy())
    trials, grids = run_grids([a for a in arms if a.kind != "original"], cfg, None, engine_for(cfg, store), forgetting="retention" in original)
    extra = {"probe": meta["probe"], "num_examples": meta["num_examples"], "seconds": {}}
    return aggregate(arms, trials, original, cfg, grids=grids, extra=extra, documents=meta["documents"])
