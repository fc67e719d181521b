"""Task metrics of a paired evaluation: accuracy and F1 for classifiers, perplexity for causal LMs.

Accuracy and F1 go through Hugging Face `evaluate` where `evaluate.load` works and the process is
online; offline (`HF_HUB_OFFLINE`, `HF_EVALUATE_OFFLINE` or `HF_DATASETS_OFFLINE` set) it is never
called, since it looks metric scripts up on the Hub even when told the Hub is offline, and the
built-in numpy definitions are exact (identical to scikit-learn's). The HF package is
imported lazily (it takes seconds) under the alias `hf_evaluate`; this subpackage is
`hf_depthgrow.evaluation`, so `import evaluate` always finds Hugging Face's package, never ours.
"""

from __future__ import annotations

import math
import os

import numpy as np

_HF_METRICS: dict[str, tuple[object | None, str | None]] = {}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_reason() -> str | None:
    """Which setting makes this process offline, or `None` when it is online."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set (offline: evaluate.load would look metric scripts up on the Hub)"
    from huggingface_hub import constants

    return "huggingface_hub offline mode is on" if constants.is_offline_mode() else None


def _load_hf_metric(name: str):
    """`evaluate.load(name)`, remembered per process; `(None, reason)` where it is unavailable.

    Offline it is not called at all (not remembered either: going online later can still use it).
    """
    offline = offline_reason()
    if offline:
        return None, offline
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

    Example:
        ```python
        >>> metrics, source = classification_metrics([0, 1, 1], [0, 1, 0], num_labels=2, use_evaluate=False)
        >>> metrics
        {'accuracy': 0.6666666666666666, 'f1_binary': 0.6666666666666666}
        ```
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


def task_metrics(task: str, preds_old, preds_new, refs, loss_old, loss_new, num_labels, use_evaluate) -> dict:
    """Metrics of both models and their delta (positive = the new model is better), with where they came from."""
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
