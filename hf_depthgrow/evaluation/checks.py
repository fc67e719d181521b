"""Everything checked before the first forward pass: data form, labels, vocabularies, supervision, settings.

Data is read only through the package's one data contract (`hf_depthgrow.data.batches`): a
Dataset or list of rows is batched in order, a DataLoader or list of batch dicts is used as it is,
and one batch dict is one batch. Every batch is checked for every model before any model runs, so
a wrong tokenizer or label set fails in a second, naming the examples, not deep inside a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..data.batches import ID_COLUMNS, DataFormError, as_batches, batch_size_of, dict_kind
from ..data.checks import check_batch as _check_data_batch
from ..data.checks import vocab_sizes
from ..losses import DOCUMENT_COLUMN, is_causal_lm


def split_batch(batch: Mapping) -> tuple[dict, object | None]:
    """The model tensors of a batch (labels included) and its optional id column.

    Numeric arrays and nested lists (a batch dict written by hand) become tensors; other values,
    such as raw text, are left out, and so is the document column (read by `batch_column`).
    """
    if not isinstance(batch, Mapping) or dict_kind(batch) != "batch":
        raise DataFormError(
            f"the evaluation batches must be batch dicts (input_ids [B, T] or pixel_values [B, C, H, W]), got "
            f"{'a single row' if isinstance(batch, Mapping) else type(batch).__name__}"
        )
    ids = next((batch[k] for k in ID_COLUMNS if k in batch), None)
    tensors = {}
    for key, value in batch.items():
        if key in ID_COLUMNS or key == DOCUMENT_COLUMN:
            continue
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, (np.ndarray, list, tuple)):
            array = np.asarray(value)
            if array.dtype.kind in "biuf":  # bool, int, unsigned, float: model input; strings are not
                tensors[key] = torch.as_tensor(array)
    return tensors, ids


def _column_values(batch: Mapping, key: str, size: int) -> list | None:
    if key not in batch:
        return None
    value = batch[key]
    values = np.asarray(value).reshape(-1).tolist() if isinstance(value, (torch.Tensor, np.ndarray)) else list(value)
    if len(values) != size:
        raise ValueError(f"the {key!r} column of a batch has {len(values)} values for {size} examples")
    return values


def resolve_cluster_key(cluster_key: str | None, has_column) -> str | None:
    """The column that names each example's document: `"auto"` is `"document"` where the data has it (else none);
    `None`/`"none"` is none; any other name must be a column of the data (`has_column(name)`), else `ValueError`."""
    if cluster_key is None or cluster_key == "none":
        return None
    if cluster_key == "auto":
        return DOCUMENT_COLUMN if has_column(DOCUMENT_COLUMN) else None
    if not has_column(cluster_key):
        raise ValueError(f"cluster key {cluster_key!r} is not a column of the data: no example names a {cluster_key!r} to resample by")
    return cluster_key


def cluster_labels(documents: list | None, cluster_key: str | None) -> list | None:
    """The labels a bootstrap resamples by: `documents`, except under `"auto"` where they name fewer than 2 documents
    (one document leaves nothing to resample: its blocks are then resampled, as without documents) and under
    `None` (no clusters). A key named explicitly is used as it is (one document then fails in the bootstrap)."""
    if documents is None or cluster_key is None or cluster_key == "none":
        return None
    if cluster_key == "auto" and len(set(documents)) < 2:
        return None
    return documents


def check_batch(model: nn.Module, batch: dict, ids: list, causal: bool, name: str) -> None:
    """Raise `ValueError` naming the examples if `model` cannot score `batch` (the one check every caller shares)."""
    _check_data_batch(model, batch, where=f"the evaluation data for {name}", ids=ids, every_example_supervised=True)


def prepare_batches(models: dict[str, nn.Module], data, batch_size: int, example_ids: Sequence | None) -> tuple[object, list]:
    """Check every batch for every model before any forward pass; return the batches and the example ids.

    Example ids come from `example_ids`, else an `id`/`idx`/`example_id` column, else the position.
    """
    return batches_and_documents(models, data, batch_size, example_ids, None)[:2]


def batches_and_documents(models: dict[str, nn.Module], data, batch_size: int, example_ids: Sequence | None,
                          cluster_key: str | None = "auto") -> tuple[object, list, list | None, str | None]:
    """`prepare_batches`, and each example's document: `(batches, ids, documents, key)`.

    `cluster_key` names the column holding the document (`resolve_cluster_key`: `"auto"` takes `"document"` where
    the batches carry it); `documents` is `None` without one. A named column that some batch lacks is a
    `ValueError` before any forward pass.
    """
    batches = as_batches(data, batch_size=batch_size)
    causal = is_causal_lm(next(iter(models.values())))
    all_ids: list = []
    documents: list | None = None
    key = None
    count = 0
    for number, batch in enumerate(batches):
        tensors, id_col = split_batch(batch)
        size = batch_size_of(tensors)
        if number == 0:
            key = resolve_cluster_key(cluster_key, lambda name: name in batch)
            documents = [] if key is not None else None
        if key is not None:
            values = _column_values(batch, key, size)
            if values is None:
                raise ValueError(f"cluster key {key!r}: batch {number} of the data has no {key!r} column")
            documents.extend(values)
        if example_ids is not None:
            ids = list(example_ids[count : count + size])
        elif id_col is not None:
            ids = id_col.tolist() if isinstance(id_col, torch.Tensor) else list(id_col)
        else:
            ids = list(range(count, count + size))
        for name, model in models.items():
            check_batch(model, tensors, ids, causal, name)
        all_ids.extend(ids)
        count += size
    if count == 0:
        raise ValueError("the evaluation data is empty: no example to evaluate.")
    if example_ids is not None and len(example_ids) != count:
        raise ValueError(f"example_ids has {len(example_ids)} entries for {count} examples")
    return batches, all_ids, documents, key


def check_level(delta: float, n_bootstrap: int, seed: int = 0) -> None:
    """`delta` in (0, 1), at least one bootstrap resample, and a seed numpy accepts (>= 0)."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta (the allowed failure probability) must be in (0, 1), got {delta!r}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be >= 1, got {n_bootstrap}")
    if seed < 0:  # numpy's own error ("expected non-negative integer") names no setting
        raise ValueError(f"seed must be >= 0, got {seed}")


def check_same_head(model_a: nn.Module, model_b: nn.Module) -> None:
    """Two models whose losses can be compared: same task, and same vocabulary or classes."""
    if is_causal_lm(model_a) != is_causal_lm(model_b):
        raise ValueError(f"the models have different heads: {type(model_a).__name__} vs {type(model_b).__name__}")
    if is_causal_lm(model_a):
        va, vb = vocab_sizes(model_a)[1], vocab_sizes(model_b)[1]
        if va != vb:
            raise ValueError(f"the models have different output vocabularies ({va} vs {vb}): their losses are not comparable")
    elif getattr(model_a.config, "num_labels", None) != getattr(model_b.config, "num_labels", None):
        raise ValueError(f"the models have different numbers of classes ({model_a.config.num_labels} vs {model_b.config.num_labels})")
