"""Running a model on training rows: per-example losses of a batch and the mean loss over rows.

Both paths take an optional prefix cache: with one, the model runs from stack layer `index` on the
cached `z` (`hf_depthgrow.growth.prefix.start_at`), which computes what the full forward computes.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from ..chunked_loss import model_example_losses
from ..data.batches import to_device
from ..growth.prefix import start_at
from ..losses import ExampleLosses, model_inputs
from .data_order import fetch


def batch_losses(
    module: nn.Module, base: nn.Module, batch: dict, rows: Sequence[int], cache, index: int | None, *, accelerator, causal: bool,
    chunk_size="auto",
) -> ExampleLosses:
    """Per-example losses of `module` (a wrapper of `base` or `base` itself) on a batch of rows `rows`.

    A causal LM's loss is chunked over tokens where the vocabulary makes the logits large
    (`hf_depthgrow.chunked_loss`, `chunk_size`: "auto", tokens per chunk, or `None` for the plain path).

    Example:
        ```python
        >>> el = batch_losses(model, model, batch, [0, 1], None, None, accelerator=acc, causal=True)
        >>> el.total.shape
        torch.Size([2])
        ```
    """
    inputs = model_inputs(batch)
    if causal:
        inputs["use_cache"] = False
    if accelerator.distributed_type in ("FSDP", "DEEPSPEED"):
        chunk_size = None  # the head's weight is sharded outside the wrapped forward: only the plain path reads it there
    ctx = start_at(base, index, cache.get(rows, accelerator.device)) if cache is not None else contextlib.nullcontext()
    with ctx, accelerator.autocast():
        # The body runs through `module`'s own forward, so `start_at`'s hooks on the layer stack still apply.
        return model_example_losses(base, inputs, batch["labels"], causal=causal, chunk_size=chunk_size, module=module)


@torch.no_grad()
def dataset_loss(
    base: nn.Module,
    data,
    rows: Sequence[int],
    *,
    accelerator,
    causal: bool,
    batch_size: int,
    cache=None,
    index: int | None = None,
    contexts: Sequence = (),
    progress: bool = True,
    desc: str = "loss",
    chunk_size="auto",
) -> float:
    """Token-weighted (causal LM) or per-example mean loss of `base` over rows `rows` of `data`, shared between processes.

    `contexts` are entered around the pass (e.g. `bypass_new_blocks(model)` to compute `f_old`).

    Example:
        ```python
        >>> dataset_loss(model, rows, range(len(rows)), accelerator=acc, causal=True, batch_size=8)
        4.83
        ```
    """
    from tqdm.auto import tqdm

    acc = accelerator
    world, rank, bs = acc.num_processes, acc.process_index, batch_size
    totals = torch.zeros(2, dtype=torch.float64, device=acc.device)
    was_training = base.training
    base.eval()
    bar = tqdm(total=len(rows), desc=desc, unit="ex", leave=False, disable=not (progress and acc.is_main_process))
    try:
        with contextlib.ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx)
            for start in range(0, len(rows), bs * world):
                mine = list(rows[start + rank * bs : start + (rank + 1) * bs])
                # Every process runs the same number of forwards (sharded models gather weights
                # in each one): a process without rows runs a repeated row and counts nothing.
                valid = len(mine)
                run = mine or [rows[0]]
                batch = to_device(fetch(data, run), acc.device)
                el = batch_losses(base, base, batch, run, cache, index, accelerator=acc, causal=causal, chunk_size=chunk_size)
                if valid:
                    totals += torch.stack([el.total.sum().double(), el.weight.sum().double()])
                bar.update(min(len(rows) - start, bs * world))
    finally:
        base.train(was_training)
        bar.close()
    totals = acc.reduce(totals, reduction="sum") if world > 1 else totals
    return float(totals[0] / totals[1].clamp_min(1))
