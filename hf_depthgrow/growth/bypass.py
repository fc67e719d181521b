"""Running a grown model as the original, with no second copy of the weights.

The evaluator and the trainer compare old and new this way: the new blocks are taken out of
the layer list (native) or switched off (adapter) for the duration of a `with` block.
"""

from __future__ import annotations

import contextlib

from torch import nn

from . import adapter
from .layout import Snapshot
from .record import growth_record
from .towers import resolve_target


@contextlib.contextmanager
def bypass_new_blocks(model: nn.Module):
    """Run a grown model as the original: new blocks are skipped, no weights are copied.

    Inside the context the layer list, layer count, per-layer config lists and KV-cache
    slots are those of the original model; everything is restored on exit, also on error.
    A model that was not grown is yielded unchanged.

    Example:
        ```python
        >>> with bypass_new_blocks(grown):
        ...     old_logits = grown(input_ids).logits
        ```
    """
    record = growth_record(model)
    if not record:
        yield model
        return
    target = resolve_target(model)  # the record names the tower of a nested model
    stack = target.stack
    snapshot = Snapshot.take(model, stack, target)
    adapters = [b for layer in stack for hosted in adapter.hosted_blocks(layer).values() for b in hosted]
    keep = list(record.old_indices)
    try:
        snapshot.use(model, stack, [stack[i] for i in keep], keep)
        for block in adapters:
            block.enabled = False
        yield model
    finally:
        for block in adapters:
            block.enabled = True
        snapshot.restore(model, stack)
