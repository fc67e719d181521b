"""One check of a batch against a model, run before any forward pass that could fail on it.

A tokenizer that does not match the model, labels outside its head, or sequences longer than a
learned position table (GPT-2's 1024) otherwise surface as a raw `IndexError` (or a CUDA device
assert) deep inside an embedding or the loss. The probe,
stepping stones, trainer, evaluator and `load_data` all call `check_batch`, so the same data
fails the same way everywhere. It costs a max/min per tensor.

Example:
    ```python
    >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
    >>> model = tiny_model("llama")
    >>> check_batch(model, tiny_inputs(model), where="the probe data")
    ```
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..losses import IGNORE_INDEX, is_causal_lm
from .batches import as_batches

__all__ = ["check_batch", "position_limit", "vocab_sizes"]

# Names of learned position tables (GPT-2 and GPT-Neo `wpe`, BERT/RoBERTa/ViT-free encoders, OPT/BART).
_LEARNED_POSITIONS = ("wpe", "position_embeddings", "embed_positions")
_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> position_limit(model), found once


def vocab_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """Input embeddings and output vocabulary of a model (`None` where it has none, e.g. a ViT)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n_in = getattr(emb, "num_embeddings", None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n_out = getattr(out, "out_features", None) or getattr(model.config, "vocab_size", None)
    return n_in, n_out


def position_limit(model: nn.Module) -> tuple[int | None, bool]:
    """`(longest sequence, learned)`: how many positions the model has and whether they are a learned table.

    A learned table (GPT-2's `wpe`) has no row past its end: a longer sequence is an `IndexError` in the
    embedding. RoPE and other computed positions run on, but were not trained past `max_position_embeddings`.
    RoBERTa's table starts after its padding index and OPT's after an offset of 2; both are subtracted.
    """
    if model in _LIMITS:
        return _LIMITS[model]
    limit = getattr(model.config, "max_position_embeddings", None)  # GPT-2's n_positions too (attribute_map)
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    learned = False
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _LEARNED_POSITIONS:
            pad = module.padding_idx
            rows = module.num_embeddings - int(getattr(module, "offset", 0) or 0) - (pad + 1 if pad is not None else 0)
            limit, learned = (rows if limit is None else min(limit, rows)), True
            break
    _LIMITS[model] = (limit, learned)
    return limit, learned


def _check_length(model: nn.Module, input_ids: torch.Tensor, where: str) -> None:
    if input_ids.dim() < 2:
        return
    length = int(input_ids.shape[-1])
    limit, learned = position_limit(model)
    if limit is None or length <= limit:
        return
    name = type(model).__name__
    if learned:
        raise ValueError(
            f"{where}: sequences of {length} tokens, but {name} has {limit} learned positions: use block_size <= {limit}"
        )
    # Not `where`: the message stays the same from batch to batch, so Python shows it once.
    warnings.warn(
        f"sequences of {length} tokens exceed the max_position_embeddings={limit} of {name}: positions past "
        f"{limit} were never trained (use block_size <= {limit} unless the model is meant to extrapolate)",
        stacklevel=3,
    )


def _rows(mask: torch.Tensor, ids: Sequence | None) -> list:
    """The first 10 examples (by id, else by position in the batch) where `mask` holds."""
    rows = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero().flatten().tolist()[:10] if mask.dim() else []
    return [ids[r] for r in rows] if ids is not None else rows


def _examples(mask: torch.Tensor, ids: Sequence | None) -> str:
    return f" in examples {_rows(mask, ids)}"


def _tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _check_token_ids(input_ids: torch.Tensor, n_in: int, ids, where: str) -> None:
    if input_ids.is_floating_point():
        raise ValueError(f"{where}: input_ids must be integer token ids, got dtype {input_ids.dtype}")
    bad = (input_ids >= n_in) | (input_ids < 0)
    if bad.any():
        raise ValueError(
            f"{where}: token ids outside the vocabulary: max id {int(input_ids.max())}, min id {int(input_ids.min())}, "
            f"but the model embeds {n_in}{_examples(bad, ids)}: the tokenizer does not match the model."
        )


def _check_lm_labels(labels: torch.Tensor, n_out: int | None, ids, where: str, every_example: bool) -> None:
    if labels.is_floating_point():
        raise ValueError(f"{where}: causal-LM labels must be token ids, got dtype {labels.dtype}")
    supervised = labels != IGNORE_INDEX
    bad = supervised & ((labels >= (n_out or math.inf)) | (labels < 0))
    if bad.any():
        raise ValueError(
            f"{where}: label ids outside the output vocabulary: max id {int(labels[supervised].max())}, but the model "
            f"predicts {n_out}{_examples(bad, ids)}: the tokenizer does not match the model."
        )
    if every_example and labels.dim() == 2:
        # The label at position 0 is never predicted (the shift), so an example needs one after it.
        empty = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1) == 0
        if empty.any():
            raise ValueError(
                f"{where}: examples {_rows(empty, ids)} have no supervised token (all labels after the first "
                f"are {IGNORE_INDEX}): their loss is undefined. Drop them or fix the labels."
            )


def _check_class_labels(labels: torch.Tensor, num_labels: int | None, ids, where: str) -> None:
    if labels.is_floating_point():
        raise ValueError(f"{where}: classification labels must be integer classes, got dtype {labels.dtype} (regression is not supported)")
    bad = (labels < 0) | (labels >= (num_labels or math.inf))
    if bad.any():
        raise ValueError(f"{where}: labels outside 0..{num_labels - 1} (the model's classes){_examples(bad, ids)}")


def check_batch(
    model: nn.Module, batch: Mapping, *, where: str, ids: Sequence | None = None, every_example_supervised: bool = False
) -> None:
    """Raise `ValueError` naming `where` and the examples if `model` cannot score `batch`.

    Checks that `labels` exist, that sequences fit a learned position table (and warns once where they
    exceed the `max_position_embeddings` of computed positions such as RoPE), that token ids fit the input
    embedding, that causal-LM label ids fit the output vocabulary and that class labels fit `num_labels`. `ids` names the examples (default: their
    position in the batch); `every_example_supervised` also refuses a causal-LM example with no
    supervised token (per-example losses need one; a token-weighted mean does not).
    """
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(
            f"{where} has no 'labels' (keys: {sorted(batch)}): the loss needs them. "
            "Causal LMs take labels = input_ids (-100 where unsupervised); classifiers an int class per example."
        )
    labels = _tensor(labels)
    n_in, n_out = vocab_sizes(model)
    if batch.get("input_ids") is not None:
        _check_length(model, _tensor(batch["input_ids"]), where)
        if n_in is not None:
            _check_token_ids(_tensor(batch["input_ids"]), n_in, ids, where)
    if is_causal_lm(model):
        _check_lm_labels(labels, n_out, ids, where, every_example_supervised)
    else:
        _check_class_labels(labels, getattr(model.config, "num_labels", None), ids, where)


def checked_batches(model: nn.Module, data, *, name: str, where: str, batch_size: int, max_batches: int | None = None) -> list[dict]:
    """`data` (any form of `data.batches`) read into batches, each checked against `model` before any work.

    `name` names the data in the "yielded no batches" error, `where` in each batch's (e.g. "the data").
    """
    batches = list(as_batches(data, batch_size=batch_size, max_batches=max_batches))
    if not batches:
        raise ValueError(f"{name} yielded no batches")
    for index, batch in enumerate(batches):
        check_batch(model, batch, where=f"{where} (batch {index})")
    return batches
