"""`compare_plans`: train every arm at the same budget, evaluate them paired, and certify across arms.

Order of work, so a bad input costs nothing: every data set is read and checked against the model,
every arm is resolved (placements, matched controls) and the config validated; only then does
anything train. The original's per-example losses on the test and retention sets are computed once
and shared by every arm; each arm then trains once per learning rate of the grid, keeps the rate with
the lowest held-out loss (the test set is never used to choose), and is scored once on test and
retention examples. Intervals are corrected for the number of arms (`evaluation.decisions`).
"""

from __future__ import annotations

import copy
import gc
import math
import time

import numpy as np
import torch
from torch import nn

from ..data.batches import as_batches, as_rows, to_device
from ..evaluation.checks import prepare_batches, split_batch
from ..evaluation.decisions import corrected_intervals
from ..evaluation.paired import eval_mode
from ..losses import batch_example_losses
from ..training import tracking
from ..training.data_order import training_rows
from .arms import Arm, build_arms, check_growth_count, grow_arm
from .config import CompareConfig
from .result import ArmResult, CompareResult

CONTROLS = ("layers", "lora", "full")
HALVING_RUNGS = (0.25, 0.5)  # shares of the steps where the worse half of an arm's learning rates stops


def _checked_rows(model: nn.Module, data, name: str, batch_size: int) -> list[dict]:
    """Rows of an evaluation set, every batch checked against the model before any work."""
    rows = as_rows(data)
    if not rows:
        raise ValueError(f"{name} is empty: no example to evaluate")
    prepare_batches({name: model}, rows, batch_size, None)
    return rows


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
    device = next(model.parameters()).device
    per, weights = [], []
    with eval_mode(model):
        for batch in as_batches(rows, batch_size=batch_size):
            batch = to_device(split_batch(batch)[0], device)
            el = batch_example_losses(model, batch)
            per.append(el.per_example.double().cpu())
            weights.append(el.weight.double().cpu())
    return torch.cat(per).numpy(), torch.cat(weights).numpy()


def _weighted(per: np.ndarray, weight: np.ndarray) -> float:
    return float((per * weight).sum() / max(weight.sum(), 1.0))


def _train_config(arm: Arm, lr: float, cfg: CompareConfig):
    from ..training.config import TrainConfig

    mode = {"growth": "new", "layers": "layers", "lora": "lora", "full": "full"}[arm.kind]
    extra = {"trainable_layers": arm.layers} if arm.kind == "layers" else {}
    if arm.kind == "lora":
        extra.update(lora_r=arm.lora_r, lora_alpha=2 * arm.lora_r, lora_target_modules=cfg.lora_target_modules)
    return TrainConfig(
        trainable=mode, learning_rate=lr, max_steps=cfg.max_steps, per_device_train_batch_size=cfg.batch_size,
        lr_scheduler=cfg.lr_scheduler, warmup_ratio=cfg.warmup_ratio, seed=cfg.seed, fallback=True,
        selection_max_examples=cfg.selection_max_examples, save_final_model=False, progress_bar=False,
        logging_steps=max(1, cfg.max_steps), **_tracker_settings(cfg, f"{arm.name}-lr{lr:g}"), **extra,
    )  # fmt: skip


def _tracker_settings(cfg: CompareConfig, name: str) -> dict:
    """Where a run of the comparison logs (`report_to`); the seed is in the name, as the probe validation reruns per seed."""
    return {"report_to": cfg.report_to, "logging_dir": cfg.logging_dir, "project_name": cfg.project_name, "run_name": f"{name}-seed{cfg.seed}"}


def _fresh_model(base: nn.Module, arm: Arm, grow_kwargs: dict | None) -> nn.Module:
    if arm.kind == "growth":
        grown = grow_arm(base, arm, grow_kwargs)
        check_growth_count(arm, grown)
        return grown
    return copy.deepcopy(base)


def _train_arm(base, arm: Arm, cfg: CompareConfig, train_rows, eval_rows, grow_kwargs, bar, shared: dict) -> tuple:
    """Train `arm` at every learning rate of the grid; keep the run with the lowest held-out loss.

    With `successive_halving`, every rate trains in step; at each rung (a share of the steps) the worse
    half of the rates still running stops, judged on held-out loss. A stopped run is a prefix of the full
    run (same schedule), so the survivor is exactly what training it alone would give. `shared` carries
    the original's losses from the first run of the comparison to every later one.
    """
    from ..training.trainer import GrownTrainer

    started = time.perf_counter()
    trainers = {lr: GrownTrainer(_fresh_model(base, arm, grow_kwargs), _train_config(arm, lr, cfg), train_rows, eval_rows)
                for lr in cfg.learning_rates}  # fmt: skip
    tried = {lr: {} for lr in trainers}
    for trainer in trainers.values():
        # Every run starts from the original: its held-out loss and L_S(f_old) are taken once per comparison.
        trainer.reuse_original_losses(shared.get("original"))
        trainer.begin()
        shared.setdefault("original", trainer.taken_original_losses())
    alive = list(trainers)
    rungs = [round(f * cfg.max_steps) for f in HALVING_RUNGS] if cfg.successive_halving else []
    for rung in (r for r in rungs if 0 < r < cfg.max_steps):
        if len(alive) < 2:
            break
        for lr in alive:
            trainers[lr].run_steps(rung)
            tried[lr].update(heldout_loss=trainers[lr].heldout_loss(), stopped_at=rung)
        keep = sorted(alive, key=lambda lr: _finite_or_inf(tried[lr]["heldout_loss"]))[: math.ceil(len(alive) / 2)]
        for lr in set(alive) - set(keep):
            trainers.pop(lr).close()  # dropped: no selection, no final evaluation
            bar.update(1)
        alive = keep
    results = {}
    for lr in alive:
        trainer = trainers.pop(lr)
        trainer.run_steps(cfg.max_steps)
        results[lr] = trainer.finish()
        tried[lr] = {"heldout_loss": results[lr].eval_loss_selected, "stopped_at": cfg.max_steps, "selected": results[lr].selected}
        bar.update(1)
    best = min(results, key=lambda lr: _finite_or_inf(results[lr].eval_loss_selected))
    units = {r.units_seen for r in results.values()}
    if len(units) != 1:
        raise RuntimeError(f"arm {arm.name}: the learning rates saw different amounts of data {sorted(units)}")
    chosen = results.pop(best)
    results.clear()
    gc.collect()
    # The arm's whole cost: every rate of the grid, until it stopped, with set-up and evaluations.
    return best, chosen, tried, time.perf_counter() - started, units.pop()


def _finite_or_inf(x) -> float:
    return x if x is not None and math.isfinite(x) else math.inf


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

    Returns:
        `CompareResult`: per arm the chosen learning rate, held-out, test and retention losses, paired
        deltas against the original and against the best control (chosen on held-out), with intervals
        corrected for the number of arms, train seconds and trainable parameters.

    Example:
        ```python
        >>> from hf_depthgrow.comparison import compare_plans
        >>> result = compare_plans(model, train_rows, heldout_rows, test_rows, growth=["top:1", "at:2"],
        ...                        controls=["layers"], learning_rates=[1e-3], max_steps=20)
        >>> print(result.verdict)
        ```
    """
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    cfg = config or CompareConfig(**kwargs)
    tracking.check_available(cfg.report_to)
    tracking.check_logging_dir(cfg.report_to, cfg.logging_dir, "logging_dir is not set (hf-depthgrow compare defaults it to <output_dir>/logs)")
    started = time.perf_counter()
    train_rows = training_rows(train_data, "train_data", model=model)
    eval_rows = training_rows(eval_data, "eval_data", model=model)
    test_rows = _checked_rows(model, test_data, "test_data", cfg.batch_size)
    retention_rows = _checked_rows(model, retention_data, "retention_data", cfg.batch_size) if retention_data is not None else None
    probe_result, probe_seconds = _probe_if_needed(model, cfg, train_rows, probe_result, probe_max_batches)
    arms = build_arms(
        model, cfg.growth, cfg.controls, reference=cfg.reference, probe_result=probe_result, seed=cfg.seed,
        lora_target_modules=cfg.lora_target_modules, grow_kwargs=grow_kwargs,
    )  # fmt: skip
    if probe_result is not None:
        tracking.log_probe_run(probe_result, **_tracker_settings(cfg, "probe"))
    result = _run_arms(model, arms, cfg, train_rows, eval_rows, test_rows, retention_rows, grow_kwargs,
                       probe_result=probe_result, probe_seconds=probe_seconds, started=started)
    logged = tracking.tracking_run(config=cfg.to_dict(), **_tracker_settings(cfg, "compare"))
    logged.log_comparison(result, cfg.max_steps)
    logged.finish()
    return result


def _run_arms(model, arms, cfg, train_rows, eval_rows, test_rows, retention_rows, grow_kwargs, *, probe_result, probe_seconds, started):
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    original = {"test": example_losses(model, test_rows, cfg.batch_size)}
    if retention_rows is not None:
        original["retention"] = example_losses(model, retention_rows, cfg.batch_size)
    original["heldout"] = _weighted(*example_losses(model, eval_rows, cfg.batch_size))
    shared_seconds = time.perf_counter() - t0
    results = [ArmResult.original(arms[0], original)]
    trained = [a for a in arms if a.kind != "original"]
    shared: dict = {}
    with tqdm(total=len(trained) * len(cfg.learning_rates), desc="compare arms", disable=not cfg.progress, unit="run") as bar:
        for arm in trained:
            bar.set_postfix_str(arm.name)
            lr, res, tried, seconds, units = _train_arm(model, arm, cfg, train_rows, eval_rows, grow_kwargs, bar, shared)
            t_eval = time.perf_counter()
            scored = {"test": example_losses(res.model, test_rows, cfg.batch_size)}
            if retention_rows is not None:
                scored["retention"] = example_losses(res.model, retention_rows, cfg.batch_size)
            results.append(ArmResult.trained(arm, lr, res, tried, seconds, units, scored, time.perf_counter() - t_eval))
            del res
            gc.collect()
    units = {r.units_seen for r in results if r.kind != "original"}
    if len(units) > 1:
        raise RuntimeError(f"the arms saw different amounts of data {sorted(units)}: the budget was not equal")
    stats = _statistics(results, original, cfg)
    return CompareResult(
        arms=results, config=cfg.to_dict(), statistics=stats, probe=_probe_summary(probe_result),
        seconds={"total": time.perf_counter() - started, "probe": probe_seconds, "original_losses": shared_seconds},
        num_examples={"train": len(train_rows), "heldout": len(eval_rows), "test": len(test_rows),
                      "retention": len(retention_rows) if retention_rows is not None else 0},
    )  # fmt: skip


def _corrected(diffs: dict, cfg: CompareConfig) -> dict | None:
    if not diffs:
        return None
    return corrected_intervals(
        diffs, delta=cfg.delta, method=cfg.method, kind=cfg.interval, loss_bound=cfg.loss_bound,
        n_bootstrap=cfg.n_bootstrap, seed=cfg.seed,
    )  # fmt: skip


def _statistics(results: list[ArmResult], original: dict, cfg: CompareConfig) -> dict:
    """Corrected paired intervals: every trained arm vs the original, growth vs the best control, forgetting."""
    trained = [r for r in results if r.kind != "original"]
    base_test = original["test"][0]
    stats = {"vs_original": _corrected({r.name: base_test - r.test_per_example for r in trained}, cfg)}
    controls = [r for r in trained if r.kind in CONTROLS]
    growth = [r for r in trained if r.kind == "growth"]
    best = min(controls, key=lambda r: r.heldout_loss) if controls else None
    stats["best_control"] = best.name if best else None
    stats["vs_best_control"] = _corrected({r.name: best.test_per_example - r.test_per_example for r in growth}, cfg) if best else None
    if "retention" in original:
        base_ret = original["retention"][0]
        stats["retention"] = _corrected({r.name: base_ret - r.retention_per_example for r in trained}, cfg)
    # An arm whose fallback rule kept the original is the original, not growth: it is the best growth arm
    # only when every growth arm fell back (its held-out loss may still be a rounding below a real one's).
    kept = [r for r in growth if r.selected != "old"] or growth
    stats["best_growth"] = min(kept, key=lambda r: r.heldout_loss).name if kept else None
    return stats


def _probe_summary(probe_result) -> dict | None:
    if probe_result is None:
        return None
    return {
        "positions": list(probe_result.positions),
        "signal": [float(x) for x in probe_result.signal],
        "z": [float(x) for x in probe_result.z],
    }
