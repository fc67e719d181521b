"""Training data as indexable rows: reading any accepted form, the seeded order, fetching batches.

The trainer needs random access (a seeded permutation per epoch, a prefix cache keyed by row), so
every input goes through `hf_depthgrow.data.batches.as_rows` first, and batches are built from
rows with the contract's one `collate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..data.batches import ACCEPTED_FORMS, DataFormError, as_batches, as_rows, batch_size_of, collate
from ..data.checks import check_batch
from ..losses import IGNORE_INDEX

FIXED_SIZE_MESSAGE = "the prefix cache needs fixed-size rows (pad or block the data); set prefix_cache='off' otherwise"


def training_rows(data, name: str = "train_data", model=None):
    """Indexable rows of `data` (any form `hf_depthgrow.data.batches` accepts), checked before any work.

    Raises `DataFormError` (naming `name` and the accepted forms) for an unreadable form and
    `ValueError` for empty data, rows without `labels`, or (with `model`) token or label ids the
    model cannot score (a tokenizer that does not match it).

    Example:
        ```python
        >>> batch = {"input_ids": torch.ones(4, 8, dtype=torch.long), "labels": torch.ones(4, 8, dtype=torch.long)}
        >>> len(training_rows(batch))
        4
        ```
    """
    if data is None:
        raise ValueError(f"{name} is empty: no example to read")
    try:
        rows = as_rows(data)
    except DataFormError as err:
        raise DataFormError(f"{name}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if len(rows) == 0:
        raise ValueError(f"{name} is empty: no example to read")
    if getattr(rows, "streamed", False):  # checked whole by one pass over the stream, not by random reads
        if model is not None and not rows.checked_against_model:
            rows.check(model)
        return rows
    first = rows[0]
    if not isinstance(first, Mapping):
        raise DataFormError(f"{name}: rows must be dicts of model inputs, got {type(first).__name__}. Accepted: {ACCEPTED_FORMS}.")
    if "labels" not in first:
        raise ValueError(f"{name}: rows need `labels` to train on (found keys {sorted(first)})")
    if model is not None:
        _check_rows(model, rows, name)
    return rows


_CHECKED = ("input_ids", "labels", "label", "label_ids")
_CHUNK = 1024


def _check_rows(model, rows, name: str) -> None:
    """Every row scoreable by `model` before any forward: a mismatched tokenizer is otherwise an IndexError mid-training."""

    def pick(chunk):  # only the checked columns: no pixel stacking
        return collate([{k: row[k] for k in _CHECKED if k in row} for row in chunk])

    for index, batch in enumerate(as_batches(rows, batch_size=_CHUNK, collate_fn=pick)):
        start = index * _CHUNK
        check_batch(model, batch, where=name, ids=range(start, start + batch_size_of(batch)))


def fetch(rows, indices: Sequence[int], *, fixed_size: bool = False) -> dict:
    """Rows `indices` of `rows` as one batch (datasets' batched access when available), via `collate`.

    `fixed_size=True` refuses rows of different shapes (which `collate` would pad) with a `ValueError`.

    Example:
        ```python
        >>> fetch([{"input_ids": torch.arange(4), "labels": torch.arange(4)}] * 3, [0, 2])["input_ids"].shape
        torch.Size([2, 4])
        ```
    """
    indices = [int(i) for i in indices]
    if hasattr(rows, "__getitems__"):
        chosen = rows.__getitems__(indices)
    else:
        chosen = [rows[i] for i in indices]
    if fixed_size:
        _check_fixed_size(chosen)
    return collate(chosen)


def _shape(value) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else np.shape(value)


def _check_fixed_size(rows: Sequence[Mapping]) -> None:
    # `collate` pads token rows to the longest one; a cache keyed by row cannot hold rows whose
    # padded length depends on the batch they land in.
    for key, value in rows[0].items():
        if isinstance(value, str):
            continue
        if any(_shape(row[key]) != _shape(value) for row in rows[1:]):
            raise ValueError(FIXED_SIZE_MESSAGE)


class DataOrder:
    """A seeded permutation per epoch; micro-batch `p` is a fixed list of dataset rows.

    Global micro-batch `p` holds `global_batch` rows; process `r` takes the slice
    `[r * per_device, (r + 1) * per_device)`. Incomplete global batches at an epoch's end are dropped.
    Indexing by a micro-batch counter is what lets a resumed run pick up at the same example.

    Example:
        ```python
        >>> order = DataOrder(10, per_device=2, world=1, seed=0)
        >>> order.batches_per_epoch, len(order.local_indices(0, rank=0))
        (5, 2)
        ```
    """

    def __init__(self, num_rows: int, per_device: int, world: int, seed: int, *, sequential: bool = False):
        # sequential: rows in their own order, for streamed rows, whose shuffle would need the whole corpus
        self.num_rows, self.per_device, self.world, self.seed = num_rows, per_device, world, seed
        self.sequential = sequential
        self.global_batch = per_device * world
        self.batches_per_epoch = num_rows // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the training set has {num_rows} examples, fewer than one global micro-batch "
                f"({per_device} per process x {world} processes)"
            )
        self._epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.arange(self.num_rows) if self.sequential else torch.randperm(self.num_rows, generator=generator)
            self._epoch, self._perm = epoch, perm
        return self._perm

    def global_indices(self, position: int) -> list[int]:
        """The rows of global micro-batch `position` (all processes)."""
        epoch, j = divmod(position, self.batches_per_epoch)
        perm = self._permutation(epoch)
        return perm[j * self.global_batch : (j + 1) * self.global_batch].tolist()

    def local_indices(self, position: int, rank: int) -> list[int]:
        """The rows process `rank` takes from global micro-batch `position`."""
        rows = self.global_indices(position)
        return rows[rank * self.per_device : (rank + 1) * self.per_device]


def selection_rows(num_rows: int, max_examples: int | None, seed: int, *, first: bool = False) -> list[int]:
    """The training rows `L_S` is taken on: all, or a fixed seeded subset of `max_examples` (sorted).

    `first=True` takes the first `max_examples` rows instead (streamed rows: a seeded subset would read the
    whole stream for every evaluation of `L_S`).

    Example:
        ```python
        >>> selection_rows(5, None, seed=0)
        [0, 1, 2, 3, 4]
        ```
    """
    if first and max_examples:
        return list(range(min(max_examples, num_rows)))
    if max_examples and max_examples < num_rows:
        gen = torch.Generator().manual_seed(seed + 7)
        return sorted(torch.randperm(num_rows, generator=gen)[:max_examples].tolist())
    return list(range(num_rows))


def supervised_count(batch: dict, causal: bool) -> int:
    """Supervised units of a batch: shifted non-ignored label tokens (causal LM) or examples."""
    labels = batch["labels"]
    if causal:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    return int(labels.shape[0])


def input_count(batch: dict, causal: bool) -> int:
    """Units a batch feeds the model (for throughput): attended tokens (causal LM) or examples."""
    if not causal:
        return int(batch["labels"].shape[0])
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
