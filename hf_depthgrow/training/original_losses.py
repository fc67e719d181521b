"""The original's losses a trainer takes before its first step, handed on to the next trainer of the same original.

Every run starts from the original function (a grown model at init, an untouched copy, LoRA at zero), so
its step-0 held-out loss and the fallback rule's `L_S(f_old)` are the same for every run on the same data:
the growth and its control in `hf-depthgrow run`, every arm and learning rate of `compare_plans`. Each
costs a pass over its rows; `OriginalLosses` lets the second run skip both. The data they were taken on
travels with them (`key`), and a trainer refuses losses taken on other rows, so a reuse can make a run
cheaper but never change what it is compared with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .guards import data_fingerprint


@dataclass(frozen=True)
class OriginalLosses:
    """The original model's mean losses on one trainer's rows: what `GrownTrainer(original_losses=...)` reuses.

    Attributes:
        held_out: Mean loss on the held-out rows before the first step (`eval_history[0]`), or `None` without eval data.
        train: `L_S(f_old)` on the fallback rule's selection rows, or `None` with `fallback=False`.
        key: Fingerprints of the training data, the held-out data and the selection rows they were taken on.

    Example:
        ```python
        >>> growth = train(grown, rows, eval_data=held_out, max_steps=20)
        >>> control = train(copy_of_original, rows, eval_data=held_out, max_steps=20, trainable="lora",
        ...                 original_losses=growth.original_losses)   # skips two passes over the data
        ```
    """

    held_out: float | None
    train: float | None
    key: dict

    def to_dict(self) -> dict:
        return {"held_out": self.held_out, "train": self.train, "key": self.key}


def losses_key(train_rows, eval_rows, selection: list[int] | None) -> dict:
    """What identifies the rows the original's losses are taken on (cheap: a sample of rows is hashed)."""
    rows = hashlib.sha256(json.dumps(selection).encode()).hexdigest()[:16] if selection is not None else None
    return {
        "train": data_fingerprint(train_rows),
        "held_out": data_fingerprint(eval_rows) if eval_rows is not None else None,
        "selection_rows": rows,
    }


def check_reuse(given, key: dict, *, needs_held_out: bool, needs_train: bool) -> OriginalLosses | None:
    """`given` if its losses were taken on the rows `key` names and hold what this run needs, else `ValueError`.

    Example:
        ```python
        >>> check_reuse(None, key, needs_held_out=True, needs_train=True) is None
        True
        ```
    """
    if given is None:
        return None
    if not isinstance(given, OriginalLosses):
        raise ValueError(f"original_losses must be an OriginalLosses (a TrainResult's .original_losses), got {type(given).__name__}")
    for part, what in (("train", "training data"), ("held_out", "held-out data"), ("selection_rows", "selection rows")):
        if given.key.get(part) != key[part]:
            raise ValueError(
                f"original_losses were taken on other {what} ({given.key.get(part)} against this run's {key[part]}): "
                "reuse them only for a run on the same data and selection settings"
            )
    missing = [n for n, need, v in (("held_out", needs_held_out, given.held_out), ("train", needs_train, given.train)) if need and v is None]
    if missing:
        raise ValueError(f"original_losses lack {' and '.join(missing)}, which this run needs")
    return given
