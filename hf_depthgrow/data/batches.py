"""The one data contract: every public function that takes data accepts the same forms.

Accepted forms (`probe`, `stepping_stone`, `train`, `evaluate_delta`, `compare_models`, the
fallback selection and the scaling study all read data through this module):

1. a `datasets.Dataset` (or any map-style `torch.utils.data.Dataset`) of rows;
2. a list (or tuple) of row dicts;
3. a `torch.utils.data.DataLoader`, or any other iterable of batch dicts;
4. one batch dict.

**The rule** that tells a row from a batch looks at the model input a dict carries:
`input_ids` (or `attention_mask`) with 1 dimension is a row, with 2 a batch; `pixel_values` with
3 dimensions is a row, with 4 a batch; `inputs_embeds` 2 vs 3. Python lists count their nesting
the same way. A dict with none of these keys, or with ranks that disagree, is refused with an
error that lists the accepted forms. Datasets are rows; DataLoaders are batches; a list or other
iterable is whatever its first element is, and every element must agree.

One collate per modality: token rows are right-padded to the longest row (`input_ids` with 0,
`attention_mask` with 0, `labels` with -100, so padding is never supervised); image rows are
stacked.

A `document` column (`DOCUMENT_COLUMN`: the file, page or table row each example came from, as
`load_data` writes it for causal-LM blocks) travels with rows and batches and is never given to a
model; `documents_of` reads it back in data order, for statistics that treat a document, not a
block, as the independent unit.

Example:
    ```python
    >>> from hf_depthgrow.data.batches import as_batches, as_rows
    >>> rows = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(5)]
    >>> [b["input_ids"].shape for b in as_batches(rows, batch_size=2)]
    [torch.Size([2, 8]), torch.Size([2, 8]), torch.Size([1, 8])]
    >>> len(as_rows(next(iter(as_batches(rows, batch_size=4)))))
    4
    ```
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

import numpy as np
import torch

from ..losses import DOCUMENT_COLUMN

ACCEPTED_FORMS = (
    "a datasets.Dataset, a list of row dicts, a DataLoader or iterable of batch dicts, or one batch dict "
    "(a row holds input_ids [T] or pixel_values [C, H, W]; a batch input_ids [B, T] or pixel_values [B, C, H, W])"
)
# Model-input keys and the rank they have in one row.
ROW_RANK = {"input_ids": 1, "attention_mask": 1, "pixel_values": 3, "inputs_embeds": 2}
ID_COLUMNS = ("id", "idx", "example_id")
# Columns kept as lists when their values are not numbers (they name examples or documents; never model inputs).
_NAME_COLUMNS = (*ID_COLUMNS, DOCUMENT_COLUMN)
IGNORE_INDEX = -100
_PAD = {"labels": IGNORE_INDEX}  # every other token key pads with 0 (input_ids, attention_mask, token_type_ids)


class DataFormError(TypeError):
    """Data in a form the contract cannot read."""


def _rank(value) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim
    rank = 0
    while isinstance(value, (list, tuple)):
        rank += 1
        if not value:
            break
        value = value[0]
    return rank


def dict_kind(item: Mapping) -> str:
    """`"row"` or `"batch"` for one dict, by the rule in this module's docstring."""
    kinds = {("row" if _rank(item[k]) == rank else "batch" if _rank(item[k]) == rank + 1 else "?")
             for k, rank in ROW_RANK.items() if k in item}
    if len(kinds) == 1 and "?" not in kinds:
        return kinds.pop()
    shapes = {k: tuple(getattr(v, "shape", ())) or f"rank {_rank(v)}" for k, v in item.items() if k in ROW_RANK}
    found = f"model inputs {shapes}" if shapes else f"no model input among its keys {sorted(item)}"
    raise DataFormError(f"cannot tell a row from a batch: the dict has {found}. Accepted: {ACCEPTED_FORMS}.")


def _is_dataset(data) -> bool:
    if isinstance(data, (list, tuple, Mapping, torch.utils.data.DataLoader)):
        return False
    if isinstance(data, torch.utils.data.Dataset):
        return True
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(data, datasets.Dataset)


def data_form(data) -> str:
    """`"rows"`, `"batches"` or `"batch"`: how the contract reads `data` (see the module docstring)."""
    if isinstance(data, Mapping):
        if dict_kind(data) != "batch":
            raise DataFormError(f"one dict given as data must be a batch, but this one is a single row. Accepted: {ACCEPTED_FORMS}.")
        return "batch"
    if _is_dataset(data):
        return "rows"
    if isinstance(data, torch.utils.data.DataLoader):
        return "batches"
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError("the data is empty: no example to read")
        if not all(isinstance(x, Mapping) for x in data):
            raise DataFormError(f"a list of data must hold dicts, got {type(data[0]).__name__}. Accepted: {ACCEPTED_FORMS}.")
        kinds = {dict_kind(x) for x in data}
        if len(kinds) != 1:
            raise DataFormError(f"the list mixes rows and batches. Accepted: {ACCEPTED_FORMS}.")
        return "rows" if kinds == {"row"} else "batches"
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        return "batches"
    raise DataFormError(f"cannot read data of type {type(data).__name__}. Accepted: {ACCEPTED_FORMS}.")


def _as_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return torch.tensor(value)  # Python numbers/lists: float32 / int64, as transformers' collator gives


def collate(rows: Sequence[Mapping]) -> dict:
    """One batch from rows: token rows right-padded (labels with -100), image rows stacked.

    Other string values (e.g. raw text) are dropped; string id and document columns are kept as lists; a `label`/`label_ids` column becomes
    `labels` (as transformers' `default_data_collator` does, so classification sets read as they are).
    """
    if not rows:
        raise ValueError("cannot collate zero rows")
    batch = {}
    for key in rows[0]:
        if key in _NAME_COLUMNS and not isinstance(rows[0][key], (int, np.integer, torch.Tensor)):
            batch[key] = [row[key] for row in rows]  # string ids name the examples (or documents) in reports
            continue
        if isinstance(rows[0][key], str):
            continue
        values = [_as_tensor(row[key]) for row in rows]
        if key in ("label", "label_ids") and "labels" not in rows[0]:
            key = "labels"
        if values[0].ndim >= 1 and key not in ("pixel_values",) and len({v.shape[0] for v in values}) > 1:
            longest = max(v.shape[0] for v in values)
            fill = _PAD.get(key, 0)
            values = [torch.cat([v, v.new_full((longest - v.shape[0], *v.shape[1:]), fill)]) for v in values]
        batch[key] = torch.stack(values)
    return batch


class _RowBatches:
    """Re-iterable batches over rows, in order (what `DataLoader(rows, shuffle=False)` gives, with `collate`)."""

    def __init__(self, rows, batch_size: int, collate_fn):
        self.rows, self.batch_size, self.collate_fn = rows, batch_size, collate_fn

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.rows), self.batch_size):
            stop = min(start + self.batch_size, len(self.rows))
            if hasattr(self.rows, "__getitems__"):  # datasets' batched access
                chunk = self.rows.__getitems__(list(range(start, stop)))
            else:
                chunk = [self.rows[i] for i in range(start, stop)]
            yield self.collate_fn(chunk)


class _FirstBatches:
    """The first `limit` batches of a re-iterable, streamed on every pass (large image batches stay unmaterialised)."""

    def __init__(self, batches, limit: int):
        self.batches, self.limit = batches, limit

    def __len__(self) -> int:
        try:
            return min(len(self.batches), self.limit)
        except TypeError:
            return self.limit

    def __iter__(self):
        return islice(iter(self.batches), self.limit)


def as_batches(data, *, batch_size: int = 8, collate_fn=None, max_batches: int | None = None):
    """A re-iterable of batch dicts from any accepted form.

    Rows are batched in order (`batch_size`, `collate_fn` defaulting to `collate`); batches are
    used as they are (a one-shot iterator is read once and kept, since callers may read it twice);
    one batch dict becomes a list of one batch. `max_batches` keeps the first that many.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if max_batches is not None and (not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1):
        raise ValueError(f"max_batches must be an integer >= 1 or None, got {max_batches!r}")
    form = data_form(data)
    if form == "batch":
        batches = [dict(data)]
    elif form == "rows":
        if len(data) == 0:
            raise ValueError("the data is empty: no example to read")
        batches = _RowBatches(data, batch_size, collate_fn or collate)
    elif isinstance(data, (torch.utils.data.DataLoader, list, tuple)):
        batches = data
    else:  # a one-shot iterator: read once (only what is used) and kept, since callers may read it twice
        return list(data if max_batches is None else islice(iter(data), max_batches))
    return batches if max_batches is None else _FirstBatches(batches, max_batches)


def _unbatch(batch: Mapping) -> list[dict]:
    size = batch_size_of(batch)
    rows = [{} for _ in range(size)]
    for key, value in batch.items():
        items = value if isinstance(value, (torch.Tensor, list, tuple, np.ndarray)) else [value] * size
        for row, item in zip(rows, items):
            row[key] = item
    return rows


def as_rows(data):
    """An indexable sequence of row dicts from any accepted form (datasets and lists of rows as they are)."""
    form = data_form(data)
    if form == "rows":
        return data
    batches = [data] if form == "batch" else data
    rows = [row for batch in batches for row in _unbatch(_checked_batch(batch))]
    if not rows:
        raise ValueError("the data is empty: no example to read")
    return rows


def _checked_batch(batch) -> Mapping:
    if not isinstance(batch, Mapping) or dict_kind(batch) != "batch":
        raise DataFormError(f"an iterable of batches must yield batch dicts. Accepted: {ACCEPTED_FORMS}.")
    return batch


def batch_size_of(batch: Mapping) -> int:
    """Examples in a batch (the leading size of its model input)."""
    for key in (*ROW_RANK, "labels"):
        if key in batch:
            value = batch[key]
            return int(value.shape[0]) if hasattr(value, "shape") else len(value)
    raise DataFormError(f"a batch needs a model input ({', '.join(ROW_RANK)}); got keys {sorted(batch)}")


def _names(values) -> list:
    """Plain Python values (ints, strings) of a column, for grouping."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return np.asarray(values).reshape(-1).tolist()
    return [v.item() if isinstance(v, (torch.Tensor, np.generic)) else v for v in values]


def documents_of(data, column: str = DOCUMENT_COLUMN) -> list | None:
    """The `column` value (by default the document) of every example of `data`, in data order; `None` if it has none.

    Reads any accepted form. A `datasets.Dataset` is read by column (no rows are collated); other forms row by row
    or batch by batch. Every example must carry the column when the first one does.

    Example:
        ```python
        >>> documents_of([{"input_ids": torch.arange(4), "document": 3}, {"input_ids": torch.arange(4), "document": 5}])
        [3, 5]
        ```
    """
    form = data_form(data)
    if form == "rows" and hasattr(data, "column_names"):  # a datasets.Dataset: read the column alone
        return _names(data.with_format(None)[column]) if column in data.column_names else None
    if form == "rows":
        first = data[0]
        if column not in first:
            return None
        return _names([data[i][column] for i in range(len(data))])
    out: list = []
    for batch in ([data] if form == "batch" else as_batches(data)):
        batch = _checked_batch(batch)
        if column not in batch:
            if out:
                raise ValueError(f"some batches carry a {column!r} column and some do not")
            return None
        out.extend(_names(batch[column]))
    return out


def to_device(batch: Mapping, device) -> dict:
    """The batch's tensors on `device` (other values unchanged)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
