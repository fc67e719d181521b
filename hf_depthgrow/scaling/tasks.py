"""The study's tasks: seeded train / held-out / test rows, and fresh models of each `(depth, width)`.

Rows are lists of dicts of tensors (`pixel_values`/`labels` for the ViT, `input_ids`/
`attention_mask`/`labels` for the character LM): the shape `hf_depthgrow.data.batches` batches,
and that `hf_depthgrow.training.train` indexes.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..growth.towers import resolve_family
from .config import TaskGrid


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


def cell_device() -> torch.device:
    """Where this process computes its cells: its own GPU (`LOCAL_RANK` under a launcher), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def load_task_data(grid: TaskGrid, seed: int) -> TaskData:
    """Rows for the largest training size; smaller sizes are prefixes of the same seeded order.

    Example:
        ```python
        >>> grid = TaskGrid(task="vit", dataset="digits", patch_size=4, data_sizes=[300], heldout_size=150, test_size=200)
        >>> data = load_task_data(grid, seed=0)
        >>> len(data.train), data.train[0]["pixel_values"].shape
        (300, torch.Size([1, 8, 8]))
        ```
    """
    return _vision_data(grid, seed) if grid.task == "vit" else _shakespeare_data(grid, seed)


def _vision_data(grid: TaskGrid, seed: int) -> TaskData:
    from ..data.corpora import digits, fashion_mnist

    n_train = max(grid.data_sizes)
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


def _shakespeare_data(grid: TaskGrid, seed: int) -> TaskData:
    from ..data.corpora import shakespeare_texts

    n_train = max(grid.data_sizes)
    works = shakespeare_texts()
    vocab = "".join(sorted(set("".join(works))))
    index = {c: i for i, c in enumerate(vocab)}
    rng = random.Random(seed)
    order = list(range(len(works)))
    rng.shuffle(order)
    # Whole works go to test and held-out so that no passage leaks across splits.
    span = grid.block_size + 1  # + 1: the model's own label shift wants block_size predictions

    def blocks(text_ids, count):
        starts = list(range(0, len(text_ids) - span, span))
        rng.shuffle(starts)
        return [text_ids[s : s + grid.block_size] for s in starts[:count]]

    def take(count, pool):
        out = []
        while pool and len(out) < count:
            ids = [index[c] for c in works[pool.pop(0)]]
            out.extend(blocks(ids, count - len(out)))
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
    """D of the power law: images, or predicted tokens (block_size - 1 per block).

    Example:
        ```python
        >>> data_amount(TaskGrid(task="lm", block_size=64), 300)
        18900
        ```
    """
    return n if grid.task == "vit" else n * (grid.block_size - 1)


def build_model(grid: TaskGrid, data: TaskData, depth: int, width: int, seed: int) -> nn.Module:
    """A fresh model of the grid's family at `(depth, width)`, seeded, dropout off (the study measures the mechanism).

    Example:
        ```python
        >>> model = build_model(grid, load_task_data(grid, 0), depth=2, width=32, seed=0)
        >>> model.config.num_hidden_layers, model.config.hidden_size
        (2, 32)
        ```
    """
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
    """N of the power law: parameters of the layer stack (embeddings, final norm and head excluded).

    Example:
        ```python
        >>> non_embedding_parameters(model) == sum(p.numel() for p in model.vit.encoder.layer.parameters())
        True
        ```
    """
    _, stack, _ = resolve_family(model)
    return sum(p.numel() for p in stack.parameters())
