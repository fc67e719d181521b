"""Retention: has growth or fine-tuning made the model worse on a set outside its training domain?

A paired evaluation reports `delta = loss_old - loss_new` (positive = the new model is better). On a
retention set (e.g. the Python docs, for a model trained on Shakespeare) the question is the opposite
one, so the numbers are turned round: `forgetting = loss_new - loss_old`, positive = forgot, and each
interval `(low, high)` for the delta becomes `(-high, -low)`.

Example:
    ```python
    >>> from hf_depthgrow.data import load_data
    >>> from hf_depthgrow.evaluation import evaluate_retention
    >>> docs = load_data("python_docs", model=grown, tokenizer=tok, block_size=256, max_examples=256)
    >>> result, report = evaluate_retention(grown, docs, loss_bound=20.0)
    >>> report["verdict"]
    'no certified forgetting: +0.0003 nats/token [-0.002, 0.0027] (bootstrap, 95%)'
    ```
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..utils import json_safe
from .bounds import INTERVALS
from .formatting import format_value
from .paired import compare_models, evaluate_delta
from .result import EvalResult

__all__ = ["evaluate_retention", "forgetting"]

TARGET = "mean over examples of (loss_new_i - loss_old_i); positive = the new model forgot"


def _flip(x: float) -> float:
    # `0.0 - x`, not `-x`: an exact tie stays 0.0 instead of -0.0 (which JSON would print as "-0.0").
    return 0.0 - float(x)


def _signed(x: float) -> str:
    text = format_value(x, 3)
    return f"+{text}" if math.isfinite(x) and x > 0 else text


def _sentence(value: float, intervals: dict, confidence: float, unit: str) -> str:
    """The verdict: forgetting if some interval lies above 0, improvement if some lies below, else neither."""
    forgot = [k for k in INTERVALS if k in intervals and intervals[k][0] > 0]
    improved = [k for k in INTERVALS if k in intervals and intervals[k][1] < 0]
    # Name the interval that decides; with no decision, the bootstrap (usually the tightest) shows the spread.
    shown = (forgot or improved or [k for k in ("bootstrap", *INTERVALS) if k in intervals])[0]
    low, high = intervals[shown]
    detail = f"{_signed(value)} {unit} [{format_value(low, 2)}, {format_value(high, 2)}] ({shown}, {confidence:.0%})"
    if forgot:
        return f"forgetting certified: {detail}"
    if improved:
        return f"improved on the retention set: {detail}"
    return f"no certified forgetting: {detail}"


def forgetting(result: EvalResult | Mapping) -> dict:
    """The forgetting view of a paired result on a retention set, as JSON-ready data.

    Args:
        result ([`EvalResult`] or `dict`): a paired evaluation (old = the original, new = the grown or
            fine-tuned model) on retention data, or its `to_dict()` form (e.g. read from `report.json`).

    Returns:
        `dict`: `forgetting` (the mean over examples of `loss_new_i - loss_old_i`, the target of the intervals;
        positive = the new model forgot), `intervals` (`{kind: [low, high]}` for it, the delta's intervals
        flipped), `certified_forgetting` (`{kind: low > 0}`), `loss_old` and `loss_new` (data-set losses,
        token-weighted for an LM), `num_examples`, `confidence`, `target` and `verdict` (one sentence).
        Non-finite numbers are written as strings, as in `EvalResult.to_dict()`.

    Example:

    ```python
    >>> report = forgetting(evaluate_delta(grown, python_docs_blocks, loss_bound=20.0))
    >>> report["verdict"]
    'forgetting certified: +0.041 nats/token [0.02, 0.06] (bootstrap, 95%)'
    ```
    """
    if isinstance(result, Mapping):
        result = EvalResult.from_dict(result)
    if not result.intervals:
        raise ValueError("forgetting() needs a paired result with intervals, got none")
    value = _flip(result.mean_delta)
    intervals = {kind: (_flip(high), _flip(low)) for kind, (low, high) in result.intervals.items()}
    unit = "nats/token" if result.task == "causal_lm" else "nats/example"
    return json_safe(
        {
            "forgetting": value,
            "intervals": {kind: list(bounds) for kind, bounds in intervals.items()},
            "certified_forgetting": {kind: bool(low > 0) for kind, (low, _) in intervals.items()},
            "loss_old": result.loss_old,
            "loss_new": result.loss_new,
            "num_examples": result.num_examples,
            "confidence": result.confidence,
            "target": TARGET,
            "verdict": _sentence(value, intervals, result.confidence, unit),
        }
    )


def evaluate_retention(model, data, *, base=None, **kwargs) -> tuple[EvalResult, dict]:
    """Paired evaluation on a retention set, and its forgetting view.

    Args:
        model: The grown (or fine-tuned) model. Without `base` it must carry a growth record: the original is
            the same model with its new blocks bypassed (`evaluate_delta`).
        data: The retention data, in any form of the data contract (e.g. `load_data("python_docs", ...)`).
        base (*optional*): A separate original model; both then run fully (`compare_models(base, model, ...)`).
        **kwargs: Passed on to `evaluate_delta` / `compare_models` (`delta`, `loss_bound`, `n_bootstrap`, ...).

    Returns:
        `(EvalResult, dict)`: the paired result (delta convention: positive = better) and [`forgetting`] of it.

    Example:

    ```python
    >>> result, report = evaluate_retention(grown, docs, loss_bound=20.0, n_bootstrap=500)
    >>> report["forgetting"] == -result.mean_delta
    True
    ```
    """
    result = compare_models(base, model, data, **kwargs) if base is not None else evaluate_delta(model, data, **kwargs)
    return result, forgetting(result)
