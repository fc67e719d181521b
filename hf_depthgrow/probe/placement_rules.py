"""Two placement rules from the literature, as predictors of where a new block helps.

Scores follow `probe.baselines`: one score per candidate position k (the index `grow_depth(model, [k])`
inserts at; its native block copies layer `k - 1`, layer 0 for k = 0), **higher = predicted better**, so
an oracle sweep can rank them with the probe's own numbers.

- `adept_scores` (ADEPT, "grow after the layers least important to general ability"): the retention
  loss of the model with the copied layer skipped, minus the full model's, negated. A layer whose
  removal barely hurts the retention set scores near 0 (best); one the model cannot do without scores
  very negative.
- `midas_scores` (MIDAS, LIDAS: "grow in the middle"): `-|k - L/2|`, from the stack's depth alone.

Example:
    ```python
    >>> from hf_depthgrow.probe.placement_rules import adept_scores, midas_scores
    >>> midas_scores(model, [0, 2, 4])  # a 4-layer model
    [-2.0, 0.0, -2.0]
    >>> scores = adept_scores(model, [0, 2, 4], retention_data=python_docs_rows)
    ```
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn

from ..data.batches import to_device
from ..data.checks import checked_batches
from ..growth.checks import check_positions
from ..growth import Snapshot
from ..growth.record import growth_record
from ..growth.towers import resolve_target
from ..chunked_loss import batch_example_losses

__all__ = ["PLACEMENT_RULES", "adept_scores", "midas_rule", "midas_scores", "skipped_layer_losses"]

PLACEMENT_RULES = ("adept", "midas")


def _source(position: int) -> int:
    # The same convention as `baselines.source_layer` (kept local: baselines imports this module).
    return max(position - 1, 0)


def _positions(model: nn.Module, positions) -> tuple[int, list[int]]:
    """`(L, positions)`: the stack depth and the checked positions in the caller's order (`None`: 0..L)."""
    depth = len(resolve_target(model).stack)
    if positions is None:
        return depth, list(range(depth + 1))
    positions = list(positions)
    check_positions(positions, depth)
    return depth, positions


def midas_scores(model: nn.Module, positions: Iterable[int] | None = None) -> list[float]:
    """MIDAS's rule: the middle of the stack is best, `score(k) = -|k - L/2|` (L: the model's layer count).

    Args:
        model: A model of a family `grow_depth` supports (only its depth is read).
        positions: Candidate positions, 0 <= k <= L; `None`: 0..L.

    Returns:
        One score per position, aligned with `positions`; 0 (the best) at k = L/2.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model
        >>> midas_scores(tiny_model("llama"), [0, 1, 2])  # 4 layers: the middle is k = 2
        [-2.0, -1.0, 0.0]
        ```
    """
    depth, positions = _positions(model, positions)
    return midas_rule(depth, positions)


def midas_rule(depth: int, positions: Iterable[int]) -> list[float]:
    """`midas_scores` from the layer count alone, for a model that is not at hand (e.g. a committed run's base).

    Example:
        ```python
        >>> midas_rule(6, [0, 3, 6])
        [-3.0, 0.0, -3.0]
        ```
    """
    positions = list(positions)
    check_positions(positions, depth)
    return [0.0 - abs(k - depth / 2) for k in positions]  # 0.0 - : no -0.0 at the middle


@contextlib.contextmanager
def _without_layer(model: nn.Module, index: int):
    """Run the model with layer `index` taken out of its stack (configs and layer indices follow); restored on exit."""
    target = resolve_target(model)
    stack = target.stack
    snapshot = Snapshot.take(model, stack, target)
    keep = [i for i in range(len(stack)) if i != index]
    try:
        snapshot.use(model, stack, [stack[i] for i in keep], keep)
        yield model
    finally:
        snapshot.restore(model, stack)


def _mean_loss(model: nn.Module, batches: list[dict], device) -> float:
    total, weight = 0.0, 0.0
    for batch in batches:
        losses = batch_example_losses(model, to_device(batch, device))
        total += float((losses.per_example.double() * losses.weight.double()).sum())
        weight += float(losses.weight.double().sum())
    if weight == 0:
        raise ValueError("the retention data has no supervised token (every label is -100)")
    return total / weight


@torch.no_grad()
def skipped_layer_losses(model: nn.Module, retention_data, layers: Iterable[int] | None = None, *, batch_size: int = 8,
                         max_batches: int | None = None) -> dict:
    """The retention loss of the full model and with each of `layers` skipped (token-weighted means).

    Args:
        model: An ungrown model of a family `grow_depth` supports; left as it was (training mode included).
        retention_data: General-domain rows with `labels`, any form of `hf_depthgrow.data.batches`.
        layers: Stack indices to skip one at a time; `None`: every layer.
        batch_size, max_batches: How rows are batched, and how many batches are read.

    Returns:
        `{"full": float, "skipped": {layer: float}}`.

    Example:
        ```python
        >>> out = skipped_layer_losses(model, retention_rows, [0, 3])
        >>> out["skipped"][3] - out["full"]  # what removing layer 3 costs
        0.41
        ```
    """
    if growth_record(model):
        raise ValueError("skipped_layer_losses scores an ungrown model's own layers; this model was grown (score the original)")
    depth = len(resolve_target(model).stack)
    layers = sorted(set(range(depth) if layers is None else layers))
    bad = [j for j in layers if not (isinstance(j, int) and 0 <= j < depth)]
    if bad:
        raise ValueError(f"layers {bad} are outside the stack (0..{depth - 1})")
    batches = checked_batches(model, retention_data, name="retention_data", where="the retention data", batch_size=batch_size,
                              max_batches=max_batches)
    device, was_training = next(model.parameters()).device, model.training
    model.eval()
    try:
        full = _mean_loss(model, batches, device)
        skipped = {}
        for j in layers:
            with _without_layer(model, j):
                skipped[j] = _mean_loss(model, batches, device)
    finally:
        model.train(was_training)
    return {"full": full, "skipped": skipped}


def adept_scores(model: nn.Module, positions: Iterable[int] | None = None, *, retention_data=None, batch_size: int = 8,
                 max_batches: int | None = None) -> list[float]:
    """ADEPT's rule: grow after the layers whose removal least hurts general ability.

    `score(k) = -(L_ret(model without layer k-1) - L_ret(model))` (layer 0 for k = 0, the layer the new
    block copies), so the position whose source layer matters least to the retention set scores highest.

    Args:
        model: An ungrown model of a family `grow_depth` supports; left as it was.
        positions: Candidate positions, 0 <= k <= L; `None`: 0..L.
        retention_data: General-domain rows with `labels` (the set forgetting is measured on), any form of
            `hf_depthgrow.data.batches`. Required.
        batch_size, max_batches: How rows are batched, and how many batches are read.

    Returns:
        One score per position (usually <= 0), aligned with `positions`.

    Example:
        ```python
        >>> adept_scores(model, [1, 4], retention_data=python_docs_rows)
        [-0.93, -0.12]
        ```
    """
    if retention_data is None:
        raise ValueError("the 'adept' rule scores layer removal on a retention set: pass retention_data")
    _, positions = _positions(model, positions)
    out = skipped_layer_losses(model, retention_data, {_source(k) for k in positions}, batch_size=batch_size, max_batches=max_batches)
    return [-(out["skipped"][_source(k)] - out["full"]) for k in positions]
