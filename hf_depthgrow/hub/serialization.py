"""Save and load grown models (safetensors only).

- Native growth gives an ordinary checkpoint of the same architecture: plain
  `AutoModelFor*.from_pretrained(path)` loads it, no hf_depthgrow import, no remote code.
- Adapter blocks hang on original layers and are not part of the architecture: they go to
  their own file, `depthgrow_adapters.safetensors`, under the model's own parameter names
  (transformers may rename keys of the main checkpoint on save), and `load_pretrained` rebuilds
  the blocks from the growth record in config.json and loads them from there.
  `save_pretrained(..., adapters_only=True)` writes just the adapter file plus a reference to the
  base model (like a PEFT adapter).

No silent bare-base loads. Plain transformers cannot build adapter blocks, so
`AutoModel.from_pretrained(folder)` on an adapter-grown folder gives the base model without them.
It must not do so quietly: the main checkpoint also carries the adapter tensors and one marker
tensor, `NOT_LOADED_KEY`, whose name is the command that loads the folder. Transformers reports
checkpoint keys its architecture does not have in its load report, a `logger.warning` shown by
default (transformers 5: "LOAD REPORT ... | UNEXPECTED"), so the user sees which blocks were left
out and `hf_depthgrow.load_pretrained(folder)`. That is transformers' own mechanism for "this
checkpoint holds more than this model": no remote code, no custom config field (unknown config
fields are kept silently), and other strict loaders refuse the folder instead of serving the base.
`load_pretrained` tells transformers these keys are expected (`_keys_to_ignore_on_load_unexpected`),
so loading through hf_depthgrow stays quiet and exact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..growth.adapter import POST, PRE
from ..growth.engine import new_block_modules
from ..growth.quantized import bnb_mode, dequantized_copy
from ..growth.record import RECORD_KEY, GrowthRecord, growth_record
from ..utils import pid_alive, umask

ADAPTER_WEIGHTS = "depthgrow_adapters.safetensors"
ADAPTER_CONFIG = "depthgrow_adapters.json"
# A blocks-only save: every new block (native layers and adapters) and what to replay them onto.
BLOCKS_WEIGHTS = "depthgrow_blocks.safetensors"
BLOCKS_CONFIG = "depthgrow_blocks.json"


class NoSpaceError(OSError):
    """A save ran out of disk space; the partial save was removed and the target is as it was."""

    def __init__(self, path: Path):
        super().__init__(errno.ENOSPC, f"no space left on {path}: the save was rolled back and what was there is unchanged; free some space and save again")

    def __str__(self) -> str:
        return self.strerror


def _no_space(err: BaseException) -> bool:
    """ENOSPC, as an OSError or as the message of safetensors' `SafetensorError` (its Rust io::Error: StorageFull)."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return type(err).__name__ == "SafetensorError" and any(s in text for s in ("No space left", "StorageFull", "os error 28"))


def _adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if f".{PRE}." in k or f".{POST}." in k}


# The marker's key names the command; a state-dict key is module path + buffer name, so the command's
# dots come from two nested modules: `<_MARKER_ROOT>.hf_depthgrow.load_pretrained(folder)`.
_MARKER_ROOT = "depthgrow_blocks_NOT_LOADED__load_with"
NOT_LOADED_KEY = f"{_MARKER_ROOT}.hf_depthgrow.load_pretrained(folder)"
# Checkpoint keys plain transformers cannot place, and load_pretrained expects: hosted blocks and the marker.
_EXPECTED_EXTRA_KEYS = (rf"(^|\.){PRE}\.", rf"(^|\.){POST}\.", rf"^{re.escape(_MARKER_ROOT)}\.")


@contextlib.contextmanager
def _not_loaded_marker(model: nn.Module, record: GrowthRecord):
    """Save a marker tensor beside the model's own: its key is the command that loads the folder, its
    bytes the same sentence (readable with `bytes(t.tolist()).decode()`)."""
    message = (
        f"{len(record.adapters)} depth-growth adapter block(s) are not part of {type(model).__name__} and plain "
        "transformers does not load them; load this folder with hf_depthgrow.load_pretrained(folder)"
    )
    holder, inner = nn.Module(), nn.Module()
    inner.register_buffer("load_pretrained(folder)", torch.tensor(list(message.encode()), dtype=torch.uint8))
    holder.add_module("hf_depthgrow", inner)
    model.add_module(_MARKER_ROOT, holder)
    try:
        yield
    finally:
        del model._modules[_MARKER_ROOT]


@contextlib.contextmanager
def _extra_keys_expected(cls: type):
    """While `cls.from_pretrained` runs, the adapter tensors and the marker are keys it expects, not a report."""
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    cls._keys_to_ignore_on_load_unexpected = [*(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()), *_EXPECTED_EXTRA_KEYS]
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = before
        else:
            del cls._keys_to_ignore_on_load_unexpected


MARKER = ".hf_depthgrow"  # written last into every saved folder: "hf_depthgrow wrote this, completely"
_LEFTOVER = r"^\.{name}\.(tmp|old)-(\d+)(-[A-Za-z0-9_]+)?$"  # our temp/backup names only, nothing else
_ACTIVE: set[str] = set()  # temp folders of saves running in this process (never "stale")


def _leftovers(path: Path) -> list[tuple[str, Path]]:
    """`(kind, folder)` for each temp/backup of `path` left by a dead save (`kind` is "tmp" or "old")."""
    if not path.parent.is_dir():
        return []
    pattern = re.compile(_LEFTOVER.format(name=re.escape(path.name)))
    found = []
    for entry in path.parent.iterdir():
        m = pattern.match(entry.name)
        if not m or str(entry) in _ACTIVE or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or not pid_alive(pid):
            found.append((m.group(1), entry))
    return found


def _recover(path: Path) -> None:
    """Finish or roll back a save of `path` that died between its steps, then drop its leftovers.

    A missing target is put back from the newest complete temp (its marker is written last, so
    the save it holds was whole: finish it), else from the backup the dead save moved aside (roll
    back). Only folders named like this module's own temps and backups are touched.
    """
    leftovers = _leftovers(path)
    if not leftovers:
        return
    if not os.path.lexists(path):
        complete = sorted((p for kind, p in leftovers if kind == "tmp" and (p / MARKER).is_file()), key=lambda p: p.stat().st_mtime)
        backups = [p for kind, p in leftovers if kind == "old"]
        source = complete[-1] if complete else (backups[0] if backups else None)
        if source is not None:
            os.replace(source, path)
            leftovers = [(k, p) for k, p in leftovers if p != source]
    for _, p in leftovers:
        shutil.rmtree(p, ignore_errors=True)


def _is_model_save(path: Path) -> bool:
    """A folder this tool (or transformers) saved a model into: replacing it is the normal case."""
    if (path / MARKER).is_file() or (path / ADAPTER_CONFIG).is_file() or (path / BLOCKS_CONFIG).is_file():
        return True
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _check_target(path: Path) -> None:
    """Refuse to replace a file or a folder of unrelated files (replacing deletes them)."""
    if os.path.islink(path) or (os.path.lexists(path) and not path.is_dir()):
        raise FileExistsError(f"{path} exists and is not a folder: save_pretrained writes a folder there; remove it or choose another path")
    if path.is_dir() and any(path.iterdir()) and not _is_model_save(path):
        raise FileExistsError(
            f"{path} is a folder that holds no saved model (no {MARKER}, config.json with safetensors weights, or "
            f"{ADAPTER_CONFIG}): saving would delete its files; choose an empty or new folder"
        )


def _atomic_dir(path: Path) -> Path:
    """A temp folder beside `path`; `_commit` moves it into place so readers never see half a save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    _ACTIVE.add(str(tmp))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; a saved folder gets the usual permissions
    return tmp


def _finish_tmp(tmp: Path) -> None:
    """Usual permissions (safetensors writes files 0600, mkdtemp folders 0700), then the marker, last."""
    from ..utils import __version__

    mask = umask()
    for root, dirs, files in os.walk(tmp):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)
    (tmp / MARKER).write_text(json.dumps({"hf_depthgrow": __version__}) + "\n")
    os.chmod(tmp / MARKER, 0o666 & ~mask)


def _commit(tmp: Path, path: Path) -> None:
    if not os.path.lexists(path):
        os.replace(tmp, path)
        return
    backup = path.with_name(f".{path.name}.old-{os.getpid()}")
    os.replace(path, backup)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(backup, path)  # roll back: the previous save is back in place
        raise
    shutil.rmtree(backup, ignore_errors=True)


def new_block_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of every new block (native layers and adapters), under the grown model's own state-dict names.

    Example:
        ```python
        >>> grow_depth(model, [2])                    # a 4-layer Llama
        >>> sorted(new_block_state(model))[:1]
        ['model.layers.2.input_layernorm.weight']
        ```
    """
    blocks = {id(m) for m in new_block_modules(model)}
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():  # the blocks' own state dicts: the quantised base is not read
        if id(module) in blocks:
            state.update((k, v.detach().contiguous()) for k, v in module.state_dict(prefix=name + ".").items())
    return state


def _write_blocks_only(model: nn.Module, record: GrowthRecord | None, base_model: str | None, tmp: Path) -> None:
    if not record:
        raise ValueError("blocks_only=True needs a grown model (grow_depth first)")
    if not base_model:
        raise ValueError("blocks_only=True needs base_model= (the Hub id or path of the ungrown base weights)")
    meta = {
        "base_model": str(base_model),
        "quantize": bnb_mode(model),  # the base is loaded the same way again, so the blocks meet the same function
        RECORD_KEY: record.to_dict(),
        "architectures": model.config.architectures or [type(model).__name__],
    }
    (tmp / BLOCKS_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    save_file(new_block_state(model), str(tmp / BLOCKS_WEIGHTS), metadata={"format": "pt"})


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    adapters_only: bool = False,
    blocks_only: bool = False,
    base_model: str | None = None,
    **kwargs,
) -> Path:
    """Save a grown model with safetensors, atomically.

    A model grown on a bitsandbytes-quantised base is saved merged: a dequantised, full-precision
    copy (the model itself stays quantised) that plain `from_pretrained` loads. A quantised
    checkpoint would quantise the trained blocks too when loaded; `blocks_only=True` keeps the
    quantised base instead.

    Args:
        model: A model grown by `grow_depth` (an ungrown model saves as usual).
        path: Output folder; replaced as a whole, never left half-written.
        tokenizer: Saved beside the model when given.
        adapters_only: Save only the adapter blocks and the growth record, with `base_model`
            (a Hub id or local path) as the reference to load the base weights from.
        blocks_only: Save only the new blocks, native or adapter (`depthgrow_blocks.safetensors`), the
            growth record and how the base was loaded (`depthgrow_blocks.json`: `base_model` and its
            quantisation); `load_pretrained` loads the base that way again and replays the growth.
        base_model: Where the base weights live, required with `adapters_only=True` or `blocks_only=True`.

    Example:
        ```python
        >>> grow_depth(model, [3], block="adapter")
        >>> save_pretrained(model, "grown", tokenizer=tok)
        >>> same = load_pretrained("grown")
        ```
    """
    path = Path(path)
    record = growth_record(model)
    _recover(path)
    _check_target(path)
    tmp = _atomic_dir(path)
    try:
        if adapters_only and blocks_only:
            raise ValueError("pass adapters_only=True or blocks_only=True, not both")
        if blocks_only:
            _write_blocks_only(model, record, base_model, tmp)
        elif adapters_only:
            if not record or not record.adapters:
                raise ValueError("adapters_only=True needs a model with adapter blocks")
            if record.native_indices:
                raise ValueError("adapters_only=True cannot hold native blocks: they are whole layers; save the full model")
            if not base_model:
                raise ValueError("adapters_only=True needs base_model= (the Hub id or path of the base weights)")
            (tmp / ADAPTER_CONFIG).write_text(
                json.dumps({"base_model": str(base_model), RECORD_KEY: record.to_dict(), "architectures": model.config.architectures or [type(model).__name__]}, indent=2, sort_keys=True)
            )
        else:
            # Adapter blocks stay in the module tree, so the main checkpoint carries them too (see the module doc).
            if bnb_mode(model) is not None:
                model = dequantized_copy(model)  # merged: the full-precision checkpoint plain transformers loads
            marker = _not_loaded_marker(model, record) if record and record.adapters else contextlib.nullcontext()
            with marker:
                model.save_pretrained(str(tmp), safe_serialization=True, **kwargs)
        if record and record.adapters and not blocks_only:
            save_file(_adapter_state(model), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _finish_tmp(tmp)
        _commit(tmp, path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(err):
            raise NoSpaceError(path) from err
        raise
    finally:
        _ACTIVE.discard(str(tmp))
    return path
