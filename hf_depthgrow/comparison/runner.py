"""`compare_plans`: train every arm at equal budgets, evaluate them paired, and certify across arms.

Order of work, so a bad input costs nothing: every data set is read and checked against the model, the largest
budget against the training blocks (`comparison.fresh_data`), every arm is resolved (placements, matched controls)
and the config validated; only then does anything train. The original's per-example losses on the test and
retention sets are computed once and shared by every arm. The trials (`comparison.trial`) are then scheduled and run
by `comparison.engine` (stored and resumable with `trials_dir`, `comparison.store`): first each arm's own grid,
then x3 extensions for arms whose choice sits at an edge (`comparison.grids`). One aggregation
(`comparison.aggregate`: every rate chosen on held-out, the test set never chooses) turns the trials into a
`CompareResult`.

Compare and the oracle sweep share one set-up (`read_sets`, then `prepare_sweep`: the original's losses, the
`TrialInputs`, the store, the engine). With `trials_dir` the comparison also records there what aggregating needs
besides its trials, so that `gather.gather_comparison(trials_dir)` rebuilds it from the folder alone.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..data.batches import as_rows, documents_of
from ..evaluation.checks import cluster_labels, prepare_batches, resolve_cluster_key
from ..probe.signal import ProbeResult
from ..training import tracking
from ..training.data_order import training_rows
from .aggregate import aggregate, retention_parts
from .arms import build_arms
from .config import CompareConfig
from .engine import engine_for, run_grids, trial_spec
from .fresh_data import data_plan
from .result import CompareResult, _weighted
from .store import TrialStore, check_trials_dir
from .trial import TrialInputs, example_losses


def _checked_rows(model: nn.Module, data, name: str, batch_size: int) -> list[dict]:
    """Rows of an evaluation set, every batch checked against the model before any work."""
    rows = as_rows(data)
    if not rows:
        raise ValueError(f"{name} is empty: no example to evaluate")
    prepare_batches({name: model}, rows, batch_size, None)
    return rows


def set_documents(sets: dict, cluster_key: str | None) -> dict:
    """The document of every example of each set (`{name: rows or None}`), by `cluster_key` (`"auto"` or `None`: the
    `document` column where a set has it; whether a bootstrap resamples them is `evaluation.checks.cluster_labels`).

    A named key must be a column of the test and retention sets where given (the sets the intervals are on), else a
    `ValueError` naming it, before anything trains; the other sets report their documents where they have it.

    Example:
        ```python
        >>> set_documents({"test": test_rows, "retention": None}, "auto")
        {'test': [0, 0, 3, ...], 'retention': None}
        ```
    """
    out = {}
    for name, rows in sets.items():
        if rows is None:
            out[name] = None
            continue
        has = lambda column: documents_of(rows, column) is not None  # noqa: E731
        try:
            key = resolve_cluster_key("auto" if cluster_key is None else cluster_key, has)
        except ValueError:
            if name in ("test", "retention"):
                raise ValueError(f"cluster_key {cluster_key!r} is not a column of the {name} data: it names no document to "
                                 "resample by (use auto, none, or a column of the data)") from None
            key = None
        out[name] = documents_of(rows, key) if key is not None else None
    return out


def _check_documents(documents: dict, retention_rows, cfg: CompareConfig) -> None:
    """What the statistics will need of the documents, refused now rather than after training: at least 2 documents
    to resample by on the test (and retention) set, and a retention set that splits into two non-empty parts."""
    for name in ("test", "retention"):
        labels = cluster_labels(documents.get(name), cfg.cluster_key)
        if labels is not None and len(set(labels)) < 2:
            raise ValueError(f"cluster_key {cfg.cluster_key!r}: every example of the {name} data names one document, leaving "
                             "nothing to resample (use auto or none)")
    if retention_rows is not None:
        retention_parts(len(retention_rows), cfg.retention_selection_fraction, cfg.seed, cluster_labels(documents["retention"], cfg.cluster_key))


def _tracker_settings(cfg: CompareConfig, name: str | None = None) -> dict:
    """Where a run of the comparison logs (`report_to`); the seed is in the name, as the probe validation reruns per seed."""
    out = {"report_to": cfg.report_to, "logging_dir": cfg.logging_dir, "project_name": cfg.project_name}
    return out if name is None else {**out, "run_name": f"{name}-seed{cfg.seed}"}


def fresh_data_check(cfg: CompareConfig, num_blocks: int, *, stacklevel: int = 3):
    """Refuse a largest budget that would repeat training blocks (unless allowed), or say up front that it will."""
    plan = data_plan(cfg, num_blocks)
    if plan.repeats:
        warnings.warn(plan.warning(), stacklevel=stacklevel)
    return plan


def _probe_if_needed(model, cfg: CompareConfig, train_rows, probe_result, probe_max_batches: int | None):
    needs = any(isinstance(g, str) and g.startswith("probe:") for g in cfg.growth)
    if probe_result is not None or not needs:
        return probe_result, 0.0
    from ..probe.signal import probe

    started = time.perf_counter()
    result = probe(model, train_rows, batch_size=cfg.batch_size, max_batches=probe_max_batches, progress=cfg.progress)
    return result, time.perf_counter() - started


def compare_plans(
    model: nn.Module,
    train_data,
    eval_data,
    test_data,
    *,
    config: CompareConfig | None = None,
    retention_data=None,
    probe_result=None,
    probe_max_batches: int | None = 16,
    grow_kwargs: dict | None = None,
    trials_dir=None,
    resume: bool = False,
    **kwargs,
) -> CompareResult:
    """Train growth arms and equal-budget controls, evaluate them paired, and say which beat what.

    Args:
        model: The base model (not grown; not changed: every arm trains a copy).
        train_data, eval_data, test_data: Training rows, the held-out split that chooses each arm's
            learning rate, and the test split every arm is scored on (paired, the same examples), in any
            form of `hf_depthgrow.data.batches`, with `labels`.
        config: A `CompareConfig`; or pass its fields as keyword arguments.
        retention_data: A general-domain set outside the training domain (e.g. `load_data("python_docs",
            ...)` for a language model trained on Shakespeare): every arm's forgetting is measured on it.
        probe_result: A `ProbeResult` for `"probe:N"` arms (else the probe runs on `train_data`).
        probe_max_batches: Batches the probe reads when it runs here.
        grow_kwargs: `grow_depth` keyword arguments of the growth arms (`block`, `init`, ...).
        trials_dir: A folder where every finished trial is stored (`comparison.store`): running the same
            comparison again reuses each verified stored trial and trains only the others (resume). Each
            unfinished trial keeps a checkpoint there after every budget (and rung) it scores.
        resume: Continue an interrupted sweep: besides the stored trials, each unfinished trial continues from
            its latest checkpoint in `trials_dir` (without it, it starts over); refused where `trials_dir` holds
            nothing of this comparison.

    Returns:
        `CompareResult` (its docstring lists what it holds).

    Example:
        ```python
        >>> from hf_depthgrow.comparison import compare_plans
        >>> result = compare_plans(model, train_rows, heldout_rows, test_rows, growth=["top:1", "at:2"],
        ...                        controls=["layers"], learning_rates=[1e-3], max_steps=20)
        >>> print(result.verdict)
        ```
    """
    cfg = _checked_call(model, config, kwargs, probe_result=probe_result, retention_data=retention_data, trials_dir=trials_dir, resume=resume)
    started = time.perf_counter()
    data = {"train": train_data, "eval": eval_data, "test": test_data, "retention": retention_data}
    rows, documents = read_sets(model, cfg, data)
    probe_result, probe_seconds = _probe_if_needed(model, cfg, rows["train"], probe_result, probe_max_batches)
    arms = build_arms(
        model, cfg.growth, cfg.controls, reference=cfg.reference, probe_result=probe_result, seed=cfg.seed,
        lora_target_modules=cfg.lora_target_modules, grow_kwargs=grow_kwargs, matched=cfg.matched_controls,
    )
    if probe_result is not None:
        tracking.log_probe_run(probe_result, **_tracker_settings(cfg, "probe"))
    sweep = prepare_sweep(model, cfg, rows, grow_kwargs=grow_kwargs, trials_dir=trials_dir, resume=resume)
    extra = {
        "probe": _probe_summary(probe_result),
        "num_examples": {"train": len(rows["train"]), "heldout": len(rows["eval"]), "test": len(rows["test"]),
                         "retention": len(rows["retention"] or [])},
    }
    if sweep.store is not None and sweep.store.trains:  # the record with which the folder alone rebuilds this comparison
        sweep.store.save_sweep(cfg, arms, sweep.inputs.original, documents, extra)
    trials, grids = run_grids([a for a in arms if a.kind != "original"], cfg, sweep.inputs, sweep.engine, forgetting=rows["retention"] is not None)
    extra["seconds"] = {"total": time.perf_counter() - started, "probe": probe_seconds, "original_losses": sweep.seconds}
    result = aggregate(arms, trials, sweep.inputs.original, cfg, grids=grids, extra=extra, documents=documents)
    _log_comparison(result, cfg)
    return result


def _checked_call(model, config, kwargs: dict, *, probe_result, retention_data, trials_dir, resume) -> CompareConfig:
    """`compare_plans`' arguments checked before any data is read; the config they give."""
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (a loaded model), got {type(model).__name__}")
    if config is not None and not isinstance(config, CompareConfig):
        raise TypeError(f"config must be a CompareConfig, got {type(config).__name__}")
    cfg = config or CompareConfig(**kwargs)
    if probe_result is not None and not isinstance(probe_result, ProbeResult):
        raise TypeError(f"probe_result must be a ProbeResult (hf_depthgrow.probe) or None, got {type(probe_result).__name__}")
    if cfg.max_forgetting is not None and retention_data is None:
        raise ValueError("max_forgetting is a forgetting budget and needs a retention set to measure forgetting on: "
                         "pass retention_data or drop max_forgetting")
    if resume and trials_dir is None:
        raise ValueError("resume continues the trials stored in trials_dir: set trials_dir (compare --trials-dir)")
    check_trials_dir(trials_dir, inputs={"model": getattr(model, "name_or_path", None)})
    _check_trackers(cfg)
    return cfg


def _check_trackers(cfg: CompareConfig) -> None:
    tracking.check_available(cfg.report_to)
    tracking.check_logging_dir(cfg.report_to, cfg.logging_dir, "logging_dir is not set (hf-depthgrow compare defaults it to <output_dir>/logs)")


def _log_comparison(result: CompareResult, cfg: CompareConfig) -> None:
    logged = tracking.tracking_run(config=cfg.to_dict(), **_tracker_settings(cfg, "compare"))
    logged.log_comparison(result, cfg.max_steps)
    logged.finish()


def read_sets(model: nn.Module, cfg: CompareConfig, data: dict, *, fresh: bool = True) -> tuple[dict, dict]:
    """`(rows, documents)` of a sweep's sets (`data`: `train`, `eval`, `test`, `retention` or `None`), each read and
    checked against the model before any work; with `fresh`, the largest budget against the training blocks first."""
    rows = {"train": training_rows(data["train"], "train_data", model=model)}
    if fresh:
        fresh_data_check(cfg, len(rows["train"]), stacklevel=4)
    rows["eval"] = training_rows(data["eval"], "eval_data", model=model)
    rows["test"] = _checked_rows(model, data["test"], "test_data", cfg.batch_size)
    given = data.get("retention")
    rows["retention"] = _checked_rows(model, given, "retention_data", cfg.batch_size) if given is not None else None
    documents = set_documents({"train": rows["train"], "heldout": rows["eval"], "test": rows["test"], "retention": rows["retention"]},
                              cfg.cluster_key)
    _check_documents(documents, rows["retention"], cfg)
    return rows, documents


@dataclass
class Sweep:
    """What every trial of a sweep shares, built once (`prepare_sweep`): its inputs, the engine that runs its trials,
    the seconds the original's losses took, and the trial store (or `None`)."""

    inputs: TrialInputs
    engine: Callable
    seconds: float
    store: TrialStore | None = None


def prepare_sweep(model: nn.Module, cfg: CompareConfig, rows: dict, *, grow_kwargs=None, trials_dir=None, resume: bool = False) -> Sweep:
    """The set-up of every sweep (compare, the oracle): the original's losses on `rows` (as `read_sets` gives them),
    the `TrialInputs`, the trial store under `trials_dir`, and the engine `cfg.engine` names (`engine.engine_for`)."""
    t0 = time.perf_counter()
    original = {"test": example_losses(model, rows["test"], cfg.batch_size)}
    if rows["retention"] is not None:
        original["retention"] = example_losses(model, rows["retention"], cfg.batch_size)
    original["heldout"] = _weighted(*example_losses(model, rows["eval"], cfg.batch_size))
    seconds = time.perf_counter() - t0
    inputs = TrialInputs(
        base=model, train_rows=rows["train"], eval_rows=rows["eval"], test_rows=rows["test"], retention_rows=rows["retention"],
        batch_size=cfg.batch_size, selection_max_examples=cfg.selection_max_examples, lora_target_modules=cfg.lora_target_modules,
        grow_kwargs=grow_kwargs, original=original, tracking=_tracker_settings(cfg), gradient_checkpointing=cfg.gradient_checkpointing,
    )
    store = TrialStore(trials_dir, inputs, resume=resume, trains=cfg.engine != "stored") if trials_dir is not None else None
    return Sweep(inputs, engine_for(cfg, store), seconds, store)


def oracle_trials(model, data: dict, names: list[str], cfgs: dict, probe_result, trials_dir):
    """The oracle sweep's trials (`names` at every seed of `cfgs`, `{seed: CompareConfig}`) in one engine call, so that
    Ray runs them at once; then `(one CompareResult per seed, as compare_plans would give, the trials, the original's losses)`."""
    from tqdm.auto import tqdm

    cfg = next(iter(cfgs.values()))
    _check_trackers(cfg)
    rows, documents = read_sets(model, cfg, data, fresh=False)  # validate_probe checked the budget before its probe
    arms = build_arms(model, names, [], reference=None, probe_result=probe_result, seed=cfg.seed, lora_target_modules=cfg.lora_target_modules,
                      matched=False)  # the oracle trains positions only
    sweep = prepare_sweep(model, cfg, rows, trials_dir=trials_dir)
    trained = [a for a in arms if a.kind != "original"]
    specs = [trial_spec(arm, lr, c) for c in cfgs.values() for arm in trained for lr in c.grid(arm.kind)]
    with tqdm(total=len(specs), desc="oracle trials", disable=not cfg.progress, unit="trial") as bar:
        trials = sweep.engine(specs, sweep.inputs, halving=False, bar=bar)
    results = {}
    for seed, c in cfgs.items():
        grids = {a.name: {"grid": c.grid(a.kind), "added": [], "stopped": "interior"} for a in trained}
        extra = {"probe": None, "seconds": {}, "num_examples": {"train": len(rows["train"])}}
        results[seed] = aggregate(arms, [t for t in trials if t.spec.seed == seed], sweep.inputs.original, c, grids=grids, documents=documents,
                                  extra=extra)
        _log_comparison(results[seed], c)
    return results, trials, sweep.inputs.original


def _probe_summary(probe_result) -> dict | None:
    if probe_result is None:
        return None
    return {
        "positions": list(probe_result.positions),
        "signal": [float(x) for x in probe_result.signal],
        "z": [float(x) for x in probe_result.z],
    }
