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
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from ..growth.adapter import POST, PRE
from ..growth.engine import grow_depth, new_block_modules, reattach_adapters
from ..growth.quantized import bnb_mode, dequantized_copy
from ..growth.record import RECORD_KEY, GrowthRecord, InvalidGrowthRecordError, check_record_matches, growth_record, store_record
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
    from .. import __version__

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


def _check_record_matches(model: nn.Module, record: GrowthRecord, path: Path, adapter_state: dict | None = None) -> None:
    """The record must describe these weights (layer count, adapter hosts, adapter shapes)."""
    try:
        check_record_matches(model, record, adapter_state)
    except InvalidGrowthRecordError as err:
        raise InvalidGrowthRecordError(f"{path.name}: {err}") from None


def _model_class(architectures):
    name = (architectures or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"config.architectures={architectures!r} names no transformers class; cannot rebuild the model")
    return cls


def _check_local_folder(folder: Path, trust_remote_code: bool) -> None:
    """Refuse, before transformers reads it, a folder whose loading would run code: custom code
    (`auto_map`) unless trusted, or weights only in a pickle format (never unpickled here)."""
    config = folder / "config.json"
    if not trust_remote_code and config.is_file():
        try:
            auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, AttributeError):
            auto_map = None  # transformers reports a broken config.json itself
        if auto_map:
            raise ValueError(
                f"{folder.name}: config.json has auto_map {sorted(auto_map)!r} (custom code shipped with the model); "
                "hf_depthgrow does not run it. Pass trust_remote_code=True only if you trust that code."
            )
    if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        raise ValueError(
            f"{folder.name} has no .safetensors weights" + (f" (only pickle files {pickles}, which are never unpickled)" if pickles else "")
            + ": load_pretrained reads safetensors only; convert the checkpoint to safetensors first"
        )


def load_pretrained(path: str | os.PathLike, *, base_model: str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """Load a model saved by `save_pretrained`: native, adapter, or adapters-only with its base.

    `kwargs` go to transformers' `from_pretrained` (e.g. `dtype=`); `trust_remote_code` stays off
    (passed as `False`) unless given, and weights are read from safetensors only.
    """
    path = Path(path)
    with contextlib.suppress(OSError):  # a read-only location still loads; a missing target then fails below
        _recover(path)  # a save of this folder that died half-way is finished or rolled back first
    kwargs.setdefault("trust_remote_code", False)
    kwargs["use_safetensors"] = True  # never fall back to a pickle checkpoint
    trusted = bool(kwargs["trust_remote_code"])
    if (path / BLOCKS_CONFIG).exists():
        return _load_blocks_only(path, base_model, kwargs)
    if (path / ADAPTER_CONFIG).exists():
        meta = json.loads((path / ADAPTER_CONFIG).read_text())
        base = base_model or meta["base_model"]
        if Path(base).is_dir():
            _check_local_folder(Path(base), trusted)
        model = _model_class(meta.get("architectures")).from_pretrained(str(base), **kwargs)
        record = GrowthRecord.from_dict(meta[RECORD_KEY])
        state = load_file(str(path / ADAPTER_WEIGHTS))
    else:
        _check_local_folder(path, trusted)
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trusted)
        raw = getattr(config, RECORD_KEY, None)
        record = GrowthRecord.from_dict(raw) if raw else None  # a forged record is refused before any weights load
        cls = _model_class(config.architectures)
        with _extra_keys_expected(cls):
            model = cls.from_pretrained(str(path), **kwargs)
        if record is not None:
            _check_record_matches(model, record, path)
        if not (record and record.adapters):
            return model
        if not (path / ADAPTER_WEIGHTS).exists():
            raise ValueError(f"{path}: the growth record lists adapter blocks but {ADAPTER_WEIGHTS} is missing")
        state = load_file(str(path / ADAPTER_WEIGHTS))
    _check_record_matches(model, record, path, state)
    store_record(model.config, record)
    reattach_adapters(model, record)
    return _load_block_weights(model, state, set(_adapter_state(model)), "adapter weights")


def _load_block_weights(model: nn.Module, state: dict, expected: set, what: str) -> nn.Module:
    """Load the saved block tensors after checking they are exactly the ones the growth record gives the model."""
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{what} do not match the growth record: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.load_state_dict(state, strict=False)
    return model


def _load_blocks_only(path: Path, base_model, kwargs: dict) -> nn.Module:
    """The base loaded as the blocks were trained on it (quantised or not), the growth replayed, the blocks loaded."""
    from .loading import load_model

    meta = json.loads((path / BLOCKS_CONFIG).read_text())
    record = GrowthRecord.from_dict(meta[RECORD_KEY])
    base = str(base_model or meta["base_model"])
    if Path(base).is_dir():
        _check_local_folder(Path(base), bool(kwargs["trust_remote_code"]))
    if meta.get("quantize"):
        model, _ = load_model(base, quantize=meta["quantize"], dtype=kwargs.get("dtype"))
    else:
        model = _model_class(meta.get("architectures")).from_pretrained(base, **kwargs)
    if growth_record(model) is not None:
        raise ValueError(f"{path.name}: base_model {base} is already grown; the blocks load onto the ungrown base")
    state = load_file(str(path / BLOCKS_WEIGHTS))
    if record.native_indices:
        # Zero-initialised native layers at the recorded places (exact, checked), then the saved weights over them.
        positions = [record.num_original_below(i) for i in record.native_indices]
        grow_depth(model, positions, block="native", init="random", tower=record.tower)
    store_record(model.config, record)
    _check_record_matches(model, record, path, {k: v for k, v in state.items() if f".{PRE}." in k or f".{POST}." in k})
    reattach_adapters(model, record)
    return _load_block_weights(model, state, set(new_block_state(model)), f"{path.name}: the saved blocks")
