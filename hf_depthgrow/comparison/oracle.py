"""The oracle sweep's trials: every position x seed in one engine call, then one `CompareResult` per seed.

`validation` scores the predictors against what these trials realize. The trials are those a
`compare_plans` per seed would run, with the same numbers, but submitted together so the Ray engine runs them at
once; they are stored in `trials_dir` when given, and `engine="stored"` rebuilds them without training.
"""

from __future__ import annotations

__all__ = ["oracle_trials"]


class _OriginalPerSeed(dict):
    """The original's losses shared by the oracle's trials, except its training-loss baseline (`losses`): that one is
    keyed on the fallback rule's selection rows, which follow each trial's seed, and one engine call holds every seed,
    so each trial takes its own (the same numbers a per-seed `compare_plans` shares)."""

    def get(self, key, default=None):
        return default if key == "losses" else super().get(key, default)

    def setdefault(self, key, default=None):
        return default if key == "losses" else super().setdefault(key, default)


def oracle_trials(model, data: dict, names: list[str], cfgs: dict, probe_result, trials_dir):
    """Every position x seed trial in one engine call, then one `CompareResult` per seed (as `compare_plans` would give)."""
    from tqdm.auto import tqdm

    from ..training import tracking
    from ..training.data_order import training_rows
    from .aggregate import aggregate
    from .arms import build_arms
    from .engine import run_serial
    from .runner import _checked_rows, _spec, _tracker_settings, _weighted, example_losses, set_documents
    from .store import TrialStore, stored
    from .trial import TrialInputs

    cfg = next(iter(cfgs.values()))
    tracking.check_available(cfg.report_to)
    tracking.check_logging_dir(cfg.report_to, cfg.logging_dir, "logging_dir is not set (hf-depthgrow compare defaults it to <output_dir>/logs)")
    rows = {k: training_rows(data[k], f"{k}_data", model=model) for k in ("train", "eval")}
    rows.update({k: _checked_rows(model, data[k], f"{k}_data", cfg.batch_size) if data[k] is not None else None for k in ("test", "retention")})
    documents = set_documents({"test": rows["test"], "retention": rows["retention"]}, cfg.cluster_key)
    arms = build_arms(model, names, [], reference=None, probe_result=probe_result, seed=cfg.seed, lora_target_modules=cfg.lora_target_modules,
                      matched=False)  # the oracle trains positions only
    original = _OriginalPerSeed(test=example_losses(model, rows["test"], cfg.batch_size))
    if rows["retention"] is not None:
        original["retention"] = example_losses(model, rows["retention"], cfg.batch_size)
    original["heldout"] = _weighted(*example_losses(model, rows["eval"], cfg.batch_size))
    inputs = TrialInputs(
        base=model, train_rows=rows["train"], eval_rows=rows["eval"], test_rows=rows["test"], retention_rows=rows["retention"],
        batch_size=cfg.batch_size, selection_max_examples=cfg.selection_max_examples, lora_target_modules=cfg.lora_target_modules,
        grow_kwargs=None, original=original, tracking=_tracker_settings(cfg),
        gradient_checkpointing=cfg.gradient_checkpointing,
    )  # fmt: skip
    store = TrialStore(trials_dir, inputs, trains=cfg.engine != "stored") if trials_dir is not None else None
    if cfg.engine == "ray":
        from .ray_engine import ray_engine

        engine = ray_engine(cfg, store)
    elif cfg.engine == "stored":
        from .gather import stored_only

        engine = stored_only(store)
    else:
        engine = stored(run_serial, store)
    trained = [a for a in arms if a.kind != "original"]
    specs = [_spec(arm, lr, c) for c in cfgs.values() for arm in trained for lr in c.grid(arm.kind)]
    with tqdm(total=len(specs), desc="oracle trials", disable=not cfg.progress, unit="trial") as bar:
        trials = engine(specs, inputs, halving=False, bar=bar)
    results = {}
    for seed, c in cfgs.items():
        mine = [t for t in trials if t.spec.seed == seed]
        grids = {a.name: {"grid": c.grid(a.kind), "added": [], "stopped": "interior"} for a in trained}
        results[seed] = aggregate(arms, mine, original, c, grids=grids, documents=documents,
                                  extra={"probe": None, "seconds": {}, "num_examples": {"train": len(rows["train"])}})  # fmt: skip
        logged = tracking.tracking_run(config=c.to_dict(), **_tracker_settings(c, "compare"))
        logged.log_comparison(results[seed], c.max_steps)
        logged.finish()
    return results, trials, original
