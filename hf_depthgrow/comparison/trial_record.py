"""What a trial is and what it produced: `TrialSpec`, `BudgetScore`, `TrialResult`, and their one serialisation.

`result_entry` / `rebuild_result` are the stored form (JSON-safe meta and float64 arrays, as the trial store and
a trial's checkpoint keep it); `result_text` / `result_from_text` the same as one JSON text, as a Ray trial
reports it. Every float round-trips bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..utils import json_safe
from .arms import Arm

HALVING_RUNGS = (0.25, 0.5)  # shares of a budget where the held-out loss is recorded (and halving may stop a rate)


@dataclass(frozen=True)
class TrialSpec:
    """One trial: an arm, a learning rate, a seed (the data order) and the budgets (optimizer steps) it is scored at.

    Example:
        ```python
        >>> TrialSpec(arm, 1e-3, seed=0, budgets=(20, 40, 80)).name
        'probe:1@lr0.001@seed0'
        ```
    """

    arm: Arm
    learning_rate: float
    seed: int
    budgets: tuple[int, ...]
    warmup_steps: int = 0
    scheduler: str = "cosine"
    decay_ratio: float = 0.2
    rungs: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.arm.name}@lr{self.learning_rate:g}@seed{self.seed}"

    def to_dict(self) -> dict:
        return json_safe({**{f.name: getattr(self, f.name) for f in fields(self)}, "arm": self.arm.to_dict()})  # tuples as lists


@dataclass
class BudgetScore:
    """A trial at one budget: what the fallback rule picked and its losses (per-example on test and retention)."""

    steps: int
    units_seen: int
    heldout_loss: float
    selected: str
    train_losses: dict
    test: np.ndarray
    test_weight: np.ndarray
    retention: np.ndarray | None
    retention_weight: np.ndarray | None
    seconds: float


@dataclass
class TrialResult:
    """What a trial returns: a `BudgetScore` per budget reached, the held-out curve, and the cost.

    `stopped_at` is the rung where successive halving stopped the trial (then `scores` is empty).
    """

    spec: TrialSpec
    scores: dict[int, BudgetScore] = field(default_factory=dict)
    heldout_curve: list[tuple[int, float]] = field(default_factory=list)
    stopped_at: int | None = None
    trainable_parameters: int = 0
    seconds: float = 0.0
    # What the trainer took of the original before its first step (`OriginalLosses`): the engine hands it to the
    # next trial on the same rows, which then skips those passes. Not stored: a stored trial has `None`.
    original_losses: object = field(default=None, compare=False, repr=False)

    def heldout_at(self, step: int) -> float:
        """The held-out loss recorded at `step` (a rung or a budget's end); `nan` if it was not recorded."""
        return next((loss for s, loss in self.heldout_curve if s == step), math.nan)


_ARRAYS = ("test", "test_weight", "retention", "retention_weight")


def result_entry(result: TrialResult) -> tuple[dict, dict]:
    """A result as JSON-safe meta and its per-example arrays as float64 tensors named `<budget>.<array>`."""
    meta = {
        "name": result.spec.name, "stopped_at": result.stopped_at, "trainable_parameters": result.trainable_parameters,
        "seconds": result.seconds, "heldout_curve": [[int(s), float(v)] for s, v in result.heldout_curve],
        "scores": {str(b): {"units_seen": s.units_seen, "heldout_loss": s.heldout_loss, "selected": s.selected,
                            "train_losses": s.train_losses, "seconds": s.seconds} for b, s in result.scores.items()},
    }
    tensors = {}
    for b, s in result.scores.items():
        for name in _ARRAYS:
            value = getattr(s, name)
            if value is not None:
                # A copy: budgets that kept the original share one array, and safetensors refuses shared memory.
                tensors[f"{b}.{name}"] = torch.from_numpy(np.array(value, dtype=np.float64))
    return json_safe(meta), tensors  # non-finite losses (a diverged run) as strings: the entry's JSON is strict


def result_text(result: TrialResult) -> str:
    """A result as one JSON text (the stored entry's meta and arrays), as a Ray trial reports it to the driver.

    Example:
        ```python
        >>> result_from_text(result.spec, result_text(result)).scores[8].heldout_loss == result.scores[8].heldout_loss
        True
        ```
    """
    meta, tensors = result_entry(result)
    return json.dumps({"meta": meta, "arrays": {name: t.tolist() for name, t in tensors.items()}})


def result_from_text(spec: TrialSpec, text: str) -> TrialResult:
    """The `TrialResult` of `spec` that `result_text` wrote."""
    data = json.loads(text)
    return rebuild_result(spec, data["meta"], {name: torch.tensor(v, dtype=torch.float64) for name, v in data["arrays"].items()})


def rebuild_result(spec: TrialSpec, meta: dict, tensors: dict, *, partial: bool = False) -> TrialResult:
    """The `TrialResult` of `spec` that `result_entry` wrote (`partial`: a checkpoint's, missing later budgets)."""
    scores = {}
    for b, s in meta["scores"].items():
        arrays = {n: tensors[f"{b}.{n}"].numpy() if f"{b}.{n}" in tensors else None for n in _ARRAYS}
        scores[int(b)] = BudgetScore(steps=int(b), units_seen=int(s["units_seen"]), heldout_loss=float(s["heldout_loss"]),
                                     selected=s["selected"], train_losses={k: float(v) for k, v in s["train_losses"].items()},
                                     seconds=float(s["seconds"]), **arrays)
    if sorted(scores) != sorted(spec.budgets) and meta["stopped_at"] is None and not partial:
        raise ValueError(f"it holds budgets {sorted(scores)}, not {list(spec.budgets)}")
    return TrialResult(spec, scores, [(int(s), float(v)) for s, v in meta["heldout_curve"]], meta["stopped_at"],
                       int(meta["trainable_parameters"]), float(meta["seconds"]))


