"""Look-ahead predictors: grow a copy at k and actually move the new block, a little.

- `lookahead_scores`: per position, train only the new block of a grown copy for a few optimizer
  steps (from the cached prefix) and score the held-out loss drop. Costs (L+1) short training runs,
  but measures the quantity the oracle sweep measures, only earlier.
- `one_step_check`: the first-order prediction `-lr * ||g||^2` of one plain SGD step of the new
  block against the realized loss change on the same batch; their ratio tends to 1 as `lr -> 0`,
  and how far it is from 1 at a useful `lr` shows how far the first-order signal can be trusted.

Example:
    ```python
    >>> from hf_depthgrow.probe.lookahead import lookahead_scores
    >>> scores = lookahead_scores(model, train_rows, [0, 2, 4], eval_data=held_out, steps=8)
    ```
"""

from __future__ import annotations

import copy
import gc
import math
import random

import numpy as np
import torch
from torch import nn

from ..data.batches import as_rows, to_device
from ..data.checks import checked_batches
from ..growth.engine import grow_depth, new_block_parameters
from ..losses import example_losses, is_causal_lm, labels_of, model_inputs
from ..utils import check_int
from .capture import checked_positions, forward_kwargs
from .signal import NO_SUPERVISION, supervised_units

__all__ = ["lookahead_scores", "one_step_check"]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():  # the copy trained on the accelerator's device, wherever `model` is
        torch.cuda.empty_cache()


class _KeepRandomState:
    """`train` seeds every global generator (Python, NumPy, torch); the caller's streams are put back after."""

    def __enter__(self):
        self.python, self.numpy = random.getstate(), np.random.get_state()
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return self

    def __exit__(self, *exc):
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def lookahead_scores(model: nn.Module, data, positions, *, eval_data, steps: int = 8, learning_rate: float = 1e-3,
                     batch_size: int = 8, seed: int = 0, progress: bool = False) -> list[float]:
    """Per position k, the held-out loss drop after `steps` optimizer steps of a new block at k alone.

    For each k a deep copy of `model` is grown at `[k]` (`grow_depth` defaults) and trained with
    `hf_depthgrow.training.train` (only the new block, AdamW, constant learning rate, no fallback, nothing
    saved; the frozen prefix cached in memory for k > 0). The score is `eval_loss_before -
    eval_loss_after` on `eval_data`: higher = the block helped more. The copy is freed before the next
    position; `model` and the caller's random streams are left as they were.

    Args:
        model: A model of a family `grow_depth` supports.
        data: Training data, any form of `hf_depthgrow.data.batches`, with `labels` (read once, reused per position).
        positions: Candidate positions, 0 <= k <= L, in the order the scores come back; `None`: 0..L.
        eval_data: Held-out data (same forms) the loss drop is measured on.
        steps: Optimizer steps per position.
        learning_rate: AdamW learning rate (constant).
        batch_size: Examples per step (and per evaluation batch).
        seed: Seed of the data order; the same seed gives the same scores.
        progress: A progress bar over the positions.

    Returns:
        One loss drop per position, aligned with `positions`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> rows = [tiny_inputs(model, seed=s) for s in range(4)]
        >>> scores = lookahead_scores(model, rows, [2, 4], eval_data=tiny_inputs(model, seed=9), steps=2)
        >>> len(scores)
        2
        ```
    """
    from tqdm.auto import tqdm

    from ..training import train  # pulls in accelerate: imported on use

    check_int("steps", steps, 1)
    _, positions = checked_positions(model, positions)
    # Read once: a one-shot iterator would be spent after the first position.
    rows, eval_rows = as_rows(data), as_rows(eval_data)
    drops: dict[int, float] = {}
    with _KeepRandomState():
        for k in tqdm(list(dict.fromkeys(positions)), disable=not progress, desc="look-ahead", unit="position"):
            grown = grow_depth(copy.deepcopy(model), [k])
            result = train(
                grown, rows, eval_data=eval_rows, max_steps=steps, learning_rate=learning_rate,
                per_device_train_batch_size=batch_size, seed=seed, fallback=False, save_final_model=False,
                progress_bar=False, prefix_cache="memory" if k > 0 else "off", lr_scheduler="constant",
            )
            drops[k] = float(result.eval_loss_before) - float(result.eval_loss_after)
            del grown, result
            _free()
    return [drops[k] for k in positions]


def _loss_sum(model: nn.Module, batches: list[dict], kwargs: dict, causal: bool) -> torch.Tensor:
    """The summed head loss over `batches` (a graph to differentiate, or not, as the caller's context says)."""
    return sum(example_losses(model(**model_inputs(b), **kwargs).logits, labels_of(b), causal=causal).total.sum()
               for b in batches)


def one_step_check(model: nn.Module, data, position: int, *, learning_rate: float = 1e-2, batch_size: int = 8,
                   max_batches: int = 1) -> dict:
    """The first-order predicted loss change of one SGD step of a new block at `position`, against the realized one.

    A deep copy of `model` is grown at `[position]`; `g` is the gradient of the mean loss over the first
    `max_batches` batches of `data` with respect to the new block's parameters, at zero init. The
    prediction for the step `theta <- -learning_rate * g` is `-learning_rate * ||g||^2`; the step is
    taken and `realized = loss after - loss before` on the same batches (eval mode, no dropout).
    `ratio = realized / predicted` tends to 1 as `learning_rate -> 0` (NaN when `g = 0`).

    Args:
        model: A model of a family `grow_depth` supports; not changed (a copy is grown).
        data: Any form of `hf_depthgrow.data.batches`, with `labels`.
        position: Insertion point k, 0 <= k <= L.
        learning_rate: The SGD step size.
        batch_size, max_batches: How rows are batched, and how many batches the loss is taken on.

    Returns:
        `{"position", "predicted", "realized", "ratio"}` (losses are means: per token or per example).

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> check = one_step_check(model, tiny_inputs(model), 2, learning_rate=1e-3)
        >>> abs(check["ratio"] - 1) < 0.05
        True
        ```
    """
    if isinstance(position, bool) or not isinstance(position, int):
        raise ValueError(f"position must be an int, got {position!r}")
    checked_positions(model, [position])
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
            math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    batches = checked_batches(model, data, name="data", where="the data", batch_size=batch_size, max_batches=max_batches)
    causal = is_causal_lm(model)
    weight = sum(supervised_units(labels_of(b), causal) for b in batches)
    if weight == 0:
        raise ValueError(NO_SUPERVISION.replace("the probe data", "the data"))
    grown = grow_depth(copy.deepcopy(model), [position]).eval()
    params = [p for _, p in new_block_parameters(grown)]
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    device, kwargs = params[0].device, forward_kwargs(grown)
    batches = [to_device(b, device) for b in batches]
    with torch.enable_grad():
        loss_sum = _loss_sum(grown, batches, kwargs, causal)
        grads = torch.autograd.grad(loss_sum / weight, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    squared = sum(float(g.double().square().sum()) for g in grads)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(learning_rate * g)
        after = float(_loss_sum(grown, batches, kwargs, causal)) / weight
    # Both means divided the same way (in float64), so the difference carries no rounding of its own.
    before = float(loss_sum.detach()) / weight
    predicted, realized = -learning_rate * squared, after - before
    del grown
    return {"position": position, "predicted": predicted, "realized": realized,
            "ratio": realized / predicted if predicted != 0 else math.nan}
