"""The result of a paired evaluation (`EvalResult`), its JSON form, and the error for non-finite losses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..utils import json_number, json_safe
from .bounds import INTERVALS
from .formatting import scrub_paths


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
    carry different token counts it differs from `delta`. `example_documents` names each example's
    document where the data carries one, and `num_documents` counts them; `cluster_key` is the column
    the bootstrap resampled by (documents, not examples), `None` where it resampled examples.

    Example:
        ```python
        >>> result = evaluate_delta(grown, test_data, loss_bound=20.0)
        >>> same = EvalResult.from_dict(json.loads(result.to_json()))
        >>> same.verdict == result.verdict
        True
        ```
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
    example_documents: list | None = None
    cluster_key: str | None = None

    @property
    def num_documents(self) -> int | None:
        """Distinct documents among the examples (`None` when the data names none)."""
        return None if self.example_documents is None else len(set(self.example_documents))

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
        """Plain JSON-safe data (non-finite numbers as strings), with `confidence` and `verdict` added."""
        out = asdict(self)
        out["intervals"] = {k: list(v) for k, v in self.intervals.items()}
        out["confidence"] = self.confidence
        out["verdict"] = self.verdict
        out["num_documents"] = self.num_documents
        # Model names and notes may carry where files sat on this machine: reports name them by id or folder.
        out["models"], out["warnings"] = scrub_paths(out["models"]), scrub_paths(out["warnings"])
        return json_safe(out)

    def to_json(self, path: str | Path | None = None, **kwargs) -> str:
        """The result as strict JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False, **kwargs)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: Mapping) -> "EvalResult":
        """Read back `to_dict()` (keys it adds, such as `verdict`, are ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["intervals"] = {k: (json_number(v[0]), json_number(v[1])) for k, v in kwargs["intervals"].items()}
        return cls(**kwargs)


def _label(name: str) -> str:
    return "bootstrap (approximate)" if name == "bootstrap" else name
