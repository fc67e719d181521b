"""The frozen-prefix cache: `z = f_bot(x)` computed once per training row, in memory or in a file.

When nothing below the lowest inserted block trains, `z` is the same at every step, so a step only
needs `f_top` (run through `hf_depthgrow.growth.prefix.start_at`). Rows are keyed by their index
in the trainer's rows, so the seeded data order can ask for any of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..data.batches import to_device
from ..growth.towers import resolve_family
from ..growth.prefix import lowest_new_index, prefix_hidden
from ..losses import is_causal_lm
from .cache_plan import choose_auto
from .data_order import FIXED_SIZE_MESSAGE, fetch

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CACHE_COUNTER = iter(range(1_000_000))


# A GPU holds the cache itself while it takes at most this share of the device's free memory at build time.
DEVICE_CACHE_SHARE = 0.25


def memory_device(device, nbytes: int) -> torch.device:
    """Where an in-memory cache of `nbytes` lives for a model on `device`: on that accelerator while it fits in
    `DEVICE_CACHE_SHARE` of its free memory, else in CPU memory.

    A CPU-resident cache costs a GPU step a gather and a host-to-device copy of the batch's `z` (and fresh host
    pages for each): on an H200, SmolLM2 at 1024 x 32 tokens ran 0.45x as fast *with* such a cache as without
    one (benchmarks/RESULTS.md, GPU benchmark). On the device the read is a gather in device memory.

    Example:
        ```python
        >>> memory_device(torch.device("cpu"), 10**9)
        device(type='cpu')
        ```
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes <= DEVICE_CACHE_SHARE * free:
            return device
    return torch.device("cpu")


class MemoryRows:
    """Cache rows in one tensor, on `device` (see `memory_device`)."""

    def __init__(self, shape, dtype, device="cpu"):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.dtype, self.path = dtype, None

    def write(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        device = self.tensor.device
        self.tensor.index_copy_(0, ids.to(device), values.to(device=device, dtype=self.dtype))

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        return self.tensor.index_select(0, torch.as_tensor(list(ids), dtype=torch.long, device=self.tensor.device))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        self.tensor = None


class FileRows:
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


def _disk_path(directory, world: int) -> Path:
    # One name agreed by all processes of a run: the launcher's pid (parent of every rank) or our own.
    run_id = os.getppid() if world > 1 else os.getpid()
    path = Path(directory) / f"prefix-{run_id}-{next(_CACHE_COUNTER)}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _prefix_batches(model: nn.Module, rows, index: int, accelerator, batch_size: int):
    """Yield `(row ids, z)` on the CPU for every row, the work shared between processes."""
    n = len(rows)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    causal = is_causal_lm(model)
    for start in range(0, n, batch_size * world):
        mine = list(range(start + rank * batch_size, min(start + (rank + 1) * batch_size, n)))
        # Every process runs the same number of equally-shaped batches (gather needs it):
        # pad with a repeated row, marked -1 so nobody stores it.
        padded = mine + [mine[-1] if mine else 0] * (batch_size - len(mine))
        ids = torch.tensor(mine + [-1] * (batch_size - len(mine)), device=device)
        batch = to_device(fetch(rows, padded, fixed_size=True), device)
        inputs = {**batch, "use_cache": False} if causal else batch
        with accelerator.autocast():
            z = prefix_hidden(model, inputs, index)
        if world > 1:
            z, ids = accelerator.gather(z.contiguous()), accelerator.gather(ids)
        keep = ids >= 0
        yield ids[keep].cpu(), z[keep].cpu()


class PrefixCache:
    """`z = f_bot(x)` for every row of a dataset, indexed by row; in memory or spilled to a file.

    Build it with `PrefixCache.build`; `get(rows)` returns the stacked `z` of those rows in the dtype the
    prefix produced, so a step on cached `z` computes what an uncached step computes (exactly, with the
    default storage dtype).

    Example:
        ```python
        >>> cache = PrefixCache.build(grown, rows, 2, accelerator=Accelerator(), batch_size=8)
        >>> cache.get([0, 1], "cpu").shape  # [2, T, hidden]
        torch.Size([2, 16, 32])
        >>> cache.close()
        ```
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
        """The cached `z` of `rows`, stacked, on `device` in the dtype the prefix produced."""
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

        `dataset` is indexable rows of one fixed size (see `hf_depthgrow.data.batches.as_rows`).
        `model` is the unwrapped model; it is run under no_grad and the accelerator's autocast, as a
        training step would run it. With `storage="disk"` the node's local main process writes the
        file under `directory`; the other processes of the node read it.
        """
        from tqdm.auto import tqdm

        n = len(dataset)
        writer = storage == "memory" or accelerator.is_local_main_process
        path = _disk_path(directory, accelerator.num_processes) if storage == "disk" else None
        store = compute_dtype = layout = None
        bar = tqdm(total=n, desc=desc, unit="ex", disable=not (progress and accelerator.is_main_process), leave=False)
        was_training = model.training
        model.eval()
        try:
            for ids, z in _prefix_batches(model, dataset, index, accelerator, batch_size):
                if layout is None:
                    compute_dtype = z.dtype
                    layout = ((n, *z.shape[1:]), compute_dtype if dtype == "auto" else STORAGE_DTYPES[dtype])
                    if storage == "memory":
                        nbytes = math.prod(layout[0]) * torch.empty((), dtype=layout[1]).element_size()
                        store = MemoryRows(*layout, device=memory_device(accelerator.device, nbytes))
                    elif writer:
                        store = FileRows(path, *layout, create=True)
                if tuple(z.shape[1:]) != tuple(layout[0][1:]):
                    raise ValueError(FIXED_SIZE_MESSAGE)
                if writer:
                    store.write(ids, z)
                bar.update(len(ids))
        except RuntimeError as err:
            if "stack expects each tensor to be equal size" in str(err) or "Sizes of tensors must match" in str(err):
                raise ValueError(FIXED_SIZE_MESSAGE) from err
            raise
        finally:
            bar.close()
            model.train(was_training)
        if storage == "disk":
            if writer:
                store.flush()
            accelerator.wait_for_everyone()
            if not writer:
                store = FileRows(path, *layout, create=False)
        return cls(store, compute_dtype, index, owner=writer)


def auto_storage(model: nn.Module, rows, dtype: str) -> str:
    """`"disk"` when a cache of `rows` would take more than a third of the free memory, else `"memory"`.

    Example:
        ```python
        >>> auto_storage(grown, rows, "auto")
        'memory'
        ```
    """
    probe = {k: v[:1] for k, v in fetch(rows, [0]).items()}
    hidden = getattr(model.config, "hidden_size", None) or 0
    seq = probe["input_ids"].shape[-1] if "input_ids" in probe else 0
    if not hidden or not seq:
        return "memory"
    size = 2 if dtype in ("bfloat16", "float16") else 4
    need = len(rows) * seq * hidden * size
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return "memory"
    return "disk" if need > free / 3 else "memory"


def shares_prefix(model: nn.Module, other: nn.Module, index: int) -> bool:
    """True when `other` computes the same `z` entering stack layer `index` as `model`.

    Sufficient check: the same layer layout below `index` and bit-identical weights and buffers there
    and outside the layer stack (embeddings; also head and final norm, which is stricter than needed).

    Example:
        ```python
        >>> shares_prefix(grown, copy.deepcopy(grown), 2)
        True
        ```
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


def cache_mode(config, accelerator, index: int | None, n_train: int = 0, n_eval: int = 0) -> tuple[str, str]:
    """`(storage, why)`: `"off"`, `"memory"` or `"disk"`, with `"auto"` resolved (see `TrainConfig` and `cache_plan`).

    Example:
        ```python
        >>> cache_mode(TrainConfig(num_train_epochs=3), Accelerator(), 2, n_train=64)
        ('memory', 'prefix cache built: predicted prefix passes 192 without the cache, 64 with it (+67% saved; 3 epoch(s))')
        ```
    """
    from accelerate.utils import DistributedType

    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    valid = config.trainable != "full" and index is not None
    if config.prefix_cache == "off":
        return "off", "prefix cache off (prefix_cache='off')"
    if config.prefix_cache == "auto":
        if not valid:
            return "off", "prefix cache off: nothing frozen below the trained parameters"
        if sharded:
            return "off", "prefix cache off: the model is sharded (FSDP/DeepSpeed)"
        if index == 0:
            return "off", "prefix cache off: the lowest trained block is at the bottom, nothing to skip"
        use, why = choose_auto(config, n_train, n_eval, accelerator.num_processes)
        return ("memory" if use else "off"), why
    if not valid:
        raise ValueError("prefix_cache needs a frozen prefix below the new blocks")
    if sharded:
        raise ValueError("prefix_cache is not supported under FSDP/DeepSpeed; use prefix_cache='off' or 'auto'")
    return config.prefix_cache, f"prefix cache {config.prefix_cache} (prefix_cache={config.prefix_cache!r})"


def cache_dir(config) -> Path:
    """Where a `"disk"` cache spills: `prefix_cache_dir`, else `<output_dir>/prefix_cache`, else a temp dir."""
    if config.prefix_cache_dir:
        return Path(config.prefix_cache_dir)
    if config.output_dir:
        return Path(config.output_dir) / "prefix_cache"
    return Path(tempfile.gettempdir()) / "hf_depthgrow_prefix_cache"


def build_caches(model: nn.Module, train_rows, eval_rows, index: int | None, *, config, accelerator, eval_batch_size: int):
    """`(train cache, eval cache, info)` for a trainer: `None` caches when the cache is off.

    `info` always says what was chosen and why (`"choice"`, which `TrainResult.prefix_cache_choice`
    reports); with a cache it also holds the mode, storage dtype, index, bytes and build time
    (`TrainResult.prefix_cache`).

    Example:
        ```python
        >>> train_cache, eval_cache, info = build_caches(grown, rows, None, 2, config=TrainConfig(), accelerator=acc, eval_batch_size=8)
        >>> info["mode"], eval_cache
        ('memory', None)
        ```
    """
    n_eval = len(eval_rows) if eval_rows is not None else 0
    mode, why = cache_mode(config, accelerator, index, len(train_rows), n_eval)
    if getattr(train_rows, "streamed", False) and mode != "off":
        # Each streamed row is read once, and caching it would hold the corpus the stream exists not to hold.
        if config.prefix_cache != "auto":
            raise ValueError(f"prefix_cache={config.prefix_cache!r} cannot cache streamed training rows: use 'off' or 'auto'")
        mode, why = "off", "prefix cache off: the training rows are streamed (each is read once)"
    t_cache = time.perf_counter()

    def build(rows, desc):
        if mode == "off" or rows is None:
            return None
        storage = auto_storage(model, rows, config.prefix_cache_dtype) if mode == "memory" and config.prefix_cache == "auto" else mode
        return PrefixCache.build(
            model, rows, index, accelerator=accelerator, batch_size=config.prefix_cache_batch_size or eval_batch_size,
            storage=storage, dtype=config.prefix_cache_dtype, directory=cache_dir(config), progress=config.progress_bar, desc=desc,
        )

    train_cache = build(train_rows, "prefix cache (train)")
    eval_cache = build(eval_rows, "prefix cache (eval)")
    if train_cache is None:
        return None, eval_cache, {"mode": "off", "index": index, "bytes": 0, "choice": why}
    info = {
        "mode": "disk" if train_cache.path is not None else "memory",
        "dtype": str(train_cache.storage_dtype).replace("torch.", ""),
        "index": index,
        "bytes": train_cache.nbytes + (eval_cache.nbytes if eval_cache is not None else 0),
        "build_seconds": round(time.perf_counter() - t_cache, 3),
        "choice": why,
    }
    return train_cache, eval_cache, info
