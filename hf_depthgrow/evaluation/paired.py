"""Paired evaluation of a grown model against the original: per-example losses, intervals, routes (THEORY §7).

`evaluate_delta` runs the original (new blocks bypassed) and the grown model on the same examples.
The layers below the lowest new block are identical in both, so their output `z` is computed once
per batch (`prefix_hidden`) and both runs start from it (`start_at`, the old one inside
`bypass_new_blocks`). `compare_models` does the same for two separate models (no shared prefix).

About the module name: this file is `hf_depthgrow/evaluate.py`. It does not shadow the Hugging Face
`evaluate` package, because Python 3 imports are absolute: `import evaluate` anywhere, this file
included, finds the top-level package, while this module is only reachable as
`hf_depthgrow.evaluation.paired`. The HF package is imported lazily (it takes seconds to import) under the
alias `hf_evaluate` for readability.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .bounds import INTERVALS, RouteInputs, paired_intervals, route_bounds
from ..growth.families import residual_output_modules, resolve_family
from ..growth.engine import bypass_new_blocks, growth_record
from ..utils import json_number, json_safe
from ..losses import IGNORE_INDEX, ExampleLosses, example_losses, is_causal_lm

ID_COLUMNS = ("id", "idx", "example_id")


class NonFiniteLossError(ValueError):
    """Some examples have a non-finite loss; `example_ids` and `which` name them (never averaged away)."""

    def __init__(self, message: str, example_ids: list, which: list[str]):
        super().__init__(message)
        self.example_ids = example_ids
        self.which = which


@dataclass
class EvalResult:
    """Paired test-risk delta of two models on the same examples.

    Losses: `loss_old`, `loss_new` are data-set losses (token-weighted for causal LMs, a mean over
    examples for classifiers) and `delta = loss_old - loss_new` (positive = the new model is better).
    `per_example_old/new` hold one loss per example in data order (for LMs: the mean over that
    example's supervised tokens). The intervals (`intervals[name] = (low, high)` at confidence
    `1 - level`) are for `mean_delta`, the mean of per-example differences; for an LM whose examples
    carry different token counts it differs from `delta`.
    """

    task: str
    mode: str
    num_examples: int
    num_tokens: int
    loss_old: float
    loss_new: float
    delta: float
    mean_delta: float
    per_example_old: list[float]
    per_example_new: list[float]
    example_ids: list
    example_weights: list[float]
    level: float
    loss_bound: float
    loss_bound_source: str
    intervals: dict[str, tuple[float, float]]
    interval_details: dict[str, dict]
    certified: dict[str, bool]
    interval_target: str = "mean over examples of (loss_old_i - loss_new_i)"
    metrics: dict = field(default_factory=dict)
    routes: dict | None = None
    prefix_index: int | None = None
    n_bootstrap: int = 2000
    seed: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    models: dict = field(default_factory=dict)

    @property
    def confidence(self) -> float:
        return 1.0 - self.level

    @property
    def verdict(self) -> str:
        """One sentence: certified improvement, certified degradation, or not certified."""
        level = f"level delta = {self.level:g} (confidence {self.confidence:.0%})"
        up = [n for n in INTERVALS if self.certified.get(n)]
        down = [n for n in INTERVALS if self.intervals[n][1] < 0]
        if up:
            return f"Certified improvement at {level} by: {', '.join(_label(n) for n in up)}."
        if down:
            return f"Certified degradation at {level} by: {', '.join(_label(n) for n in down)}."
        return f"No certified difference at {level}: every interval contains 0."

    def to_dict(self) -> dict:
        out = asdict(self)
        out["intervals"] = {k: list(v) for k, v in self.intervals.items()}
        out["confidence"] = self.confidence
        out["verdict"] = self.verdict
        return json_safe(out)

    def to_json(self, path: str | Path | None = None, **kwargs) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False, **kwargs)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: Mapping) -> "EvalResult":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["intervals"] = {k: (json_number(v[0]), json_number(v[1])) for k, v in kwargs["intervals"].items()}
        return cls(**kwargs)


def _label(name: str) -> str:
    return "bootstrap (approximate)" if name == "bootstrap" else name


# --------------------------------------------------------------------------- data


def _iter_batches(data, batch_size: int):
    """A re-iterable of batch dicts: Datasets and lists of rows are batched, loaders used as they are."""
    from torch.utils.data import DataLoader

    if isinstance(data, Mapping):
        return [dict(data)]
    if isinstance(data, DataLoader):
        return data
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        if len(data) == 0:
            raise ValueError("the evaluation data is empty: no example to evaluate.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        # In data order (as `hf_depthgrow.data.sources.make_loader` without shuffling), without importing `datasets`.
        return DataLoader(data, batch_size=batch_size, shuffle=False)
    if isinstance(data, Iterable):
        return list(data)  # a one-shot iterator: kept, since it is read twice (checks, then the run)
    raise TypeError(f"data must be a datasets.Dataset, a list of rows, a DataLoader or batches, got {type(data).__name__}")


def _split_batch(batch: Mapping) -> tuple[dict, torch.Tensor | None]:
    """Model tensors (labels included) and the optional id column."""
    ids = next((batch[k] for k in ID_COLUMNS if k in batch), None)
    tensors = {k: v for k, v in batch.items() if k not in ID_COLUMNS and isinstance(v, torch.Tensor)}
    return tensors, ids


def _batch_size_of(batch: Mapping) -> int:
    return int(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0])


def _vocab_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n_in = getattr(emb, "num_embeddings", None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n_out = getattr(out, "out_features", None) or getattr(model.config, "vocab_size", None)
    return n_in, n_out


def _check_batch(model: nn.Module, batch: dict, ids: list, causal: bool, name: str) -> None:
    if "labels" not in batch:
        raise ValueError(
            f"the evaluation data has no 'labels' (keys: {sorted(batch)}): the loss needs them. "
            "Causal LMs take labels = input_ids (-100 where unsupervised); classifiers an int class per example."
        )
    labels = batch["labels"]
    n_in, n_out = _vocab_sizes(model)
    input_ids = batch.get("input_ids")
    if input_ids is not None and n_in is not None:
        bad = ((input_ids >= n_in) | (input_ids < 0)).reshape(input_ids.shape[0], -1).any(dim=1)
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(
                f"token ids outside the vocabulary of {name} ({n_in} embeddings): max id {int(input_ids.max())}, "
                f"min id {int(input_ids.min())}, in examples {[ids[r] for r in rows][:10]}. "
                "The tokenizer does not match the model (different vocabulary)."
            )
    if causal:
        if labels.is_floating_point():
            raise ValueError(f"causal-LM labels must be token ids, got dtype {labels.dtype}")
        supervised = labels != IGNORE_INDEX
        bad = (supervised & ((labels >= (n_out or math.inf)) | (labels < 0))).any(dim=1)
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(
                f"label ids outside the output vocabulary of {name} ({n_out}) in examples {[ids[r] for r in rows][:10]}: "
                "the tokenizer does not match the model."
            )
        empty = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1) == 0
        if empty.any():
            rows = empty.nonzero().flatten().tolist()
            raise ValueError(
                f"examples {[ids[r] for r in rows][:10]} have no supervised token (all labels after the first are "
                f"{IGNORE_INDEX}): their loss is undefined. Drop them or fix the labels."
            )
    else:
        if labels.is_floating_point():
            raise ValueError(f"classification labels must be integer classes, got dtype {labels.dtype} (regression is not supported)")
        num_labels = getattr(model.config, "num_labels", None)
        bad = (labels < 0) | (labels >= (num_labels or math.inf))
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(
                f"labels outside 0..{num_labels - 1} (the classes of {name}) in examples {[ids[r] for r in rows][:10]}"
            )


def _prepare(models: dict[str, nn.Module], data, batch_size: int, example_ids) -> tuple[list | object, list]:
    """Check every batch before any forward pass; return the batches and the example ids."""
    batches = _iter_batches(data, batch_size)
    causal = is_causal_lm(next(iter(models.values())))
    all_ids: list = []
    count = 0
    for batch in batches:
        tensors, id_col = _split_batch(batch)
        size = _batch_size_of(tensors)
        ids = id_col.tolist() if isinstance(id_col, torch.Tensor) else (list(id_col) if id_col is not None else list(range(count, count + size)))
        if example_ids is not None:
            ids = list(example_ids[count : count + size])
        for name, model in models.items():
            _check_batch(model, tensors, ids, causal, name)
        all_ids.extend(ids)
        count += size
    if count == 0:
        raise ValueError("the evaluation data is empty: no example to evaluate.")
    if example_ids is not None and len(example_ids) != count:
        raise ValueError(f"example_ids has {len(example_ids)} entries for {count} examples")
    return batches, all_ids


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


class _EvalMode:
    """Puts models in eval mode (dropout off) and restores their previous mode."""

    def __init__(self, *models):
        self.models = [m for m in models if m is not None]

    def __enter__(self):
        self.modes = [m.training for m in self.models]
        for m in self.models:
            m.eval()

    def __exit__(self, *exc):
        for m, mode in zip(self.models, self.modes):
            m.train(mode)


# --------------------------------------------------------------------------- metrics

_HF_METRICS: dict[str, tuple[object | None, str | None]] = {}


def _load_hf_metric(name: str):
    """`evaluate.load(name)`, remembered per process; `(None, reason)` where it is unavailable.

    Offline, `evaluate.load("accuracy")` fails: metric scripts live on the Hub and none is cached.
    """
    if name not in _HF_METRICS:
        try:
            import evaluate as hf_evaluate

            _HF_METRICS[name] = (hf_evaluate.load(name), None)
        except Exception as err:  # offline: FileNotFoundError / ConnectionError, depending on the setup
            _HF_METRICS[name] = (None, f"evaluate.load({name!r}) failed: {type(err).__name__}: {str(err)[:200]}")
    return _HF_METRICS[name]


def _f1_numpy(preds: np.ndarray, refs: np.ndarray, average: str) -> float:
    # Same definition as scikit-learn's f1_score (which `evaluate`'s f1 wraps): classes are those
    # seen in references or predictions; an undefined per-class F1 counts as 0.
    def f1_of(c):
        tp = np.sum((preds == c) & (refs == c))
        fp = np.sum((preds == c) & (refs != c))
        fn = np.sum((preds != c) & (refs == c))
        return 0.0 if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)

    if average == "binary":
        return float(f1_of(1))
    return float(np.mean([f1_of(c) for c in np.union1d(preds, refs)]))


def classification_metrics(preds, refs, *, num_labels: int, use_evaluate: bool = True) -> tuple[dict, str]:
    """Accuracy and F1 (binary for 2 classes, macro otherwise), through `evaluate` where it loads.

    Returns `(metrics, source)`; `source` says whether `evaluate` computed them or, and why, the
    built-in numpy definitions (identical to scikit-learn's) did.
    """
    preds, refs = np.asarray(preds), np.asarray(refs)
    average = "binary" if num_labels == 2 else "macro"
    if use_evaluate:
        acc_metric, why_acc = _load_hf_metric("accuracy")
        f1_metric, why_f1 = _load_hf_metric("f1")
        if acc_metric is not None and f1_metric is not None:
            acc = acc_metric.compute(predictions=preds.tolist(), references=refs.tolist())["accuracy"]
            f1 = f1_metric.compute(predictions=preds.tolist(), references=refs.tolist(), average=average)["f1"]
            return {"accuracy": float(acc), f"f1_{average}": float(f1)}, "evaluate (accuracy, f1)"
        reason = why_acc or why_f1
    else:
        reason = "use_evaluate=False"
    metrics = {"accuracy": float(np.mean(preds == refs)), f"f1_{average}": _f1_numpy(preds, refs, average)}
    return metrics, f"hf_depthgrow numpy (scikit-learn definitions); evaluate not used: {reason}"


def _metrics(task: str, preds_old, preds_new, refs, loss_old, loss_new, num_labels, use_evaluate) -> dict:
    if task == "causal_lm":
        # `evaluate`'s "perplexity" metric loads a model by Hub id and averages per-sequence
        # perplexities; ours is exp of the token-weighted loss of the models in memory.
        old, new = {"perplexity": math.exp(loss_old)}, {"perplexity": math.exp(loss_new)}
        source = "hf_depthgrow: perplexity = exp(token-weighted loss); evaluate's perplexity metric needs a Hub model id"
        higher = {"perplexity": False}
    else:
        old, source = classification_metrics(preds_old, refs, num_labels=num_labels, use_evaluate=use_evaluate)
        new, _ = classification_metrics(preds_new, refs, num_labels=num_labels, use_evaluate=use_evaluate)
        higher = {k: True for k in old}
    # Positive = the new model is better, the same convention as the loss delta.
    delta = {k: (new[k] - old[k]) if higher[k] else (old[k] - new[k]) for k in old}
    return {"old": old, "new": new, "delta": delta, "higher_is_better": higher, "source": source,
            "delta_convention": "positive = new model better (new - old where higher is better, old - new otherwise)"}


# --------------------------------------------------------------------------- runs


class _Collector:
    def __init__(self, task: str):
        self.task = task
        self.total = {"old": [], "new": []}
        self.weight = {"old": [], "new": []}
        self.preds = {"old": [], "new": []}
        self.refs: list = []

    def add(self, which: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        losses = example_losses(logits, labels, causal=self.task == "causal_lm")
        self.total[which].append(losses.total.detach().double().cpu())
        self.weight[which].append(losses.weight.detach().double().cpu())
        if self.task != "causal_lm":
            self.preds[which].append(logits.argmax(dim=-1).cpu())
            if which == "old":
                self.refs.append(labels.cpu())

    def cat(self, which: str) -> ExampleLosses:
        return ExampleLosses(torch.cat(self.total[which]), torch.cat(self.weight[which]))


def _progress(total: int | None, progress: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not progress, desc=desc, unit="batch")


def _num_batches(batches) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


def paired_losses(model: nn.Module, batches, *, progress: bool = False) -> tuple[_Collector, int]:
    """Per-example losses of the original (bypassed) and the grown model, prefix computed once per batch."""
    from ..growth.prefix import lowest_new_index, prefix_hidden, start_at

    index = lowest_new_index(model)
    if index is None:
        raise ValueError(
            "the model has no growth record: evaluate_delta compares a grown model with its original. "
            "For two separate models use compare_models(model_a, model_b, data)."
        )
    task = "causal_lm" if is_causal_lm(model) else "classification"
    collect = _Collector(task)
    device = _device_of(model)
    with torch.no_grad(), _progress(_num_batches(batches), progress, "paired eval") as bar:
        for batch in batches:
            batch = _to(_split_batch(batch)[0], device)
            inputs, labels = _inputs(batch), batch["labels"]
            z = prefix_hidden(model, batch, index)
            with start_at(model, index, z):
                logits = model(**inputs).logits
            collect.add("new", logits, labels)
            del logits
            with bypass_new_blocks(model):
                # A native block above the last original layer leaves no original layer at `index`.
                if index < len(resolve_family(model)[1]):
                    with start_at(model, index, z):
                        logits = model(**inputs).logits
                else:
                    logits = model(**inputs).logits
            collect.add("old", logits, labels)
            del logits
            bar.update(1)
    return collect, index


def separate_losses(model_a: nn.Module, model_b: nn.Module, batches, *, progress: bool = False) -> _Collector:
    """Per-example losses of two models, each run fully (no shared computation)."""
    task = "causal_lm" if is_causal_lm(model_a) else "classification"
    collect = _Collector(task)
    with torch.no_grad(), _progress(_num_batches(batches), progress, "eval") as bar:
        for batch in batches:
            batch = _split_batch(batch)[0]
            for which, model in (("new", model_b), ("old", model_a)):
                b = _to(batch, _device_of(model))
                logits = model(**_inputs(b)).logits
                collect.add(which, logits, b["labels"])
                del logits
            bar.update(1)
    return collect


def _assemble(
    collect: _Collector,
    ids: list,
    *,
    mode: str,
    delta: float,
    loss_bound: float | None,
    n_bootstrap: int,
    seed: int,
    metrics: bool,
    use_evaluate: bool,
    num_labels: int | None,
    routes: RouteInputs | None,
    prefix_index: int | None,
    started: float,
    models: dict,
) -> EvalResult:
    old, new = collect.cat("old"), collect.cat("new")
    per_old, per_new = old.per_example.numpy(), new.per_example.numpy()
    bad = ~np.isfinite(per_old) | ~np.isfinite(per_new)
    if bad.any():
        rows = np.flatnonzero(bad)
        which = [
            "+".join(w for w, v in (("old", per_old[r]), ("new", per_new[r])) if not math.isfinite(v)) for r in rows
        ]
        listed = ", ".join(f"{ids[r]} ({w}: old={per_old[r]}, new={per_new[r]})" for r, w in list(zip(rows, which))[:20])
        raise NonFiniteLossError(
            f"{len(rows)} of {len(ids)} examples have a non-finite loss, not averaged away: {listed}",
            [ids[r] for r in rows],
            which,
        )
    notes: list[str] = []
    if loss_bound is None:
        bound = float(max(per_old.max(), per_new.max(), 1e-12))
        source = "data"
        msg = (
            f"loss_bound not given: B = {bound:.4g}, the largest per-example loss on this data. A data-derived B is "
            "not a valid a-priori bound, so the Hoeffding and Bernstein intervals are indicative, not guarantees."
        )
        warnings.warn(msg, stacklevel=3)
        notes.append(msg)
    else:
        bound, source = float(loss_bound), "given"
    details = paired_intervals(per_old, per_new, delta=delta, bound=bound, n_bootstrap=n_bootstrap, seed=seed)
    clipped = details["hoeffding"]["clipped"]
    if clipped:
        notes.append(
            f"{clipped} per-example losses exceed B = {bound:.4g} and were clipped for Hoeffding/Bernstein; those "
            "intervals then cover the mean clipped difference."
        )
    loss_old, loss_new = float(old.mean()), float(new.mean())
    task = collect.task if collect.task == "causal_lm" else "classification"
    if task == "causal_lm":
        w = old.weight.numpy()
        if not np.allclose(w, w[0]):
            notes.append(
                "Examples carry different numbers of supervised tokens: the token-weighted delta and the mean "
                "per-example delta (which the intervals cover) differ."
            )
    metric_block = {}
    if metrics:
        refs = torch.cat(collect.refs).numpy() if collect.refs else None
        preds_old = torch.cat(collect.preds["old"]).numpy() if collect.preds["old"] else None
        preds_new = torch.cat(collect.preds["new"]).numpy() if collect.preds["new"] else None
        metric_block = _metrics(task, preds_old, preds_new, refs, loss_old, loss_new, num_labels, use_evaluate)
    diffs = per_old - per_new
    route_block = None
    if routes is not None:
        route_block = route_bounds(routes, loss_old=float(per_old.mean()), bound=bound, m=len(ids), delta=delta)
        route_block["terms"]["loss_old_test_definition"] = "mean over test examples of the original model's per-example loss"
    return EvalResult(
        task=task,
        mode=mode,
        num_examples=len(ids),
        num_tokens=int(old.weight.sum()),
        loss_old=loss_old,
        loss_new=loss_new,
        delta=loss_old - loss_new,
        mean_delta=float(diffs.mean()),
        per_example_old=per_old.tolist(),
        per_example_new=per_new.tolist(),
        example_ids=list(ids),
        example_weights=old.weight.numpy().tolist(),
        level=delta,
        loss_bound=bound,
        loss_bound_source=source,
        intervals={k: (details[k]["low"], details[k]["high"]) for k in INTERVALS},
        interval_details=details,
        certified={k: details[k]["certified"] for k in INTERVALS},
        metrics=metric_block,
        routes=route_block,
        prefix_index=prefix_index,
        n_bootstrap=n_bootstrap,
        seed=seed,
        seconds=time.perf_counter() - started,
        warnings=notes,
        models=models,
    )


def _describe(model: nn.Module) -> dict:
    record = growth_record(model)
    return {
        "class": type(model).__name__,
        "name_or_path": getattr(model.config, "_name_or_path", "") or "",
        "num_layers": getattr(model.config, "num_hidden_layers", None),
        "grown": bool(record),
        "growth": {k: v for k, v in record.to_dict().items() if k in ("base_num_layers", "native_indices", "adapters")} if record else None,
    }


def _check_level(delta: float, n_bootstrap: int) -> None:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta (the allowed failure probability) must be in (0, 1), got {delta!r}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be >= 1, got {n_bootstrap}")


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
) -> EvalResult:
    """Paired test-risk delta of a grown model against its original, sharing the frozen prefix.

    Every batch runs the layers below the lowest new block once; the grown model and the original
    (new blocks bypassed, no weights copied) both continue from there. All inputs are checked
    before the first forward pass.

    Args:
        model: A model grown by `grow_depth` (or loaded with `load_pretrained`).
        data: A `datasets.Dataset` or list of rows with `labels` (see `hf_depthgrow.data.sources.load_data`),
            a `DataLoader`, or an iterable of batch dicts. An `id`/`idx`/`example_id` column names the examples.
        delta: Allowed failure probability of each interval (confidence `1 - delta`).
        loss_bound: `B`, an a-priori upper bound of a per-example loss. `None` takes the largest loss
            on this data, with a warning: such a B is not a valid a-priori bound.
        n_bootstrap: Paired bootstrap resamples.
        seed: Seed of the bootstrap.
        batch_size: Examples per forward pass when `data` is not already batched.
        metrics: Also compute task metrics (accuracy and F1, or perplexity).
        use_evaluate: Compute accuracy/F1 with Hugging Face `evaluate` where `evaluate.load` works
            (offline it does not: the built-in numpy definitions are used and the report says so).
        routes: Route A/B inputs (`hf_depthgrow.evaluation.bounds.RouteInputs`, see `route_inputs`); the result
            then carries every term and both bounds.
        example_ids: Names of the examples in data order (default: their position).
        progress: Show a tqdm progress bar.

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
    _check_level(delta, n_bootstrap)
    started = time.perf_counter()
    batches, ids = _prepare({"the model": model}, data, batch_size, example_ids)
    with _EvalMode(model):
        collect, index = paired_losses(model, batches, progress=progress)
    record = growth_record(model)
    described = {"old": {**_describe(model), "note": "the grown model with its new blocks bypassed",
                         "num_layers": record.base_num_layers if record else None}, "new": _describe(model)}
    return _assemble(
        collect, ids, mode="shared_prefix", delta=delta, loss_bound=loss_bound, n_bootstrap=n_bootstrap, seed=seed,
        metrics=metrics, use_evaluate=use_evaluate, num_labels=getattr(model.config, "num_labels", None),
        routes=routes, prefix_index=index, started=started, models=described,
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
) -> EvalResult:
    """Paired test-risk delta of two separate models: `model_a` is the reference ("old"), `model_b` the candidate ("new").

    Both run fully on every batch (nothing is shared), e.g. a LLaMA-Pro-style expanded checkpoint
    made elsewhere against its base. Same arguments and result as `evaluate_delta`; the two models
    must have the same head (task, classes or vocabulary).

    Example:
        ```python
        >>> result = compare_models(base, expanded, test_data, loss_bound=20.0)
        >>> print(result.verdict)
        ```
    """
    _check_level(delta, n_bootstrap)
    if is_causal_lm(model_a) != is_causal_lm(model_b):
        raise ValueError(f"the models have different heads: {type(model_a).__name__} vs {type(model_b).__name__}")
    if is_causal_lm(model_a):
        va, vb = _vocab_sizes(model_a)[1], _vocab_sizes(model_b)[1]
        if va != vb:
            raise ValueError(f"the models have different output vocabularies ({va} vs {vb}): their losses are not comparable")
    elif getattr(model_a.config, "num_labels", None) != getattr(model_b.config, "num_labels", None):
        raise ValueError(f"the models have different numbers of classes ({model_a.config.num_labels} vs {model_b.config.num_labels})")
    started = time.perf_counter()
    batches, ids = _prepare({"model_a": model_a, "model_b": model_b}, data, batch_size, example_ids)
    with _EvalMode(model_a, model_b):
        collect = separate_losses(model_a, model_b, batches, progress=progress)
    return _assemble(
        collect, ids, mode="separate", delta=delta, loss_bound=loss_bound, n_bootstrap=n_bootstrap, seed=seed,
        metrics=metrics, use_evaluate=use_evaluate, num_labels=getattr(model_a.config, "num_labels", None),
        routes=routes, prefix_index=None, started=started,
        models={"old": _describe(model_a), "new": _describe(model_b)},
    )


# --------------------------------------------------------------------------- Route A/B inputs measured here


def _new_block_outputs(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Each new block with the modules whose output joins the residual stream (its output weights W)."""
    from ..growth.adapter import hosted_blocks

    record = growth_record(model)
    if not record:
        raise ValueError("the model has no growth record: there is no new block to measure")
    spec, stack, _ = resolve_family(model)
    out = [(stack[i], residual_output_modules(spec, stack[i])) for i in record.native_indices]
    for layer in stack:
        for hosted in hosted_blocks(layer).values():
            out.extend((block, [block.w_out]) for block in hosted)
    return out


def block_norm_terms(model: nn.Module, data, *, batch_size: int = 8, progress: bool = False) -> dict:
    """Estimate `rho`, `B_a` and compute `B_W` for the new blocks of a grown model (inputs of eps_M).

    Definitions (all new blocks together, as one block with stacked output weights):
    - `B_W = ||W||_F` over every output projection of every new block (weights and biases: a bias
      is a weight on a constant activation 1).
    - `B_a = max_i ||A_i||_F`: the largest, over the examples of `data`, Frobenius norm of the
      block's pre-projection activation (the inputs of its output projections, plus the constant 1
      for a bias), over that example's tokens (attention-masked tokens excluded).
    - `rho` (an estimate): `max_i ||d l_i / d H_i||_F`, the largest gradient norm of the example's
      loss with respect to the block's output over its tokens: an empirical Lipschitz estimate of
      `loss o f_top` at the block's output, at the trained weights. A maximum over a sample is a
      lower estimate of the true constant.

    Example:
        ```python
        >>> terms = block_norm_terms(grown, train_data)
        >>> terms["rho"], terms["b_w"], terms["b_a"]
        ```
    """
    from ..growth.prefix import lowest_new_index, prefix_hidden, start_at

    blocks = _new_block_outputs(model)
    b_w = math.sqrt(
        sum(float(p.detach().double().pow(2).sum()) for _, mods in blocks for m in mods for p in m.parameters(recurse=False))
    )
    batches, ids = _prepare({"the model": model}, data, batch_size, None)
    causal = is_causal_lm(model)
    index = lowest_new_index(model)
    device = _device_of(model)
    acts: list[torch.Tensor] = []
    bias_tokens: list[int] = []
    probes: list[torch.Tensor] = []

    def capture_act(module, args):
        acts.append(args[0].detach())
        bias_tokens.append(1 if getattr(module, "bias", None) is not None else 0)

    def add_probe(module, args, output):
        # Adding a zero leaf gives the gradient at this output without cutting the graph below it.
        hidden = output[0] if isinstance(output, tuple) else output
        probe = torch.zeros_like(hidden, requires_grad=True)
        probes.append(probe)
        return (hidden + probe, *output[1:]) if isinstance(output, tuple) else hidden + probe

    handles = [m.register_forward_pre_hook(capture_act) for _, mods in blocks for m in mods]
    handles += [block.register_forward_hook(add_probe) for block, _ in blocks]
    rho, b_a = 0.0, 0.0
    try:
        with _EvalMode(model), _progress(_num_batches(batches), progress, "block terms") as bar:
            for batch in batches:
                batch = _to(_split_batch(batch)[0], device)
                acts.clear(), bias_tokens.clear(), probes.clear()
                z = prefix_hidden(model, batch, index)
                with torch.enable_grad(), start_at(model, index, z):
                    logits = model(**_inputs(batch)).logits
                    per = example_losses(logits, batch["labels"], causal=causal).per_example
                    grads = torch.autograd.grad(per.sum(), probes)
                mask = batch.get("attention_mask")
                sq_grad = sum(g.double().pow(2).flatten(1).sum(1) for g in grads)
                sq_act = 0
                for a, has_bias in zip(acts, bias_tokens):
                    a = a.double()
                    tokens_mask = mask is not None and a.dim() == 3 and mask.shape == a.shape[:2]
                    m = mask.to(a.dtype).unsqueeze(-1) if tokens_mask else torch.ones_like(a[..., :1])
                    sq_act = sq_act + (a.pow(2) * m).flatten(1).sum(1) + has_bias * m.flatten(1).sum(1)
                rho = max(rho, float(sq_grad.sqrt().max()))
                b_a = max(b_a, float(torch.as_tensor(sq_act).sqrt().max()))
                bar.update(1)
    finally:
        for h in handles:
            h.remove()
    return {
        "rho": rho,
        "b_w": b_w,
        "b_a": b_a,
        "num_examples": len(ids),
        "rho_how": "estimate: max over examples of ||d loss_i / d (block output)||_F (empirical Lipschitz of loss o f_top at the block's output, trained weights)",
        "b_a_how": "max over examples of ||pre-projection activation||_F over the example's tokens (plus 1 per token for a bias)",
        "b_w_how": "||W||_F of the trained block's output projections (weights and biases)",
    }


def _margin(stone, data, *, what: str, **kwargs) -> tuple[float | None, str | None]:
    """`L(f_old) - L(stone)` on `data` from a grown stepping-stone model, a number, or a result with losses."""
    if stone is None:
        return None, None
    if isinstance(stone, (int, float)):
        return float(stone), "given as a number"
    if isinstance(stone, nn.Module):
        if data is None:
            raise ValueError(f"{what}: a stepping-stone model needs the data to measure it on")
        with warnings.catch_warnings():  # only the margin is used, not the intervals, so B does not matter
            warnings.simplefilter("ignore", UserWarning)
            res = evaluate_delta(stone, data, metrics=False, n_bootstrap=1, **kwargs)
        return res.mean_delta, f"measured here: mean per-example delta of the stepping stone vs the original on {res.num_examples} examples"
    if hasattr(stone, "loss_old") and hasattr(stone, "loss_stone"):
        return float(stone.loss_old) - float(stone.loss_stone), "loss_old - loss_stone of the stepping-stone result (on the data it measured)"
    raise TypeError(f"{what}: expected a model, a number or a SteppingStoneResult, got {type(stone).__name__}")


def route_inputs(
    model: nn.Module | None = None,
    *,
    n_train: int | None = None,
    train_result=None,
    delta_erm: float | None = None,
    stone_pop=None,
    held_out=None,
    stone=None,
    test_data=None,
    block_data=None,
    batch_size: int = 8,
    progress: bool = False,
) -> RouteInputs:
    """Gather the Route A/B inputs: take what other modules computed, measure the rest.

    Args:
        model: The trained grown model (for `B_W`, `B_a`, `rho` on `block_data`).
        n_train: Training-set size `n` (or `train_result.n_train` / `num_train_examples` where present).
        train_result: The trainer's result; its `delta_erm` is `Delta_ERM`.
        delta_erm: `Delta_ERM` given directly (overrides `train_result`).
        stone_pop: The population stepping stone `f~_pop` (a grown model, measured on `held_out`), a
            number (`Delta_R`), or a stepping-stone result whose losses were measured on the held-out split.
        held_out: The held-out split for `Delta_R`.
        stone: The stepping stone for `Delta^R_test` (a grown model measured on `test_data`, or a number).
        test_data: The test set T.
        block_data: Data for `rho` and `B_a` (the training data, for the Rademacher term).

    Example:
        ```python
        >>> inputs = route_inputs(grown, train_result=tr, stone_pop=pop_model, held_out=held, stone=stone_model,
        ...                       test_data=test, block_data=train)
        >>> result = evaluate_delta(grown, test, loss_bound=20.0, routes=inputs)
        ```
    """
    sources: dict[str, str] = {}
    if delta_erm is None and train_result is not None:
        delta_erm = getattr(train_result, "delta_erm", None)
        if delta_erm is not None:
            selected = getattr(train_result, "selected", None)
            reference = getattr(train_result, "reference", None)
            sources["delta_erm"] = "from the trainer's result" + (f" (selected model: {selected})" if selected else "")
            if reference == "old":
                # THEORY §4 measures Delta_ERM against f~_S; against f_old it already holds the stone's margin.
                sources["delta_erm"] += (
                    "; measured against f_old, not the stepping stone f~_S (the trainer had none), so the routes "
                    "count the stone's margin twice: train with stepping_stone= for a valid Delta_ERM"
                )
    elif delta_erm is not None:
        sources["delta_erm"] = "given"
    if n_train is None and train_result is not None:
        n_train = next((getattr(train_result, k) for k in ("n_train", "num_train_examples") if getattr(train_result, k, None)), None)
    if n_train is not None:
        sources.setdefault("n_train", "given" if train_result is None else "given / from the trainer's result")
    delta_r, why = _margin(stone_pop, held_out, what="Delta_R (population stepping stone, held-out split)", batch_size=batch_size)
    if why:
        sources["delta_r"] = why
    delta_r_test, why = _margin(stone, test_data, what="Delta^R_test (stepping stone, test set)", batch_size=batch_size)
    if why:
        sources["delta_r_test"] = why
    rho = b_w = b_a = None
    if model is not None and block_data is not None:
        terms = block_norm_terms(model, block_data, batch_size=batch_size, progress=progress)
        rho, b_w, b_a = terms["rho"], terms["b_w"], terms["b_a"]
        sources["rho"] = f"{terms['rho_how']}, on {terms['num_examples']} examples"
        sources["b_a"] = f"{terms['b_a_how']}, on {terms['num_examples']} examples"
        sources["b_w"] = terms["b_w_how"]
    return RouteInputs(
        n_train=n_train, delta_erm=None if delta_erm is None else float(delta_erm), delta_r=delta_r,
        delta_r_test=delta_r_test, rho=rho, b_w=b_w, b_a=b_a, sources=sources,
    )
