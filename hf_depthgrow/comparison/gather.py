"""`hf-depthgrow compare --gather DIR`: the comparison rebuilt from stored trials, training nothing.

A sweep whose trials ran elsewhere (other sessions, a Ray cluster writing to a shared `--trials-dir`) is
aggregated by running the same command with `--gather DIR`: `compare_plans` runs as usual, with the engine
`stored`, which reads every trial from the `TrialStore` under DIR (each verified against its digest and keyed
by spec, model, data and settings) and refuses to train: a trial not stored, or stored for another model,
data or settings, is one line naming the missing trials. `runner.gather_comparison(DIR)` needs neither: it
reads the record `compare_plans` keeps beside the trials (config, arms, the original's losses, documents).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

__all__ = ["gathering"]


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
