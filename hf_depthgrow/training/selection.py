"""The fallback rule (docs/theory.md §4, Condition 2): keep `f_new` only if it is at least as good on the training rows.

After training, the training loss `L_S` of the trained model `f_new` is compared with that of the
stepping stone `f~_S` (when one was given) and of the original function `f_old`; the best one is
returned. `f_old` needs no copy: restoring the trainable set's starting weights (new blocks at zero
init, LoRA B at zero) gives it back exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from torch import nn

from ..growth.bypass import bypass_new_blocks
from ..growth.prefix import num_original_below
from .deepspeed_support import gathered
from .forward import dataset_loss
from .guards import NonFiniteTrainingLossError
from .prefix_cache import shares_prefix
from .trainable import assign

# Ties go to the earlier entry.
PREFERENCE = ("new", "stepping_stone", "old")


def unpack_stone(stone) -> tuple[nn.Module | None, dict | None]:
    """`(model, JSON-ready summary)` from a stepping-stone model or the `(model, result)` pair `stepping_stone` returns.

    Example:
        ```python
        >>> unpack_stone(None)
        (None, None)
        ```
    """
    if stone is None:
        return None, None
    if isinstance(stone, tuple):
        stone_model, info = stone[0], stone[1] if len(stone) > 1 else None
    else:
        stone_model, info = stone, None
    if not isinstance(stone_model, nn.Module):
        raise ValueError(f"stepping_stone must be a model or (model, result), got {type(stone_model).__name__}")
    summary = None
    if info is not None:
        data = info.to_dict() if hasattr(info, "to_dict") else asdict(info) if hasattr(info, "__dataclass_fields__") else vars(info)
        summary = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool, type(None), list, dict))}
    return stone_model, summary


def pick(losses: dict[str, float], *, exclude: tuple[str, ...] = ()) -> tuple[str, str, float]:
    """`(selected, reference, delta_erm)` from the training losses of `"new"`, `"old"` and maybe `"stepping_stone"`.

    `f_new` unless the stepping stone is better; `f_old` if that is not better either. A candidate
    with a NaN/inf loss, or named in `exclude` (a run stopped on a non-finite training loss), is never
    selected; `NonFiniteTrainingLossError` if no candidate is left. `delta_erm = L_S(reference) - L_S(f_new)`.

    Example:
        ```python
        >>> pick({"new": 2.0, "old": 2.5})
        ('new', 'old', 0.5)
        ```
    """
    if "new" not in losses or "old" not in losses:
        raise ValueError(f"the fallback rule needs the losses of 'new' and 'old', got {sorted(losses)}")
    finite = [k for k in PREFERENCE if k in losses and k not in exclude and math.isfinite(losses[k])]
    if not finite:
        raise NonFiniteTrainingLossError(
            f"the fallback rule has no candidate with a finite training loss ({losses}, excluded: {list(exclude)}): "
            "nothing safe to select"
        )
    selected = min(finite, key=lambda k: (losses[k], PREFERENCE.index(k)))
    reference = "stepping_stone" if "stepping_stone" in losses else "old"
    return selected, reference, losses[reference] - losses["new"]


def stone_cache(cache, model: nn.Module, stone: nn.Module, index: int | None):
    """`cache` if the stepping stone computes the same prefix `z` as the grown model, else `None`."""
    if cache is not None and shares_prefix(model, stone, index):
        return cache
    return None


def candidate_loss(
    which: str, data, rows, *, model: nn.Module, stone: nn.Module | None, peft_model, index: int | None, cache, **loss_kwargs
) -> float:
    """Mean loss of one candidate over `rows` of `data`: `"new"` (the model as it is), `"old"` or `"stone"`.

    `"old"` runs the grown model with its new blocks bypassed and LoRA off (exactly `f_old`);
    `"stone"` runs the stepping stone, from `index` on `cache` only if one is given (see `stone_cache`).
    `loss_kwargs` go to `forward.dataset_loss` (`accelerator`, `causal`, `batch_size`, `progress`, `desc`).

    Example:
        ```python
        >>> candidate_loss("old", rows, range(16), model=grown, stone=None, peft_model=None, index=2, cache=None,
        ...                accelerator=acc, causal=True, batch_size=8)
        4.83
        ```
    """
    if which not in ("new", "old", "stone"):
        raise ValueError(f"which must be 'new', 'old' or 'stone', got {which!r}")
    contexts = []
    if which == "stone":
        base, index = stone, (index if cache is not None else None)
    else:
        base = model
    if which == "old":
        if index is not None:
            index = num_original_below(model, index)  # the same original layer inside the bypass
        contexts.append(bypass_new_blocks(model))
        if peft_model is not None:
            contexts.append(peft_model.disable_adapter())
    return dataset_loss(base, data, rows, cache=cache, index=index, contexts=contexts, **loss_kwargs)


def initial_weights(named) -> dict[str, torch.Tensor]:
    """CPU copies of the trainable set's starting weights (what `selected_model("old", ...)` restores)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in named}


def selected_model(
    selected: str, *, model: nn.Module, stone: nn.Module | None, peft_model, named, initial: dict | None, merge_lora: bool
) -> nn.Module:
    """The model `selected` names: the stepping stone, the grown model back at its starting weights, or the trained one.

    LoRA is removed for the first two, and merged into the weights for `"new"` when `merge_lora`.

    Example:
        ```python
        >>> selected_model("new", model=grown, stone=None, peft_model=None, named=[], initial=None, merge_lora=True) is grown
        True
        ```
    """
    if selected == "stepping_stone":
        if peft_model is not None:
            peft_model.unload()
        return stone
    if selected == "old":
        # Back to the starting weights: new blocks at zero init (and LoRA removed, or in full mode
        # the original weights), i.e. a grown model that computes exactly f_old. ZeRO-3 partitions
        # the parameters: they are gathered whole, written, and re-partitioned (every process).
        with torch.no_grad(), gathered([p for _, p in named], modifier_rank=0):
            for name, param in named:
                assign(param, initial[name])
        if peft_model is not None:
            return peft_model.unload()
        return model
    if peft_model is not None:
        return peft_model.merge_and_unload() if merge_lora else peft_model
    return model
