"""Frozen-prefix computation: run the layers below the lowest new block once, then start there.

When nothing below the lowest inserted block changes, `z = f_bot(x)` is the same for the
original and the grown model and at every training step. `prefix_hidden` computes it with an
early exit (no top layers, no head); `start_at` runs the model from a given layer on a cached
`z`. Both work on the model's own forward (masks, rotary embeddings, caches are built as
usual), so every family in the table is covered without per-model code.

Indices are positions in the current layer stack. Because the prefix contains only original
layers, the same index also serves a model inside `bypass_new_blocks`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .towers import resolve_family
from .record import growth_record
from ..losses import model_inputs


class _Stop(Exception):
    """Raised by the capture hook to end the forward pass early."""


class _Passthrough(nn.Module):
    """Stands in for a skipped layer: returns its hidden-state input unchanged (or `output`, if given)."""

    def __init__(self, layer: nn.Module, output: torch.Tensor | None = None):
        super().__init__()
        self.output = output
        # Families read per-layer attributes in their loop (Llama: `decoder_layer.attention_type`).
        for attr in ("attention_type", "is_sliding", "layer_idx"):
            if hasattr(layer, attr):
                object.__setattr__(self, attr, getattr(layer, attr))

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states if self.output is None else self.output


def lowest_new_index(model: nn.Module) -> int | None:
    """Stack index of the lowest layer that is new or hosts a new block; `None` if not grown.

    Everything below it is original and frozen-able; its input is the prefix to cache.
    """
    record = growth_record(model)
    return record.lowest_changed_layer if record else None


def num_original_below(model: nn.Module, index: int) -> int:
    """How many original layers sit below stack index `index` (the index inside a bypass)."""
    record = growth_record(model)
    return record.num_original_below(index) if record else index


@torch.no_grad()
def prefix_hidden(model: nn.Module, batch: dict, index: int) -> torch.Tensor:
    """The residual stream entering stack layer `index` (before any adapter hosted there).

    Runs only the embeddings and layers `0..index-1`; no gradient. `index == len(stack)` is the
    stream leaving the last layer (what a block on top of the stack, or the final norm, sees).

    Example:
        ```python
        >>> z = prefix_hidden(model, batch, lowest_new_index(model))
        >>> with start_at(model, lowest_new_index(model), z):
        ...     logits = model(**batch).logits
        ```
    """
    _, stack, _ = resolve_family(model)
    _check_index(index, stack)
    captured = {}

    def capture(module, args, kwargs):
        captured["z"] = args[0] if args else kwargs["hidden_states"]
        raise _Stop

    def capture_output(module, args, output):  # index == len(stack): the last layer's own output
        captured["z"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    if index < len(stack):
        handle = stack[index].register_forward_pre_hook(capture, with_kwargs=True, prepend=True)
    else:  # prepend: before a post adapter hosted on the last layer changes the output
        handle = stack[index - 1].register_forward_hook(capture_output, prepend=True)
    try:
        model(**model_inputs(batch))
    except _Stop:
        pass
    finally:
        handle.remove()
    if "z" not in captured:
        raise RuntimeError(f"layer {index} was never called: cannot capture its input")
    return captured["z"].detach()


@contextlib.contextmanager
def start_at(model: nn.Module, index: int, hidden: torch.Tensor):
    """Inside the context, a forward pass skips layers `0..index-1` and feeds `hidden` to layer `index`.

    The model still computes its embeddings and masks from the batch (cheap), so pass the same
    batch that produced `hidden`. Restores the layer stack on exit. `index == len(stack)` skips
    every layer and hands `hidden` to what follows the stack (the final norm and the head).
    """
    _, stack, _ = resolve_family(model)
    _check_index(index, stack)
    skipped = [stack[i] for i in range(index)]
    if index == len(stack):
        try:
            for i, layer in enumerate(skipped):
                stack._modules[str(i)] = _Passthrough(layer, output=hidden if i == index - 1 else None)
            yield model
        finally:
            for i, layer in enumerate(skipped):
                stack._modules[str(i)] = layer
        return

    def inject(module, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = hidden
        return args, kwargs

    # prepend: the cached input must replace the raw input before a hosted adapter sees it.
    handle = stack[index].register_forward_pre_hook(inject, with_kwargs=True, prepend=True)
    try:
        for i, layer in enumerate(skipped):
            stack._modules[str(i)] = _Passthrough(layer)
        yield model
    finally:
        handle.remove()
        for i, layer in enumerate(skipped):
            stack._modules[str(i)] = layer


def _check_index(index: int, stack: nn.ModuleList) -> None:
    if not 0 <= index <= len(stack):
        raise ValueError(f"index {index} is outside the layer stack (0..{len(stack)})")
