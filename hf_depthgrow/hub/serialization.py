"""Save and load grown models (safetensors only).

- Native growth gives an ordinary checkpoint of the same architecture: plain
  `AutoModelFor*.from_pretrained(path)` loads it, no hf_depthgrow import, no remote code.
- Adapter blocks hang on original layers and are not part of the architecture: they go to
  their own file, `depthgrow_adapters.safetensors`, under the model's own parameter names
  (transformers may rename keys of the main checkpoint on save). The main checkpoint is then a
  clean base checkpoint, and `load_pretrained` rebuilds the blocks from the growth record in
  config.json and loads them. `save_pretrained(..., adapters_only=True)` writes just the
  adapter file plus a reference to the base model (like a PEFT adapter).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from ..growth.adapter import POST, PRE
from ..growth.engine import reattach_adapters
from ..growth.families import resolve_family
from ..growth.record import RECORD_KEY, GrowthRecord, InvalidGrowthRecordError, growth_record, store_record

ADAPTER_WEIGHTS = "depthgrow_adapters.safetensors"
ADAPTER_CONFIG = "depthgrow_adapters.json"


def _adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if f".{PRE}." in k or f".{POST}." in k}


@contextlib.contextmanager
def _adapters_detached(model: nn.Module):
    """Take hosted adapter blocks out of the module tree (hooks then do nothing), put them back after."""
    taken = []
    for module in model.modules():
        for name in (PRE, POST):
            if name in module._modules:
                taken.append((module, name, module._modules.pop(name)))
    try:
        yield
    finally:
        for module, name, blocks in taken:
            module._modules[name] = blocks


def _atomic_dir(path: Path):
    """A temp folder beside `path`; `_commit` moves it into place so readers never see half a save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


def _commit(tmp: Path, path: Path) -> None:
    if path.exists():
        backup = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, backup)
        os.replace(tmp, path)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, path)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    adapters_only: bool = False,
    base_model: str | None = None,
    **kwargs,
) -> Path:
    """Save a grown model with safetensors, atomically.

    Args:
        model: A model grown by `grow_depth` (an ungrown model saves as usual).
        path: Output folder; replaced as a whole, never left half-written.
        tokenizer: Saved beside the model when given.
        adapters_only: Save only the adapter blocks and the growth record, with `base_model`
            (a Hub id or local path) as the reference to load the base weights from.
        base_model: Where the base weights live, required with `adapters_only=True`.

    Example:
        ```python
        >>> grow_depth(model, [3], block="adapter")
        >>> save_pretrained(model, "grown", tokenizer=tok)
        >>> same = load_pretrained("grown")
        ```
    """
    path = Path(path)
    record = growth_record(model)
    tmp = _atomic_dir(path)
    try:
        if adapters_only:
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
            with _adapters_detached(model):
                model.save_pretrained(str(tmp), safe_serialization=True, **kwargs)
        if record and record.adapters:
            save_file(_adapter_state(model), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _check_record_matches(model: nn.Module, record: GrowthRecord, path: Path) -> None:
    """The record must describe these weights: as many layers as the stack holds."""
    _, stack, _ = resolve_family(model)
    try:
        record.validate(num_layers=len(stack))
    except InvalidGrowthRecordError as err:
        raise InvalidGrowthRecordError(f"{path.name}: {err}") from None


def _model_class(architectures):
    name = (architectures or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"config.architectures={architectures!r} names no transformers class; cannot rebuild the model")
    return cls


def load_pretrained(path: str | os.PathLike, *, base_model: str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """Load a model saved by `save_pretrained`: native, adapter, or adapters-only with its base.

    `kwargs` go to transformers' `from_pretrained` (e.g. `dtype=`); `trust_remote_code` stays off
    unless passed.
    """
    path = Path(path)
    if (path / ADAPTER_CONFIG).exists():
        meta = json.loads((path / ADAPTER_CONFIG).read_text())
        base = base_model or meta["base_model"]
        model = _model_class(meta.get("architectures")).from_pretrained(str(base), **kwargs)
        record = GrowthRecord.from_dict(meta[RECORD_KEY])
        state = load_file(str(path / ADAPTER_WEIGHTS))
    else:
        config = transformers.AutoConfig.from_pretrained(str(path))
        raw = getattr(config, RECORD_KEY, None)
        record = GrowthRecord.from_dict(raw) if raw else None  # a forged record is refused before any weights load
        cls = _model_class(config.architectures)
        model = cls.from_pretrained(str(path), **kwargs)
        if record is not None:
            _check_record_matches(model, record, path)
        if not (record and record.adapters):
            return model
        if not (path / ADAPTER_WEIGHTS).exists():
            raise ValueError(f"{path}: the growth record lists adapter blocks but {ADAPTER_WEIGHTS} is missing")
        state = load_file(str(path / ADAPTER_WEIGHTS))
    _check_record_matches(model, record, path)
    store_record(model.config, record)
    reattach_adapters(model, record)
    expected = set(_adapter_state(model))
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"adapter weights do not match the growth record: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.load_state_dict(state, strict=False)
    return model

