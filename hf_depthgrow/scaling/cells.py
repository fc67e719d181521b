"""One cell of the study: train from scratch, probe, grow at the best position, train the block, evaluate.

Both trainings go through `hf_depthgrow.training.train`, the package's one training loop: the base
model with `trainable="full"` (no fallback: there is no earlier function to fall back to), the
grown model with the default new-blocks-only set and the fallback rule against `f_old`.

Each training gets an `Accelerator` of its own process. Under `torchrun` / `accelerate launch` the
study gives every process *different* cells; a default `Accelerator` would read the launcher's
environment, join a process group and wrap each model in DDP across processes that hold different
models (a hang, or gradients averaged across unrelated cells). `local_accelerator` builds it with
that environment hidden, on this process's device.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import warnings

import numpy as np
import torch
from torch import nn

from ..growth.engine import grow_depth
from ..training import TrainConfig, TrainResult, train
from .config import TaskGrid
from .tasks import TaskData, build_model, data_amount, non_embedding_parameters

# What launchers set (torchrun, accelerate launch, MPI) and what makes an Accelerator distributed,
# sharded or mixed-precision behind our back.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")
_LAUNCHER_PREFIXES = ("ACCELERATE_", "FSDP_")

EVAL_BATCH_SIZE = 256  # held-out and selection losses: no gradients, so large batches are cheap
TEST_BATCH_SIZE = 128


@contextlib.contextmanager
def _launcher_hidden(device: torch.device):
    saved = {k: v for k, v in os.environ.items() if k in _LAUNCHER_VARIABLES or k.startswith(_LAUNCHER_PREFIXES)}
    for key in saved:
        del os.environ[key]
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    try:
        yield
    finally:
        os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        os.environ.update(saved)


def local_accelerator(device: torch.device | str = "cpu"):
    """An `accelerate.Accelerator` for this process alone on `device`, whatever a launcher set (fp32, no DDP).

    Example:
        ```python
        >>> acc = local_accelerator("cpu")
        >>> acc.num_processes, acc.device
        (1, device(type='cpu'))
        ```
    """
    from accelerate import Accelerator

    device = torch.device(device)
    with _launcher_hidden(device):
        return Accelerator(cpu=device.type == "cpu", mixed_precision="no")


def train_config(grid: TaskGrid, n: int, *, grown: bool, seed: int) -> TrainConfig:
    """The `TrainConfig` of a cell's base model (`grown=False`) or of its new block (`grown=True`).

    AdamW with gradient clipping at 1, 5% linear warm-up then cosine decay to 0, `grid.batch_size`
    examples per step (at most `n`), a held-out evaluation every `grid.eval_every` steps. The trainer
    keeps the *last* weights (it has no best-checkpoint selection); the grown model then goes through
    the fallback rule on a seeded subset of `grid.selection_examples` training examples.

    Example:
        ```python
        >>> train_config(grid, 300, grown=True, seed=0).trainable
        'new'
        ```
    """
    steps = grid.grow_steps if grown else grid.train_steps
    return TrainConfig(
        trainable="new" if grown else "full",
        max_steps=steps,
        learning_rate=grid.grow_learning_rate if grown else grid.learning_rate,
        weight_decay=0.0 if grown else grid.weight_decay,
        lr_scheduler="cosine",
        warmup_steps=max(1, steps // 20),
        per_device_train_batch_size=min(grid.batch_size, n),
        per_device_eval_batch_size=EVAL_BATCH_SIZE,
        max_grad_norm=1.0,
        mixed_precision="no",
        seed=seed + 1 if grown else seed,
        eval_steps=grid.eval_every,
        logging_steps=grid.eval_every,
        progress_bar=False,
        # A base model has nothing frozen; a grown one caches z below the new block (exact, faster).
        prefix_cache="auto" if grown else "off",
        fallback=grown,
        selection_max_examples=grid.selection_examples if grown else None,
        save_final_model=False,
    )


def _train(model: nn.Module, config: TrainConfig, train_rows: list[dict], heldout: list[dict], device) -> TrainResult:
    # A fresh accelerator per training, dropped afterwards: it holds on to every model it prepared.
    # (Not `free_memory()`: its full `gc.collect()` took half of a tiny cell's time.)
    return train(model, train_rows, config=config, eval_data=heldout, accelerator=local_accelerator(device))


def run_cell(grid: TaskGrid, data: TaskData, depth: int, width: int, n: int, *, seed: int, device="cpu") -> dict:
    """Train, probe, grow, train the new block, select, evaluate: one grid cell, as a JSON-ready dict.

    Example:
        ```python
        >>> grid = TaskGrid(task="vit", dataset="digits", patch_size=4, depths=[1], widths=[16], data_sizes=[300],
        ...                 heldout_size=150, test_size=200, train_steps=30, grow_steps=15)
        >>> row = run_cell(grid, load_task_data(grid, 0), 1, 16, 300, seed=0)
        >>> row["growth"]["position"] == row["probe"]["positions"][int(np.argmax(row["probe"]["z"]))]
        True
        ```
    """
    from ..data.batches import as_batches
    from ..evaluation.paired import compare_models
    from ..probe.signal import probe

    start = time.perf_counter()
    train_rows = data.train[:n]
    model = build_model(grid, data, depth, width, seed)
    base_config = train_config(grid, n, grown=False, seed=seed)
    base = _train(model, base_config, train_rows, data.heldout, device)
    model = base.model
    for p in model.parameters():
        p.requires_grad_(False)  # the probe takes gradients with respect to activations only

    # Probe on the training data the model saw (G_S), every position 0..L.
    probe_rows = train_rows[: grid.probe_batches * grid.probe_batch_size]
    result = probe(model, as_batches(probe_rows, batch_size=grid.probe_batch_size), progress=False, covariance=True)
    z = [float(v) for v in result.z]
    best_k = int(result.positions[int(np.nanargmax(z))])

    grown = copy.deepcopy(model)
    grow_depth(grown, [best_k], seed=seed)
    grow_config = train_config(grid, n, grown=True, seed=seed)
    grow = _train(grown, grow_config, train_rows, data.heldout, device)
    # The fallback rule (docs/theory.md §4) decided on training losses; f_old is the base model itself, so the
    # paired delta of a fallback is exactly 0.
    chosen = grow.model if grow.selected == "new" else model
    with warnings.catch_warnings():
        # The study reports the paired bootstrap interval; the Hoeffding/Bernstein caveat about a data-derived B is noise here.
        warnings.filterwarnings("ignore", message="loss_bound not given")
        ev = compare_models(model, chosen, as_batches(data.test, batch_size=TEST_BATCH_SIZE), metrics=False,
                            use_evaluate=False, seed=seed)
    boot = ev.intervals.get("bootstrap") if isinstance(ev.intervals, dict) else None
    return {
        "task": grid.task,
        "dataset": grid.dataset,
        "depth": depth,
        "width": width,
        "data_size": n,
        "D": data_amount(grid, n),
        "N": non_embedding_parameters(model),
        "N_grown": non_embedding_parameters(grown),
        "seed": seed,
        "base": _training_record(base, base_config.per_device_train_batch_size),
        "probe": _probe_record(result, z),
        "growth": {"position": best_k, **_training_record(grow, grow_config.per_device_train_batch_size),
                   "train_loss_old": grow.train_losses["old"], "train_loss_new": grow.train_losses["new"],
                   "selected": "f_new" if grow.selected == "new" else "f_old", "delta_erm": grow.delta_erm},
        "test": {"loss_base": float(ev.loss_old), "loss_grown": float(ev.loss_new), "delta": float(ev.delta),
                 "bootstrap": list(boot) if boot is not None else None, "num_examples": int(ev.num_examples)},
        "seconds": time.perf_counter() - start,
    }


def _floats(values) -> list:
    return [None if v is None or not math.isfinite(float(v)) else float(v) for v in values]


def _training_record(result: TrainResult, batch_size: int) -> dict:
    """Held-out curve and training losses of one `train` call (the last weights, as the trainer returns them)."""
    steps = [e["step"] for e in result.eval_history]
    return {
        "heldout_loss": result.eval_loss_selected,
        "steps": steps,
        "curve": _floats(e["eval_loss"] for e in result.eval_history),
        "train_curve": _floats(h["loss"] for h in result.history),
        "epochs": result.global_step * batch_size / result.num_train_examples,
        "train_seconds": result.train_runtime,
    }


def _probe_record(result, z: list[float]) -> dict:
    return {
        "positions": [int(k) for k in result.positions],
        "signal": _floats(result.signal),
        "population": _floats(result.population),
        "population_se": _floats(result.population_se),
        "z": _floats(z),
        "offdiag_share": _floats(result.offdiag_share),
        "stable_rank": _floats(result.stable_rank),
        "improvable": [bool(v) for v in result.improvable],
        "loss": float(result.loss),
    }
