"""Train grown models on Accelerate: the new blocks only, + LoRA, or everything (THEORY §4).

The loop is written out (no `transformers.Trainer`) because three things need control over it:

- Frozen-prefix caching. When nothing below the lowest inserted block trains, `z = f_bot(x)` is the
  same at every step, so it is computed once per training example (up front, keyed by dataset
  row) and each step runs only `f_top` through `prefix.start_at`.
- An exact, layout-independent loss. A step's loss is the token-weighted mean over the *global*
  batch (all processes, all accumulation micro-batches; `losses.py`), so 1 process x 4 examples and
  2 processes x 2 examples take the same optimizer step, and caching changes nothing but speed.
- The fallback rule (Condition 2): at the end the training loss `L_S` of the trained model is
  compared with that of the stepping stone (or of the original model) and the better one returned.

Data order is a seeded permutation per epoch, indexed by a micro-batch counter, so a resumed run
picks up at the same example without replaying the loader and ends at bit-identical weights.

Frozen modules run in eval mode (dropout off): that makes the frozen prefix a fixed function, so the
cached and uncached paths compute the same thing. Only modules that own trainable weights (the new
blocks, LoRA layers; everything with `trainable="full"`) run in train mode.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

from ..growth.families import resolve_family
from ..growth.engine import bypass_new_blocks, growth_record, new_block_modules, new_block_parameters
from ..losses import IGNORE_INDEX, ExampleLosses, example_losses, is_causal_lm, model_inputs
from ..growth.prefix import lowest_new_index, num_original_below, prefix_hidden, start_at
from ..utils import atomic_write_text
from .config import TrainConfig

CHECKPOINT_PREFIX = "checkpoint-"
TRAINABLE_WEIGHTS = "trainable.safetensors"
TRAINER_STATE = "trainer_state.json"
FINAL_MODEL = "model"
STOP_EXIT_CODE = 17  # what `stop_after_step` exits with, so a test can tell it from a crash

_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- results


@dataclass
class TrainResult:
    """What `train` returns; `to_dict()` is what `<output_dir>/train_result.json` holds.

    Attributes:
        model: The selected model (unwrapped, on the training device): the trained one, the stepping
            stone, or the original function (see `selected`).
        selected: `"new"`, `"stepping_stone"` or `"old"`. With `fallback=False` always `"new"`.
        train_losses: Training loss `L_S` of each candidate on the same examples
            (`"new"`, `"old"`, and `"stepping_stone"` when one was given).
        reference: The model `Delta_ERM` is measured against: `"stepping_stone"` if given, else `"old"`.
        delta_erm: `L_S(reference) - L_S(f_new)`; `>= 0` whenever `f_new` is selected.
        global_step: Optimizer steps done.
        history: One dict per logged step (`step`, `loss`, `lr`, `grad_norm`, `tokens_per_s` or `examples_per_s`).
        eval_history: `{"step", "eval_loss"}` on the held-out split (step 0 is before training).
        eval_loss_selected: Held-out loss of the selected model.
        num_train_examples: Size `n` of the training set; `num_selection_examples` of the rows `L_S` is taken on.
        prefix_cache: Mode, dtype, index, size and build time of the cache, or `None` if off.
    """

    model: nn.Module
    selected: str = "new"
    train_losses: dict[str, float] = field(default_factory=dict)
    reference: str | None = None
    delta_erm: float | None = None
    global_step: int = 0
    history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    eval_loss_selected: float | None = None
    train_runtime: float = 0.0
    units_seen: int = 0
    unit: str = "tokens"
    num_trainable_parameters: int = 0
    trainable: str = "new"
    num_train_examples: int = 0
    num_selection_examples: int = 0
    num_processes: int = 1
    prefix_cache: dict | None = None
    stepping_stone: dict | None = None
    resumed_from: str | None = None
    model_path: str | None = None

    def to_dict(self) -> dict:
        # Not `asdict`: it would deep-copy the model.
        return {key: copy.deepcopy(getattr(self, key)) for key in self.__dataclass_fields__ if key != "model"}


# --------------------------------------------------------------------------- data helpers


def _fetch(dataset, indices: Sequence[int]) -> dict:
    """Rows `indices` of `dataset` stacked into a batch (datasets' batched access when available)."""
    indices = [int(i) for i in indices]
    if hasattr(dataset, "__getitems__"):
        rows = dataset.__getitems__(indices)
    else:
        rows = [dataset[i] for i in indices]
    rows = [{k: v for k, v in row.items() if isinstance(v, (torch.Tensor, int, float, np.ndarray))} for row in rows]
    return default_collate(rows)


class _DataOrder:
    """A seeded permutation per epoch; micro-batch `p` is a fixed list of dataset rows.

    Global micro-batch `p` holds `global_batch` rows; process `r` takes the slice
    `[r * per_device, (r + 1) * per_device)`. Incomplete global batches at an epoch's end are dropped.
    """

    def __init__(self, num_rows: int, per_device: int, world: int, seed: int):
        self.num_rows, self.per_device, self.world, self.seed = num_rows, per_device, world, seed
        self.global_batch = per_device * world
        self.batches_per_epoch = num_rows // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the training set has {num_rows} examples, fewer than one global micro-batch "
                f"({per_device} per process x {world} processes)"
            )
        self._epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_rows, generator=generator)
        return self._perm

    def global_indices(self, position: int) -> list[int]:
        epoch, j = divmod(position, self.batches_per_epoch)
        perm = self._permutation(epoch)
        return perm[j * self.global_batch : (j + 1) * self.global_batch].tolist()

    def local_indices(self, position: int, rank: int) -> list[int]:
        rows = self.global_indices(position)
        return rows[rank * self.per_device : (rank + 1) * self.per_device]


def _supervised_count(batch: dict, causal: bool) -> int:
    labels = batch["labels"]
    if causal:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    return int(labels.shape[0])


def _input_count(batch: dict, causal: bool) -> int:
    if not causal:
        return int(batch["labels"].shape[0])
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


# --------------------------------------------------------------------------- prefix cache


class _MemoryRows:
    """Cache rows in one CPU tensor."""

    def __init__(self, shape, dtype):
        self.tensor = torch.empty(shape, dtype=dtype)
        self.dtype, self.path = dtype, None

    def write(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self.tensor.index_copy_(0, ids, values.to(self.dtype))

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        return self.tensor.index_select(0, torch.as_tensor(list(ids), dtype=torch.long))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        self.tensor = None


class _FileRows:
    """Cache rows in a flat file, read and written with pread/pwrite.

    Not memory-mapped on purpose: mapped pages would count as the process's resident memory, while
    read pages stay in the kernel's page cache, which gives them back under pressure.
    """

    def __init__(self, path: Path, shape, dtype, *, create: bool):
        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        if create:
            with contextlib.suppress(OSError):
                path.unlink()
        self.fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o600)
        if create:
            os.ftruncate(self.fd, shape[0] * self.row_bytes)

    def write(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        raw = values.to(self.dtype).contiguous().view(torch.uint8).reshape(len(ids), self.row_bytes)
        for i, row in zip(ids.tolist(), raw):
            os.pwrite(self.fd, row.numpy().tobytes(), i * self.row_bytes)

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        buf = bytearray(len(ids) * self.row_bytes)
        for j, i in enumerate(ids):
            buf[j * self.row_bytes : (j + 1) * self.row_bytes] = os.pread(self.fd, self.row_bytes, int(i) * self.row_bytes)
        return torch.frombuffer(buf, dtype=self.dtype).view(len(ids), *self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def flush(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


_CACHE_COUNTER = iter(range(1_000_000))


class PrefixCache:
    """`z = f_bot(x)` for every row of a dataset, indexed by row; in memory or spilled to a file.

    Build it with `PrefixCache.build`; `get(rows)` returns the stacked `z` of those rows in the dtype the
    prefix produced, so a step on cached `z` computes what an uncached step computes (exactly, with the
    default storage dtype).
    """

    def __init__(self, rows, compute_dtype: torch.dtype, index: int, *, owner: bool = True):
        self.rows, self.compute_dtype, self.index, self.owner = rows, compute_dtype, index, owner

    @property
    def path(self) -> Path | None:
        return self.rows.path

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def get(self, rows: Sequence[int], device) -> torch.Tensor:
        return self.rows.read(rows).to(device=device, dtype=self.compute_dtype)

    def close(self) -> None:
        """Free the memory, or close and delete the file (its writer deletes it)."""
        self.rows.close()
        if self.path is not None and self.owner:
            with contextlib.suppress(OSError):
                self.path.unlink()

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        model: nn.Module,
        dataset,
        index: int,
        *,
        accelerator,
        batch_size: int,
        storage: str = "memory",
        dtype: str = "auto",
        directory: str | os.PathLike | None = None,
        progress: bool = True,
        desc: str = "prefix cache",
    ) -> "PrefixCache":
        """Run the frozen prefix once over `dataset` (work shared between processes, rows gathered).

        `model` is the unwrapped model; it is run under no_grad and the accelerator's autocast, as a
        training step would run it. With `storage="disk"` the node's local main process writes the
        file under `directory`; the other processes of the node read it.
        """
        from tqdm.auto import tqdm

        n = len(dataset)
        world, rank = accelerator.num_processes, accelerator.process_index
        device = accelerator.device
        causal = is_causal_lm(model)
        writer = storage == "memory" or accelerator.is_local_main_process
        store = compute_dtype = None
        path = None
        if storage == "disk":
            # One name agreed by all processes of a run: the launcher's pid (parent of every rank) or our own.
            run_id = os.getppid() if world > 1 else os.getpid()
            path = Path(directory) / f"prefix-{run_id}-{next(_CACHE_COUNTER)}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=n, desc=desc, unit="ex", disable=not (progress and accelerator.is_main_process), leave=False)
        was_training = model.training
        model.eval()
        try:
            for start in range(0, n, batch_size * world):
                mine = list(range(start + rank * batch_size, min(start + (rank + 1) * batch_size, n)))
                # Every process runs the same number of equally-shaped batches (gather needs it):
                # pad with a repeated row, marked -1 so nobody stores it.
                rows = mine + [mine[-1] if mine else 0] * (batch_size - len(mine))
                ids = torch.tensor(mine + [-1] * (batch_size - len(mine)), device=device)
                batch = {k: v.to(device) for k, v in _fetch(dataset, rows).items()}
                inputs = {**batch, "use_cache": False} if causal else batch
                with accelerator.autocast():
                    z = prefix_hidden(model, inputs, index)
                if world > 1:
                    z, ids = accelerator.gather(z.contiguous()), accelerator.gather(ids)
                keep = ids >= 0
                z, ids = z[keep].cpu(), ids[keep].cpu()
                if store is None:
                    compute_dtype = z.dtype
                    store_dtype = compute_dtype if dtype == "auto" else _STORAGE_DTYPES[dtype]
                    shape = (n, *z.shape[1:])
                    if storage == "memory":
                        store = _MemoryRows(shape, store_dtype)
                    elif writer:
                        store = _FileRows(path, shape, store_dtype, create=True)
                if writer:
                    store.write(ids, z)
                bar.update(int(keep.sum()))
        except RuntimeError as err:
            if "stack expects each tensor to be equal size" in str(err) or "Sizes of tensors must match" in str(err):
                raise ValueError(
                    "the prefix cache needs fixed-size rows (pad or block the data); set prefix_cache='off' otherwise"
                ) from err
            raise
        finally:
            bar.close()
            model.train(was_training)
        if storage == "disk":
            if writer:
                store.flush()
            accelerator.wait_for_everyone()
            if not writer:
                store = _FileRows(path, shape, store_dtype, create=False)
        return cls(store, compute_dtype, index, owner=writer)


def shares_prefix(model: nn.Module, other: nn.Module, index: int) -> bool:
    """True when `other` computes the same `z` entering stack layer `index` as `model`.

    Sufficient check: the same layer layout below `index` and bit-identical weights and buffers there
    and outside the layer stack (embeddings; also head and final norm, which is stricter than needed).
    """
    try:
        _, _, path_a = resolve_family(model)
        _, _, path_b = resolve_family(other)
    except ValueError:
        return False
    low = lowest_new_index(other)
    if path_a != path_b or (low is not None and low < index):
        return False
    pattern = re.compile(re.escape(path_a) + r"\.(\d+)\.")

    def prefix_part(module):
        out = {}
        for name, tensor in module.state_dict().items():
            m = pattern.match(name)
            if m is None or int(m.group(1)) < index:
                out[name] = tensor
        return out

    a, b = prefix_part(model), prefix_part(other)
    if a.keys() != b.keys():
        return False
    return all(a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


# --------------------------------------------------------------------------- trainable sets


def lora_target_names(model: nn.Module, suffixes: Sequence[str] | None = None) -> list[str]:
    """Full names of the linear layers LoRA adapts in `"new+lora"`: original layers above the lowest insertion.

    New blocks (native layers and adapters) are excluded: they train in full.
    """
    from transformers.pytorch_utils import Conv1D

    record = growth_record(model)
    _, stack, path = resolve_family(model)
    cut = record.lowest_insertion_point  # original layers from here up sit above a new block
    native = set(record.native_indices)
    names = []
    for i in range(cut, len(stack)):
        if i in native:
            continue
        for name, module in stack[i].named_modules():
            if ".depthgrow_" in f".{name}" or not isinstance(module, (nn.Linear, Conv1D)):
                continue
            if suffixes and not any(name == s or name.endswith("." + s) for s in suffixes):
                continue
            names.append(f"{path}.{i}.{name}")
    return names


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or "norm" in name.lower()


# --------------------------------------------------------------------------- the trainer


class GrownTrainer:
    """Trains a model grown by `grow_depth` (see the module docstring for what it guarantees).

    Args:
        model: A grown transformers model (`growth_record(model)` is set). `trainable="full"` also takes
            an ungrown model (used to train a base model first).
        config: A `TrainConfig`.
        train_dataset: Rows of model inputs with `labels` (e.g. from `hf_depthgrow.data.sources.load_data`);
            anything indexable returning dicts of tensors.
        eval_dataset: Held-out rows for evaluation every `eval_steps`.
        stepping_stone: The stepping-stone model `f~_S` for the fallback rule, or the
            `(model, SteppingStoneResult)` pair `hf_depthgrow.probe.stepping_stone` returns.
        tokenizer: Saved beside the final model.
        accelerator: An `accelerate.Accelerator` to use; by default one is made from the config.

    The model is changed in place (LoRA is injected into it, merged or removed at the end);
    `train()` returns a `TrainResult` whose `.model` is the selected model.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth
        >>> from hf_depthgrow.training.trainer import GrownTrainer
        >>> from hf_depthgrow.training.config import TrainConfig
        >>> grow_depth(model, [2])
        >>> result = GrownTrainer(model, TrainConfig(max_steps=50), train_ds, eval_ds).train()
        >>> result.selected, result.delta_erm
        ('new', 0.031)
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        *,
        stepping_stone=None,
        tokenizer=None,
        accelerator=None,
    ):
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError("train_dataset is empty")
        self.config = config or TrainConfig()
        self.model = model
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.tokenizer = tokenizer
        self.stone, self.stone_info = self._unpack_stone(stepping_stone)
        self._accelerator = accelerator
        self.record = growth_record(model)
        if self.config.trainable != "full" and not self.record:
            raise ValueError(
                f"trainable={self.config.trainable!r} trains the inserted blocks, but the model is not grown: "
                "call hf_depthgrow.grow_depth first (or use trainable='full')."
            )
        if self.stone is not None and not self.record:
            raise ValueError("a stepping stone is only meaningful for a grown model")

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _unpack_stone(stone):
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

    def _make_accelerator(self):
        if self._accelerator is not None:
            return self._accelerator
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=self.config.ddp_timeout))]
        return Accelerator(mixed_precision=self.config.mixed_precision, kwargs_handlers=handlers)

    def _setup_trainable(self) -> None:
        cfg, model = self.config, self.model
        full = cfg.trainable == "full"
        for param in model.parameters():
            param.requires_grad_(full)
        self.peft_model = None
        if cfg.trainable == "new+lora":
            from peft import LoraConfig, get_peft_model

            targets = lora_target_names(model, cfg.lora_target_modules)
            if not targets:
                raise ValueError(
                    "trainable='new+lora' found no linear layer of an original layer above the lowest insertion "
                    f"(lora_target_modules={cfg.lora_target_modules}); use trainable='new'."
                )
            lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets, bias="none")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*task_type.*")
                # Injects into `model` in place (it stays the module we run); the wrapper is kept for merging.
                self.peft_model = get_peft_model(model, lora)
        if not full:
            for _, param in new_block_parameters(model):
                param.requires_grad_(True)
        self.trainable_named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.trainable_named:
            raise ValueError("nothing to train: the trainable set is empty")
        # Modules that run in train mode; everything else stays in eval mode (see module docstring).
        if full:
            self.train_modules = [model]
        else:
            self.train_modules = list(new_block_modules(model))
            if self.peft_model is not None:
                from peft.tuners.lora import LoraLayer

                self.train_modules += [m for m in model.modules() if isinstance(m, LoraLayer)]

    def _set_train_mode(self, training: bool) -> None:
        self.model.eval()
        if training:
            for module in self.train_modules:
                module.train()

    def _resolve_prefix_cache(self) -> str:
        cfg = self.config
        from accelerate.utils import DistributedType

        sharded = self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        valid = cfg.trainable != "full" and self.prefix_index is not None
        if cfg.prefix_cache == "off":
            return "off"
        if cfg.prefix_cache == "auto":
            if not valid or sharded or self.prefix_index == 0:
                return "off"  # nothing frozen below, sharded wrappers, or nothing to skip
            return "memory"
        if not valid:
            raise ValueError("prefix_cache needs a frozen prefix below the new blocks")
        if sharded:
            raise ValueError("prefix_cache is not supported under FSDP/DeepSpeed; use prefix_cache='off' or 'auto'")
        return cfg.prefix_cache

    def _cache_dir(self) -> Path:
        cfg = self.config
        if cfg.prefix_cache_dir:
            return Path(cfg.prefix_cache_dir)
        if cfg.output_dir:
            return Path(cfg.output_dir) / "prefix_cache"
        return Path(tempfile.gettempdir()) / "hf_depthgrow_prefix_cache"

    def _build_cache(self, dataset, mode: str, desc: str) -> PrefixCache | None:
        if mode == "off" or dataset is None:
            return None
        if mode == "memory" and self.config.prefix_cache == "auto":
            mode = self._memory_or_disk(dataset)
        cache = PrefixCache.build(
            self.model,
            dataset,
            self.prefix_index,
            accelerator=self.accelerator,
            batch_size=self.config.prefix_cache_batch_size or self.eval_batch_size,
            storage=mode,
            dtype=self.config.prefix_cache_dtype,
            directory=self._cache_dir(),
            progress=self.config.progress_bar,
            desc=desc,
        )
        return cache

    def _memory_or_disk(self, dataset) -> str:
        """`auto` spills to disk when the cache would take more than a third of the free memory."""
        probe = {k: v[:1] for k, v in _fetch(dataset, [0]).items()}
        hidden = getattr(self.model.config, "hidden_size", None) or 0
        seq = probe["input_ids"].shape[-1] if "input_ids" in probe else 0
        if not hidden or not seq:
            return "memory"
        dtype = self.config.prefix_cache_dtype
        size = 2 if dtype in ("bfloat16", "float16") else 4
        need = len(dataset) * seq * hidden * size
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return "memory"
        return "disk" if need > free / 3 else "memory"

    # ------------------------------------------------------------------ losses

    def _losses(self, module: nn.Module, base: nn.Module, batch: dict, rows, cache: PrefixCache | None, index: int | None) -> ExampleLosses:
        """Per-example losses of `module` (a wrapper of `base` or `base` itself) on a batch."""
        inputs = model_inputs(batch)
        if self.causal:
            inputs["use_cache"] = False
        ctx = start_at(base, index, cache.get(rows, self.accelerator.device)) if cache is not None else contextlib.nullcontext()
        with ctx, self.accelerator.autocast():
            logits = module(**inputs).logits
        return example_losses(logits, batch["labels"], causal=self.causal)

    @torch.no_grad()
    def _dataset_loss(
        self, dataset, rows: Sequence[int], *, which: str = "new", cache: PrefixCache | None = None, desc: str = "loss"
    ) -> float:
        """Token-weighted (causal LM) or per-example mean loss over `rows`, shared between processes.

        `which`: `"new"` (the model as it is), `"old"` (new blocks bypassed, LoRA off) or `"stone"`.
        """
        from tqdm.auto import tqdm

        acc = self.accelerator
        world, rank, bs = acc.num_processes, acc.process_index, self.eval_batch_size
        if which == "stone":
            base, index = self.stone, (self.prefix_index if cache is not None else None)
        else:
            base, index = self.model, self.prefix_index
        totals = torch.zeros(2, dtype=torch.float64, device=acc.device)
        was_training = base.training
        base.eval()
        bar = tqdm(total=len(rows), desc=desc, unit="ex", leave=False,
                   disable=not (self.config.progress_bar and acc.is_main_process))
        try:
            with contextlib.ExitStack() as ctx:
                if which == "old":
                    if index is not None:
                        index = num_original_below(self.model, index)  # the same original layer inside the bypass
                    ctx.enter_context(bypass_new_blocks(self.model))
                    if self.peft_model is not None:
                        ctx.enter_context(self.peft_model.disable_adapter())
                for start in range(0, len(rows), bs * world):
                    mine = list(rows[start + rank * bs : start + (rank + 1) * bs])
                    # Every process runs the same number of forwards (sharded models gather weights
                    # in each one): a process without rows runs a repeated row and counts nothing.
                    valid = len(mine)
                    run = mine or [rows[0]]
                    batch = self._to_device(_fetch(dataset, run))
                    el = self._losses(base, base, batch, run, cache, index)
                    if valid:
                        totals += torch.stack([el.total.sum().double(), el.weight.sum().double()])
                    bar.update(min(len(rows) - start, bs * world))
        finally:
            base.train(was_training)
            bar.close()
        totals = acc.reduce(totals, reduction="sum") if world > 1 else totals
        return float(totals[0] / totals[1].clamp_min(1))

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_root(self) -> Path:
        return Path(self.config.output_dir)

    @staticmethod
    def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
        """Complete checkpoints under `output_dir`, oldest first (temp folders of a crashed save are ignored)."""
        root = Path(output_dir)
        if not root.is_dir():
            return []
        found = []
        for path in root.iterdir():
            m = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", path.name)
            if m and path.is_dir() and (path / TRAINER_STATE).exists():
                found.append((int(m.group(1)), path))
        return [p for _, p in sorted(found)]

    def _rng_state(self) -> dict:
        py = random.getstate()
        np_state = np.random.get_state()
        state = {
            "python_version": py[0],
            "python": torch.tensor(py[1], dtype=torch.int64),
            "python_gauss": py[2],
            "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": int(np_state[2]),
            "numpy_has_gauss": int(np_state[3]),
            "numpy_gauss": float(np_state[4]),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def _set_rng_state(state: dict) -> None:
        random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()), state["python_gauss"]))
        np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def _save_checkpoint(self, step: int) -> Path:
        """Write `checkpoint-{step}` atomically: everything goes to a temp folder, then one `os.replace`."""
        from safetensors.torch import save_file

        acc = self.accelerator
        root = self._checkpoint_root()
        final = root / f"{CHECKPOINT_PREFIX}{step}"
        tmp = root / f".{CHECKPOINT_PREFIX}{step}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if self.sharded:
            # FSDP: weights and optimizer state are sharded; accelerate writes them (every process
            # takes part), together with the RNG states, into the same temp folder.
            acc.save_state(str(tmp))
        else:
            torch.save(self._rng_state(), tmp / f"rng_state_{acc.process_index}.pt")
        if acc.is_main_process and not self.sharded:
            weights = {n: p.detach().cpu().contiguous() for n, p in self.trainable_named}
            save_file(weights, str(tmp / TRAINABLE_WEIGHTS), metadata={"format": "pt", "step": str(step)})
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            if getattr(acc, "scaler", None) is not None:
                torch.save(acc.scaler.state_dict(), tmp / "scaler.pt")
        if acc.is_main_process:
            state = {
                "global_step": step,
                "micro_batches": step * self.config.gradient_accumulation_steps,
                "global_batch": self.order.global_batch,
                "num_processes": acc.num_processes,
                "units_seen": self.units_seen,
                "elapsed": self._elapsed(),
                "history": self.history,
                "eval_history": self.eval_history,
                "baseline": self.baseline,
                "config": self.config.to_dict(),
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
        acc.wait_for_everyone()
        if acc.is_main_process:
            for file in tmp.rglob("*"):
                if file.is_file():
                    with open(file, "rb") as fh:
                        os.fsync(fh.fileno())
            if final.exists():  # a resumed run re-saving a step: move the old one out of the way first
                aside = root / f".{final.name}.old"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(tmp, final)
            with contextlib.suppress(OSError):
                fd = os.open(root, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            if self.config.save_total_limit:
                for old in self.list_checkpoints(root)[: -self.config.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def _resolve_resume(self) -> Path | None:
        target = self.config.resume_from_checkpoint
        if not target:
            return None
        if target == "latest":
            found = self.list_checkpoints(self.config.output_dir)
            if not found:
                if self.accelerator.is_main_process:
                    print(f"[hf_depthgrow] no checkpoint under {self.config.output_dir}: starting from step 0")
                return None
            return found[-1]
        path = Path(target)
        if not (path / TRAINER_STATE).exists():
            raise ValueError(f"{path} is not a complete checkpoint (no {TRAINER_STATE})")
        return path

    def _load_checkpoint(self, path: Path) -> int:
        from safetensors.torch import load_file

        acc = self.accelerator
        state = json.loads((path / TRAINER_STATE).read_text())
        if state["global_batch"] != self.order.global_batch:
            raise ValueError(
                f"{path} was written with a global micro-batch of {state['global_batch']} examples, this run has "
                f"{self.order.global_batch}: resuming would change the data order and the loss scale."
            )
        if self.sharded:
            acc.load_state(str(path))  # weights, optimizer, scheduler (registered) and RNG states
            return self._restore_trainer_state(state)
        weights = load_file(str(path / TRAINABLE_WEIGHTS))
        names = {n for n, _ in self.trainable_named}
        if set(weights) != names:
            raise ValueError(f"{path}: trainable weights do not match this run's trainable set ({sorted(set(weights) ^ names)[:4]})")
        with torch.no_grad():
            for name, param in self.trainable_named:
                param.copy_(weights[name].to(param.device, param.dtype))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        if (path / "scaler.pt").exists() and getattr(acc, "scaler", None) is not None:
            acc.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        rng_file = path / f"rng_state_{acc.process_index}.pt"
        if state["num_processes"] != acc.num_processes or not rng_file.exists():
            warnings.warn("resuming with a different number of processes: RNG streams (dropout) are not restored exactly")
            rng_file = path / "rng_state_0.pt"
        self._set_rng_state(torch.load(rng_file, weights_only=True))
        return self._restore_trainer_state(state)

    def _restore_trainer_state(self, state: dict) -> int:
        self.history, self.eval_history = state["history"], state["eval_history"]
        self.baseline = state["baseline"]
        self.units_seen = state["units_seen"]
        self._elapsed_before = state["elapsed"]
        return int(state["global_step"])

    def _elapsed(self) -> float:
        return self._elapsed_before + (time.perf_counter() - self._t0)

    # ------------------------------------------------------------------ training

    def setup(self) -> int:
        """Everything before the first step: accelerator, trainable set, optimizer, caches, baselines, resume.

        Returns the step to start after (0, or the resumed checkpoint's step). `train()` calls it;
        call it yourself only to drive `training_step` by hand (benchmarks).
        """
        from accelerate.utils import DistributedType, set_seed
        from transformers import get_scheduler

        cfg = self.config
        self.accelerator = acc = self._make_accelerator()
        if acc.distributed_type == DistributedType.DEEPSPEED:
            raise NotImplementedError(
                "DeepSpeed owns gradient accumulation and the optimizer step, which this trainer does itself "
                "(exact token-weighted accumulation); use DDP or FSDP launch configs."
            )
        set_seed(cfg.seed)
        self.causal = is_causal_lm(self.model)
        self.unit = "tokens" if self.causal else "examples"
        self.eval_batch_size = cfg.per_device_eval_batch_size or cfg.per_device_train_batch_size
        self.prefix_index = lowest_new_index(self.model) if self.record else None
        self.model.to(acc.device)
        self.sharded = acc.distributed_type == DistributedType.FSDP
        if self.sharded and self.record and (self.record.adapters or cfg.trainable == "new+lora"):
            raise NotImplementedError(
                "under FSDP this trainer supports native blocks with trainable='new' or 'full' (adapter blocks and "
                "LoRA are saved and merged from unsharded weights); use a DDP launch config for them."
            )

        self._setup_trainable()
        # The starting weights of the trainable set: restoring them gives back f_old as a function
        # (new blocks at zero init, LoRA B at zero), which is how the fallback returns f_old.
        self._initial = {n: p.detach().to("cpu", copy=True) for n, p in self.trainable_named} if cfg.fallback else None

        decay = [p for n, p in self.trainable_named if not _no_decay(n, p)]
        no_decay = [p for n, p in self.trainable_named if _no_decay(n, p)]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)

        self.order = _DataOrder(len(self.train_dataset), cfg.per_device_train_batch_size, acc.num_processes, cfg.seed)
        accum = cfg.gradient_accumulation_steps
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs * self.order.batches_per_epoch / accum))
        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.total_steps)
        sched_name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else cfg.lr_scheduler
        # Not passed to `prepare`: accelerate's wrapper steps a scheduler once per process.
        self.scheduler = get_scheduler(sched_name, optimizer, num_warmup_steps=warmup, num_training_steps=self.total_steps)
        self.wrapped, self.optimizer = acc.prepare(self.model, optimizer)
        if self.sharded:
            acc.register_for_checkpointing(self.scheduler)
        # FSDP2 swaps parameters for sharded ones while preparing: look them up again.
        self.trainable_named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

        mode = self._resolve_prefix_cache()
        t_cache = time.perf_counter()
        self.train_cache = self._build_cache(self.train_dataset, mode, "prefix cache (train)")
        self.eval_cache = self._build_cache(self.eval_dataset, mode, "prefix cache (eval)") if mode != "off" else None
        self.cache_info = None
        if self.train_cache is not None:
            self.cache_info = {
                "mode": "disk" if self.train_cache.path is not None else "memory",
                "dtype": str(self.train_cache.storage_dtype).replace("torch.", ""),
                "index": self.prefix_index,
                "bytes": self.train_cache.nbytes + (self.eval_cache.nbytes if self.eval_cache is not None else 0),
                "build_seconds": round(time.perf_counter() - t_cache, 3),
            }

        self.history, self.eval_history, self.baseline = [], [], {}
        self.units_seen, self._elapsed_before, self._t0 = 0, 0.0, time.perf_counter()
        n_train = len(self.train_dataset)
        if cfg.selection_max_examples and cfg.selection_max_examples < n_train:
            gen = torch.Generator().manual_seed(cfg.seed + 7)
            self.selection_rows = sorted(torch.randperm(n_train, generator=gen)[: cfg.selection_max_examples].tolist())
        else:
            self.selection_rows = list(range(n_train))
        self.eval_rows = list(range(len(self.eval_dataset))) if self.eval_dataset is not None else []

        self.resume_path = self._resolve_resume()
        start_step = self._load_checkpoint(self.resume_path) if self.resume_path is not None else 0
        if self.resume_path is None:
            # Baselines are taken before the first step (the grown model at init *is* f_old), and
            # kept in checkpoints, so a resumed run compares against the same numbers.
            if self.eval_dataset is not None:
                loss = self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc="held-out loss (f_old)")
                self.eval_history.append({"step": 0, "eval_loss": loss})
            if cfg.fallback:
                self.baseline["old"] = self._dataset_loss(self.train_dataset, self.selection_rows, which="old", cache=self.train_cache, desc="train loss (f_old)")
                if self.stone is not None:
                    self.stone.to(acc.device)
                    stone_cache = self.train_cache if self.train_cache is not None and shares_prefix(self.model, self.stone, self.prefix_index) else None
                    self.baseline["stepping_stone"] = self._dataset_loss(self.train_dataset, self.selection_rows, which="stone", cache=stone_cache, desc="train loss (stepping stone)")
        self._set_train_mode(True)
        return start_step

    def training_step(self, step: int) -> dict:
        """One optimizer step (1-based `step`): its micro-batches, backward, clip, AdamW, scheduler.

        Returns `{"loss", "units", "seconds", "grad_norm"}`; `loss` is the global token-weighted
        (causal LM) or per-example (classifier) mean of the step's batch.
        """
        cfg, acc = self.config, self.accelerator
        world, rank, accum = acc.num_processes, acc.process_index, cfg.gradient_accumulation_steps
        t_step = time.perf_counter()
        rows = [self.order.local_indices(p, rank) for p in range((step - 1) * accum, step * accum)]
        batches = [self._to_device(_fetch(self.train_dataset, r)) for r in rows]
        counts = torch.tensor(
            [sum(_supervised_count(b, self.causal) for b in batches), sum(_input_count(b, self.causal) for b in batches)],
            dtype=torch.float64,
            device=acc.device,
        )
        counts = acc.reduce(counts, reduction="sum") if world > 1 else counts
        weight = counts[0].clamp_min(1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        for i, (r, batch) in enumerate(zip(rows, batches)):
            # Gradients are all-reduced once per optimizer step, on the last micro-batch.
            sync = contextlib.nullcontext() if i == accum - 1 else acc.no_sync(self.wrapped)
            with sync:
                el = self._losses(self.wrapped, self.model, batch, r, self.train_cache, self.prefix_index)
                total = el.total.sum()
                # Sum of token losses over the global weight, times the process count because
                # DDP averages gradients over processes: the gradient of the global mean.
                acc.backward(total / weight.to(total.dtype) * world)
            loss_sum += total.detach().double()
        grad_norm = None
        if cfg.max_grad_norm:
            grad_norm = float(acc.clip_grad_norm_([p for _, p in self.trainable_named], cfg.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = acc.reduce(loss_sum, reduction="sum") if world > 1 else loss_sum
        self.units_seen += int(counts[1])
        return {"loss": float(loss_sum / weight), "units": int(counts[1]), "seconds": time.perf_counter() - t_step, "grad_norm": grad_norm}

    def train(self) -> TrainResult:
        """Run the training; returns a `TrainResult` with the selected model."""
        from tqdm.auto import tqdm

        cfg = self.config
        start_step = self.setup()
        acc, total_steps = self.accelerator, self.total_steps
        bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not (cfg.progress_bar and acc.is_main_process))
        window_units, window_time = 0, 0.0
        for step in range(start_step + 1, total_steps + 1):
            out = self.training_step(step)
            window_units += out["units"]
            window_time += out["seconds"]
            rate = window_units / max(window_time, 1e-9)
            if step % cfg.logging_steps == 0 or step == total_steps:
                entry = {"step": step, "loss": out["loss"], "lr": self.scheduler.get_last_lr()[0], f"{self.unit}_per_s": rate,
                         "step_seconds": out["seconds"]}
                if out["grad_norm"] is not None:
                    entry["grad_norm"] = out["grad_norm"]
                self.history.append(entry)
                window_units, window_time = 0, 0.0
            bar.set_postfix({"loss": f"{out['loss']:.4f}", f"{'tok' if self.causal else 'ex'}/s": f"{rate:.0f}"}, refresh=False)
            bar.update(1)
            if self.eval_dataset is not None and cfg.eval_steps and step % cfg.eval_steps == 0 and step != total_steps:
                self._set_train_mode(False)
                loss = self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc=f"held-out loss (step {step})")
                self.eval_history.append({"step": step, "eval_loss": loss})
                if acc.is_main_process and cfg.progress_bar:
                    bar.write(f"step {step}: eval loss {loss:.4f}")
                self._set_train_mode(True)
            if cfg.save_steps and step % cfg.save_steps == 0:
                self._save_checkpoint(step)
            if cfg.stop_after_step is not None and step == cfg.stop_after_step:
                bar.close()
                acc.wait_for_everyone()
                os._exit(STOP_EXIT_CODE)  # a crash, as far as the run is concerned: no cleanup, no final save
        bar.close()
        self._set_train_mode(False)
        return self._finish(total_steps, self.cache_info, self.resume_path, self.eval_rows)

    # ------------------------------------------------------------------ the end: fallback rule, save

    def _finish(self, total_steps: int, cache_info, resume_path, eval_rows) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        result = TrainResult(
            model=self.model,
            global_step=total_steps,
            history=self.history,
            eval_history=self.eval_history,
            unit=self.unit,
            units_seen=self.units_seen,
            num_trainable_parameters=sum(p.numel() for _, p in self.trainable_named),
            trainable=cfg.trainable,
            num_processes=acc.num_processes,
            num_train_examples=len(self.train_dataset),
            num_selection_examples=len(self.selection_rows) if cfg.fallback else 0,
            prefix_cache=cache_info,
            stepping_stone=self.stone_info,
            resumed_from=str(resume_path) if resume_path else None,
        )
        if self.eval_history and self.eval_history[0]["step"] == 0:
            result.eval_loss_before = self.eval_history[0]["eval_loss"]
        if self.eval_dataset is not None:
            result.eval_loss_after = self._dataset_loss(self.eval_dataset, eval_rows, cache=self.eval_cache, desc="held-out loss (f_new)")
            self.eval_history.append({"step": total_steps, "eval_loss": result.eval_loss_after})
            result.eval_loss_selected = result.eval_loss_after

        if cfg.fallback:
            new = self._dataset_loss(self.train_dataset, self.selection_rows, which="new", cache=self.train_cache, desc="train loss (f_new)")
            losses = {"new": new, **self.baseline}
            # Condition 2: f_new unless the stepping stone is better; f_old if that is not better either.
            # Ties go to the earlier entry of this order.
            # A diverged run (NaN/inf loss) counts as worst.
            order = ["new", "stepping_stone", "old"]
            rank = lambda k: (losses[k] if math.isfinite(losses[k]) else math.inf, order.index(k))  # noqa: E731
            selected = min((k for k in order if k in losses), key=rank)
            result.train_losses = losses
            result.reference = "stepping_stone" if "stepping_stone" in losses else "old"
            result.delta_erm = losses[result.reference] - new
            result.selected = selected
        result.model = self._selected_model(result.selected)
        if result.selected == "old":
            result.eval_loss_selected = result.eval_loss_before
        elif result.selected == "stepping_stone" and self.eval_dataset is not None:
            stone_cache = self.eval_cache if self.eval_cache is not None and shares_prefix(self.model, self.stone, self.prefix_index) else None
            result.eval_loss_selected = self._dataset_loss(self.eval_dataset, eval_rows, which="stone", cache=stone_cache, desc="held-out loss (stepping stone)")
        result.train_runtime = self._elapsed()
        for cache in (self.train_cache, self.eval_cache):
            if cache is not None:
                cache.close()

        full_state = None
        if self.sharded and cfg.output_dir and cfg.save_final_model and result.model is self.model:
            full_state = acc.get_state_dict(self.wrapped)  # collective: gathers the shards on the main process
        if cfg.output_dir and acc.is_main_process:
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            if cfg.save_final_model:
                from ..hub.serialization import save_pretrained

                to_save = result.model
                if self.peft_model is not None and result.model is self.peft_model:
                    to_save = copy.deepcopy(self.peft_model).merge_and_unload()
                extra = {"state_dict": full_state} if full_state is not None else {}
                save_pretrained(to_save, out / FINAL_MODEL, tokenizer=self.tokenizer, **extra)
                result.model_path = str(out / FINAL_MODEL)
            (out / "train_config.json").write_text(cfg.to_json_string())
            atomic_write_text(out / "train_result.json", json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str))
        acc.wait_for_everyone()
        return result

    def _selected_model(self, selected: str) -> nn.Module:
        if selected == "stepping_stone":
            if self.peft_model is not None:
                self.peft_model.unload()
            return self.stone
        if selected == "old":
            # Back to the starting weights: new blocks at zero init (and LoRA removed, or in full mode
            # the original weights), i.e. a grown model that computes exactly f_old.
            with torch.no_grad():
                for name, param in self.trainable_named:
                    _assign(param, self._initial[name])
            if self.peft_model is not None:
                return self.peft_model.unload()
            return self.model
        if self.peft_model is not None:
            return self.peft_model.merge_and_unload() if self.config.merge_lora else self.peft_model
        return self.model


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param.copy_(value)` for plain and FSDP2-sharded (DTensor) parameters alike."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device_mesh.device_type, param.dtype), param.device_mesh, param.placements)
    param.copy_(value.to(param.device, param.dtype) if not hasattr(value, "placements") else value)


def train(
    model: nn.Module,
    train_data,
    *,
    config: TrainConfig | None = None,
    eval_data=None,
    stepping_stone=None,
    tokenizer=None,
    accelerator=None,
    **kwargs: Any,
) -> TrainResult:
    """Train a grown model and apply the fallback rule; the functional face of `GrownTrainer`.

    Args:
        model: A model grown with `grow_depth` (changed in place).
        train_data: Training rows (inputs + `labels`), e.g. from `hf_depthgrow.data.sources.load_data`.
        config: A `TrainConfig`; or pass its fields as keyword arguments.
        eval_data: Held-out rows, evaluated before, every `eval_steps`, and after.
        stepping_stone: `f~_S` (a model or `stepping_stone(...)`'s `(model, result)`) for the fallback rule;
            without it the trained model is compared with the original (`bypass_new_blocks`).
        tokenizer: Saved beside the final model.
        accelerator: An existing `Accelerator` (default: one built from the config).

    Returns:
        `TrainResult`: `.model` (selected), `.selected`, `.train_losses`, `.delta_erm`, histories.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth
        >>> from hf_depthgrow.training.trainer import train
        >>> from hf_depthgrow.testing import tiny_model
        >>> model = grow_depth(tiny_model("llama"), [2])
        >>> result = train(model, train_ds, eval_data=eval_ds, max_steps=20, learning_rate=1e-3)
        >>> result.selected in ("new", "old")
        True
        ```
    """
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    config = config or TrainConfig(**kwargs)
    trainer = GrownTrainer(model, config, train_data, eval_data, stepping_stone=stepping_stone, tokenizer=tokenizer, accelerator=accelerator)
    return trainer.train()
