"""Gradient (activation) checkpointing of the layer stack: keep each layer's input, recompute the rest in backward.

Non-reentrant (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`) on purpose. The reentrant
variant returns outputs that need a gradient only if one of its *tensor inputs* does; with frozen
embeddings and a frozen (or cached) prefix the hidden states entering the first new block need none, so
the new block's weights silently get no gradient at all (what users of transformers' reentrant default meet
with frozen embeddings). The non-reentrant variant tracks the parameters used inside, so every trainable
weight gets exactly the gradient it gets without checkpointing.

Why not `model.gradient_checkpointing_enable()`: transformers checkpoints a layer only while it is in
train mode, and the trainer keeps frozen layers in eval mode (dropout off, see `trainable.py`); the
frozen layers above a new block are the ones whose activations dominate when only the new blocks train.
Checkpointing each stack layer from the lowest one that needs a gradient, whatever its mode, and every
adapter block hosted there (adapters run in their host's hooks, outside its `forward`), works for every
family of the table without per-model code and composes with `growth.prefix.start_at`, which replaces
only the layers below that index.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..growth import adapter
from ..growth.towers import resolve_family


def checkpointed_modules(model: nn.Module, start: int = 0) -> list[nn.Module]:
    """The modules `activation_checkpointing` wraps: stack layers `start..` and the adapter blocks they host.

    Example:
        ```python
        >>> grown = grow_depth(tiny_model("llama"), [2])
        >>> len(checkpointed_modules(grown, 2))
        3
        ```
    """
    _, stack, _ = resolve_family(model)
    if not 0 <= start <= len(stack):
        raise ValueError(f"start {start} is outside the layer stack (0..{len(stack)})")
    modules = []
    for layer in list(stack)[start:]:
        modules.append(layer)
        for blocks in adapter.hosted_blocks(layer).values():
            modules.extend(blocks)
    return modules


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, start: int = 0, enabled: bool = True):
    """Inside the context, stack layers `start..` (and their adapters) keep only their inputs for backward.

    Forwards run under the context; their backward may run after it (the recomputation is bound at forward
    time). Values and gradients are those of the plain forward; the cost is one more forward of those layers.
    Run the model with `use_cache=False` (as the trainer does): a key/value cache would grow again in the
    recomputation.

    Args:
        model: A model of a family in `hf_depthgrow.growth.FAMILIES` (grown or not).
        start: The lowest stack index to checkpoint: the lowest layer any gradient flows through
            (below it nothing is saved for backward anyway).
        enabled: `False` makes the context a no-op (so callers need no branch).

    Example:
        ```python
        >>> with activation_checkpointing(grown, lowest_new_index(grown)):
        ...     loss = grown(**batch).loss
        >>> loss.backward()
        ```
    """
    if not enabled:
        yield model
        return
    patched = []
    try:
        for module in checkpointed_modules(model, start):
            if "forward" in module.__dict__:  # already wrapped (nested contexts) or patched by someone else
                continue
            module.forward = _recomputed(module.forward)
            patched.append(module)
        yield model
    finally:
        for module in patched:
            del module.forward
