"""Paired evaluation of a grown model against the original: per-example losses and intervals (docs/theory.md §7).

`evaluate_delta` runs the original (new blocks bypassed) and the grown model on the same examples.
The layers below the lowest new block are identical in both, so their output `z` is computed once
per batch (`prefix_hidden`) and both runs start from it (`start_at`, the old one inside
`bypass_new_blocks`). `compare_models` does the same for two separate models (no shared prefix).

Data is read through the package's data contract (`hf_depthgrow.data.batches`); see
`hf_depthgrow.evaluation.checks` for what is checked before the first forward pass.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..data.batches import as_batches, to_device
from ..growth.bypass import bypass_new_blocks
from ..growth.towers import resolve_family
from ..growth.prefix import lowest_new_index, prefix_hidden, start_at
from ..growth.record import growth_record
from ..losses import is_causal_lm, model_inputs
from .bounds import INTERVALS, paired_intervals
from .checks import batches_and_documents, check_level, check_same_head, cluster_labels, split_batch
from .collector import Collector
from .formatting import public_name
from .metrics import task_metrics
from .result import EvalResult, NonFiniteLossError
from .routes import RouteInputs, route_bounds


@contextlib.contextmanager
def eval_mode(*models: nn.Module | None):
    """Models in eval mode (dropout off) inside the block, their previous mode restored after."""
    models = [m for m in models if m is not None]
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


def progress_bar(batches, progress: bool, desc: str):
    """A tqdm bar over the batches (its length where known), disabled unless `progress`."""
    from tqdm.auto import tqdm

    try:
        total = len(batches)
    except TypeError:
        total = None
    return tqdm(total=total, disable=not progress, desc=desc, unit="batch")


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _task(model: nn.Module) -> str:
    return "causal_lm" if is_causal_lm(model) else "classification"


def _run_paired(
    model: nn.Module, batches, index: int, progress: bool, chunk_size="auto", extra: Mapping | None = None, known: Collector | None = None
) -> Collector:
    collect = Collector(_task(model))
    device = device_of(model)
    given = [side for side in ("old", *(extra or {})) if known is not None and known.has(side)]
    extra = {name: other for name, other in (extra or {}).items() if name not in given}
    with torch.no_grad(), progress_bar(batches, progress, "paired eval") as bar:
        for batch in batches:
            batch = to_device(split_batch(batch)[0], device)
            inputs, labels = model_inputs(batch), batch["labels"]
            z = prefix_hidden(model, batch, index)
            with start_at(model, index, z):
                collect.run("new", model, inputs, labels, chunk_size)
            for name, other in extra.items():  # grown from the same original with the same lowest new block
                with start_at(other, index, z):
                    collect.run(name, other, inputs, labels, chunk_size)
            if "old" not in given:
                with bypass_new_blocks(model):
                    # A native block above the last original layer leaves no original layer at `index`.
                    with start_at(model, index, z) if index < len(resolve_family(model)[1]) else contextlib.nullcontext():
                        collect.run("old", model, inputs, labels, chunk_size)
            bar.update(1)
    for side in given:
        collect.take(side, known, side)
    return collect


def _prefix_index(model: nn.Module) -> int:
    index = lowest_new_index(model)
    if index is None:
        raise ValueError(
            "the model has no growth record: evaluate_delta compares a grown model with its original. "
            "For two separate models use compare_models(model_a, model_b, data)."
        )
    return index


def paired_losses(
    model: nn.Module,
    data,
    *,
    batch_size: int = 8,
    progress: bool = False,
    chunk_size="auto",
    extra: Mapping[str, nn.Module] | None = None,
    known: Collector | None = None,
) -> tuple[Collector, int]:
    """Per-example losses of the original (bypassed) and the grown model, prefix computed once per batch.

    `data` is any form of the data contract (`hf_depthgrow.data.batches`). `extra` names further
    models grown from the same original whose lowest new block is the grown model's (a stepping
    stone at the same position): they start from the same prefix, one more pass of the top layers
    each, and their losses are kept under their names. `known` holds sides ("old", an extra's name)
    already computed on these examples (an identical earlier run's): they are taken, not run
    (`evaluate_delta` still checks that old and new cover the same examples and tokens). Returns the
    `Collector` and the stack index where the shared prefix ends.

    Example:
        ```python
        >>> collect, index = paired_losses(grown, test_rows, batch_size=4)
        >>> collect.cat("new").per_example.shape
        torch.Size([12])
        ```
    """
    index = _prefix_index(model)
    for name, other in (extra or {}).items():
        if name in ("old", "new") or lowest_new_index(other) != index:
            raise ValueError(f"extra model {name!r} must be named other than old/new and have its lowest new block at {index}")
    with eval_mode(model, *(extra or {}).values()):
        return _run_paired(model, as_batches(data, batch_size=batch_size), index, progress, chunk_size, extra, known), index


def _run_separate(model_a: nn.Module, model_b: nn.Module, batches, progress: bool, chunk_size="auto", reuse: Mapping | None = None) -> Collector:
    collect = Collector(_task(model_a))
    reuse = dict(reuse or {})
    sides = [(which, model) for which, model in (("new", model_b), ("old", model_a)) if which not in reuse]
    if sides:
        with torch.no_grad(), progress_bar(batches, progress, "eval") as bar:
            for batch in batches:
                batch = split_batch(batch)[0]
                for which, model in sides:
                    b = to_device(batch, device_of(model))
                    collect.run(which, model, model_inputs(b), b["labels"], chunk_size)
                bar.update(1)
    for which, (other, source) in reuse.items():
        collect.take(which, other, source)
    return collect


def separate_losses(
    model_a: nn.Module, model_b: nn.Module, data, *, batch_size: int = 8, progress: bool = False, chunk_size="auto"
) -> Collector:
    """Per-example losses of two models, each run fully (no shared computation); `model_a` is "old".

    Example:
        ```python
        >>> collect = separate_losses(base, expanded, test_rows)
        >>> collect.cat("old").per_example.shape
        torch.Size([12])
        ```
    """
    return _run_separate(model_a, model_b, as_batches(data, batch_size=batch_size), progress, chunk_size)


def _check_finite(per_old: np.ndarray, per_new: np.ndarray, ids: list) -> None:
    bad = ~np.isfinite(per_old) | ~np.isfinite(per_new)
    if not bad.any():
        return
    rows = np.flatnonzero(bad)
    which = ["+".join(w for w, v in (("old", per_old[r]), ("new", per_new[r])) if not math.isfinite(v)) for r in rows]
    listed = ", ".join(f"{ids[r]} ({w}: old={per_old[r]}, new={per_new[r]})" for r, w in list(zip(rows, which))[:20])
    raise NonFiniteLossError(
        f"{len(rows)} of {len(ids)} examples have a non-finite loss, not averaged away: {listed}", [ids[r] for r in rows], which
    )


def _loss_bound(per_old: np.ndarray, per_new: np.ndarray, loss_bound: float | None, notes: list[str]) -> tuple[float, str]:
    if loss_bound is not None:
        return float(loss_bound), "given"
    bound = float(max(per_old.max(), per_new.max(), 1e-12))
    msg = (
        f"loss_bound not given: B = {bound:.4g}, the largest per-example loss on this data. A data-derived B is "
        "not a valid a-priori bound, so the Hoeffding and Bernstein intervals are indicative, not guarantees."
    )
    warnings.warn(msg, stacklevel=4)  # the caller of evaluate_delta / compare_models
    notes.append(msg)
    return bound, "data"


def _assemble(collect: Collector, ids: list, *, mode: str, delta: float, loss_bound: float | None, n_bootstrap: int,
              seed: int, metrics: bool, use_evaluate: bool, num_labels: int | None, routes: RouteInputs | None,
              prefix_index: int | None, started: float, models: dict, documents: list | None = None,
              clusters: list | None = None, cluster_key: str | None = None) -> EvalResult:
    old, new = collect.cat("old"), collect.cat("new")
    # Reused losses must be of these examples: the same count, and (causal LM) the same tokens per example.
    if len(old.weight) != len(ids) or len(new.weight) != len(ids) or not torch.equal(old.weight, new.weight):
        raise ValueError(
            f"the old and new losses are not of the same {len(ids)} examples (reused losses of other data?): "
            f"{len(old.weight)} and {len(new.weight)} examples"
        )
    per_old, per_new = old.per_example.numpy(), new.per_example.numpy()
    _check_finite(per_old, per_new, ids)
    notes: list[str] = []
    bound, source = _loss_bound(per_old, per_new, loss_bound, notes)
    details = paired_intervals(per_old, per_new, delta=delta, bound=bound, n_bootstrap=n_bootstrap, seed=seed, clusters=clusters)
    if details["hoeffding"]["clipped"]:
        notes.append(
            f"{details['hoeffding']['clipped']} per-example losses exceed B = {bound:.4g} and were clipped for "
            "Hoeffding/Bernstein; those intervals then cover the mean clipped difference."
        )
    loss_old, loss_new = float(old.mean()), float(new.mean())
    task = collect.task
    if task == "causal_lm" and not np.allclose(old.weight.numpy(), old.weight.numpy()[0]):
        notes.append(
            "Examples carry different numbers of supervised tokens: the token-weighted delta and the mean "
            "per-example delta (which the intervals cover) differ."
        )
    metric_block = task_metrics(task, *collect.predictions(), loss_old, loss_new, num_labels, use_evaluate) if metrics else {}
    route_block = None
    if routes is not None:
        route_block = route_bounds(routes, loss_old=float(per_old.mean()), bound=bound, m=len(ids), delta=delta)
        route_block["terms"]["loss_old_test_definition"] = "mean over test examples of the original model's per-example loss"
    return EvalResult(
        task=task, mode=mode, num_examples=len(ids), num_tokens=int(old.weight.sum()),
        loss_old=loss_old, loss_new=loss_new, delta=loss_old - loss_new, mean_delta=float((per_old - per_new).mean()),
        per_example_old=per_old.tolist(), per_example_new=per_new.tolist(), example_ids=list(ids),
        example_weights=old.weight.numpy().tolist(), level=delta, loss_bound=bound, loss_bound_source=source,
        intervals={k: (details[k]["low"], details[k]["high"]) for k in INTERVALS}, interval_details=details,
        certified={k: details[k]["certified"] for k in INTERVALS}, metrics=metric_block, routes=route_block,
        prefix_index=prefix_index, n_bootstrap=n_bootstrap, seed=seed, seconds=time.perf_counter() - started,
        warnings=notes, models=models, example_documents=documents, cluster_key=cluster_key if clusters is not None else None,
    )


def describe_model(model: nn.Module) -> dict:
    """Class, name, depth and growth summary of a model, as the report's header shows them."""
    record = growth_record(model)
    return {
        "class": type(model).__name__,
        "name_or_path": public_name(getattr(model.config, "_name_or_path", "") or ""),  # never a local absolute path
        "num_layers": getattr(model.config, "num_hidden_layers", None),
        "grown": bool(record),
        "growth": {k: v for k, v in record.to_dict().items() if k in ("base_num_layers", "native_indices", "adapters")} if record else None,
    }


def evaluate_delta(
    model: nn.Module,
    data,
    *,
    delta: float = 0.05,
    loss_bound: float | None = None,
    n_bootstrap: int = 2000,
    seed: int = 0,
    batch_size: int = 8,
    metrics: bool = True,
    use_evaluate: bool = True,
    routes: RouteInputs | None = None,
    example_ids: Sequence | None = None,
    progress: bool = False,
    chunk_size="auto",
    losses: Collector | None = None,
    cluster_key: str | None = "auto",
) -> EvalResult:
    """Paired test-risk delta of a grown model against its original, sharing the frozen prefix.

    Every batch runs the layers below the lowest new block once; the grown model and the original
    (new blocks bypassed, no weights copied) both continue from there. All inputs are checked
    before the first forward pass.

    Args:
        model: A model grown by `grow_depth` (or loaded with `load_pretrained`).
        data: Any form of the data contract (`hf_depthgrow.data.batches`), with `labels`: a
            `datasets.Dataset` or list of row dicts (batched in order, `batch_size` per batch), a
            `DataLoader` or list/iterable of batch dicts (used as they are), or one batch dict. An
            `id`/`idx`/`example_id` column names the examples. A form the contract cannot read
            raises `hf_depthgrow.data.batches.DataFormError`.
        delta: Allowed failure probability of each interval (confidence `1 - delta`).
        loss_bound: `B`, an a-priori upper bound of a per-example loss. `None` takes the largest loss
            on this data, with a warning: such a B is not a valid a-priori bound.
        n_bootstrap: Paired bootstrap resamples.
        seed: Seed of the bootstrap.
        batch_size: Examples per forward pass when `data` is rows (not already batched).
        metrics: Also compute task metrics (accuracy and F1, or perplexity).
        use_evaluate: Compute accuracy/F1 with Hugging Face `evaluate` where `evaluate.load` works
            (offline it does not: the built-in numpy definitions are used and the report says so).
        routes: Route A/B inputs (`hf_depthgrow.evaluation.routes.RouteInputs`, see `route_inputs`); the
            result then carries every term and both bounds.
        example_ids: Names of the examples in data order (default: their position).
        progress: Show a tqdm progress bar.
        chunk_size: A causal LM's loss over chunks of tokens without the full logits (`hf_depthgrow.chunked_loss`):
            `"auto"` (where the vocabulary makes them large), tokens per chunk, or `None` (plain).
        losses: The `Collector` of `paired_losses(model, data, ...)` when it already ran on this data (e.g.
            with a stepping stone in the same pass): nothing runs again; the examples are checked to match.
        cluster_key: The column naming each example's document. The bootstrap then resamples documents (all
            blocks of a drawn document together: blocks of one document are not independent), see
            `bounds.bootstrap_interval`. `"auto"` (the default) uses `"document"` where the data carries it
            (`load_data` writes it for causal-LM blocks); `None` or `"none"` resamples examples. A named column
            the data lacks is a `ValueError` before any model runs.

    Returns:
        `EvalResult`.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth, evaluate_delta
        >>> grown = grow_depth(model, [15], block="native")
        >>> result = evaluate_delta(grown, test_data, loss_bound=20.0)
        >>> result.delta, result.intervals["bernstein"], result.verdict
        ```
    """
    check_level(delta, n_bootstrap, seed)
    started = time.perf_counter()
    index = _prefix_index(model)
    batches, ids, documents, key = batches_and_documents({"the model": model}, data, batch_size, example_ids, cluster_key)
    if losses is None:
        with eval_mode(model):
            collect = _run_paired(model, batches, index, progress, chunk_size)
    else:
        collect = Collector(losses.task)
        for which in ("old", "new"):
            collect.take(which, losses, which)
    record = growth_record(model)
    described = {"old": {**describe_model(model), "note": "the grown model with its new blocks bypassed",
                         "num_layers": record.base_num_layers if record else None}, "new": describe_model(model)}
    return _assemble(
        collect, ids, mode="shared_prefix", delta=delta, loss_bound=loss_bound, n_bootstrap=n_bootstrap, seed=seed,
        metrics=metrics, use_evaluate=use_evaluate, num_labels=getattr(model.config, "num_labels", None),
        routes=routes, prefix_index=index, started=started, models=described, documents=documents, cluster_key=key,
        clusters=cluster_labels(documents, cluster_key),
    )


def compare_models(
    model_a: nn.Module,
    model_b: nn.Module,
    data,
    *,
    delta: float = 0.05,
    loss_bound: float | None = None,
    n_bootstrap: int = 2000,
    seed: int = 0,
    batch_size: int = 8,
    metrics: bool = True,
    use_evaluate: bool = True,
    routes: RouteInputs | None = None,
    example_ids: Sequence | None = None,
    progress: bool = False,
    chunk_size="auto",
    reuse: Mapping[str, tuple[Collector, str]] | None = None,
    cluster_key: str | None = "auto",
) -> EvalResult:
    """Paired test-risk delta of two separate models: `model_a` is the reference ("old"), `model_b` the candidate ("new").

    Both run fully on every batch (nothing is shared), e.g. a LLaMA-Pro-style expanded checkpoint
    made elsewhere against its base. Same arguments (and data forms) and result as `evaluate_delta`;
    the two models must have the same head (task, classes or vocabulary). `reuse={"new": (collector,
    "new")}` takes a side's losses from an earlier evaluation of the same examples instead of running
    that model again (e.g. the grown model's test losses when it is compared with a control next).
    `cluster_key` as for `evaluate_delta` (a document-level bootstrap where the data names documents).

    Example:
        ```python
        >>> result = compare_models(base, expanded, test_data, loss_bound=20.0)
        >>> print(result.verdict)
        ```
    """
    check_level(delta, n_bootstrap, seed)
    check_same_head(model_a, model_b)
    started = time.perf_counter()
    batches, ids, documents, key = batches_and_documents({"model_a": model_a, "model_b": model_b}, data, batch_size, example_ids, cluster_key)
    if reuse and not set(reuse) <= {"old", "new"}:
        raise ValueError(f"reuse takes the sides 'old' and 'new', got {sorted(reuse)}")
    with eval_mode(model_a, model_b):
        collect = _run_separate(model_a, model_b, batches, progress, chunk_size, reuse)
    return _assemble(
        collect, ids, mode="separate", delta=delta, loss_bound=loss_bound, n_bootstrap=n_bootstrap, seed=seed,
        metrics=metrics, use_evaluate=use_evaluate, num_labels=getattr(model_a.config, "num_labels", None),
        routes=routes, prefix_index=None, started=started,
        models={"old": describe_model(model_a), "new": describe_model(model_b)}, documents=documents, cluster_key=key,
        clusters=cluster_labels(documents, cluster_key),
    )
