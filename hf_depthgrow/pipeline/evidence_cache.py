"""Evidence a later run reuses: the probe, the stepping stones and the original's losses of an identical earlier run.

None of them depends on what is trained afterwards, only on the original model, the data it read and
the settings that produced it: a run that changes the training (steps, learning rate, the control,
retention) computes the same numbers again, about a quarter of the default run. So each is stored under a
key that hashes everything it depends on: every weight and the config of the model, every row of the
data, its settings, the versions of torch and transformers, and the source of this package (a code
change never reuses an entry). A hit gives back what was stored, bit for bit; an entry that cannot be
read is skipped with a warning and the evidence is computed afresh.

An entry is a folder `<root>/<kind>/<key>/` with `entry.json` (what it depends on and what it holds) and,
for tensors, `tensors.safetensors` (never pickle). It is written in a temporary folder beside it and
renamed into place, so a reader sees a whole entry or none. Nothing here deletes an entry or anything
else: clear the cache by removing its folder. The folder: `RunConfig.evidence_cache`, whose `"auto"` is
`$HF_DEPTHGROW_EVIDENCE_CACHE` where set (a folder, or `none`: off), else `evidence/` under the package's
cache root (`$HF_DEPTHGROW_CACHE`, else `~/.cache/hf_depthgrow`, where the SmolLM2 copy lives too);
`"none"` switches it off.

Example:
    ```python
    >>> cache = EvidenceCache.from_setting("auto")
    >>> parts = {"model": weights_fingerprint(model), "train": rows_fingerprint(train_rows), "batch_size": 8}
    >>> entry = cache.load("probe", parts)                  # None on a miss
    >>> cache.store("probe", parts, {"signal": [0.1, 0.2]}) # the key, or None where it cannot write
    ```
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..utils import package_version

__all__ = ["EVIDENCE_ENV", "EvidenceCache", "Entry", "default_root", "rows_fingerprint", "weights_fingerprint"]

EVIDENCE_ENV = "HF_DEPTHGROW_EVIDENCE_CACHE"
FORMAT = 1
_ENTRY, _TENSORS = "entry.json", "tensors.safetensors"
_OFF = ("none", "off", "null", "0", "false")


def default_root() -> Path | None:
    """`$HF_DEPTHGROW_EVIDENCE_CACHE` (`none`: off), else `evidence/` under `hf_depthgrow.data.models.default_cache_root()`."""
    from ..data.models import default_cache_root

    env = os.environ.get(EVIDENCE_ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    return default_cache_root() / "evidence"


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def weights_fingerprint(model) -> str:
    """sha256 over the model's config and every tensor of its state dict (name, dtype, shape and values).

    Values, not just shapes: a fine-tuned copy of the same architecture must not reuse the original's evidence.
    """
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string(use_diff=False) if config is not None else type(model).__name__).encode())
    for name, t in model.state_dict().items():
        h.update(f"\0{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _update(h, value) -> None:
    if torch.is_tensor(value):
        h.update(f"t{value.dtype}{tuple(value.shape)}".encode())
        h.update(_tensor_bytes(value))
    elif isinstance(value, np.ndarray) and value.dtype != object:
        h.update(f"a{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (list, tuple, np.ndarray)):
        h.update(f"l{len(value)}[".encode())
        for item in value:
            _update(h, item)
        h.update(b"]")
    else:
        h.update(f"v{type(value).__name__}:{value!r};".encode())


def rows_fingerprint(rows) -> str:
    """sha256 over every row of `rows` (a `datasets.Dataset` column by column, or a list of row dicts), in order.

    Every row, not a sample: a reused probe must have read exactly these examples.
    """
    h = hashlib.sha256()
    if hasattr(rows, "column_names") and hasattr(rows, "with_format"):
        table = rows.with_format("numpy")
        h.update(f"dataset:{len(rows)}".encode())
        for start in range(0, len(rows), 1024):  # slices read as arrays (a column alone is a lazy view)
            chunk = table[start : start + 1024]
            for column in sorted(rows.column_names):
                h.update(f"\0{column}\0".encode())
                _update(h, chunk[column])
        return h.hexdigest()
    h.update(f"rows:{len(rows)}".encode())
    for row in rows:
        for key in sorted(row):
            h.update(f"\0{key}\0".encode())
            _update(h, row[key])
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 over this package's Python source: an entry written by other code is never reused."""
    h = hashlib.sha256(package_version().encode())
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def environment() -> dict:
    """The software an entry was computed with (part of every key)."""
    import transformers

    return {"code": code_fingerprint(), "torch": torch.__version__, "transformers": transformers.__version__}


@dataclass(frozen=True)
class Entry:
    """One stored entry: its `key`, the JSON `meta` it holds and its `tensors` (empty without)."""

    key: str
    meta: dict
    tensors: dict


class EvidenceCache:
    """Entries under `root` (`None`: switched off: every `load` misses and `store` writes nothing).

    Args:
        root: The cache folder; created on the first `store`.
    """

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None

    @classmethod
    def from_setting(cls, setting: str | None) -> "EvidenceCache":
        """`"auto"` (`default_root()`), `None` / `"none"` (off) or a folder."""
        if setting is None or setting.strip().lower() in _OFF:
            return cls(None)
        return cls(default_root() if setting == "auto" else Path(setting).expanduser())

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @staticmethod
    def key(kind: str, parts: dict) -> str:
        """The entry's key: a hash of its kind, the format, the environment and `parts`."""
        return _sha({"kind": kind, "format": FORMAT, "environment": environment(), "parts": parts})

    def _folder(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def load(self, kind: str, parts: dict) -> Entry | None:
        """The entry `parts` names, or `None` (missing, off, or unreadable: then with a warning)."""
        if not self.enabled:
            return None
        key = self.key(kind, parts)
        folder = self._folder(kind, key)
        if not (folder / _ENTRY).is_file():
            return None
        try:
            entry = json.loads((folder / _ENTRY).read_text(encoding="utf-8"))
            if entry.get("format") != FORMAT or entry.get("kind") != kind or entry.get("key") != key:
                raise ValueError("its header does not match the key it is stored under")
            tensors = {}
            if entry.get("tensors"):
                from safetensors.torch import load_file

                tensors = load_file(str(folder / _TENSORS))
                if sorted(tensors) != sorted(entry["tensors"]):
                    raise ValueError("its tensor file does not hold the tensors its header lists")
            return Entry(key, entry["meta"], tensors)
        except Exception as err:  # any unreadable entry: computed afresh, never fatal
            warnings.warn(f"evidence cache: ignoring the unreadable {kind} entry {key[:12]} ({err}); computing it afresh", stacklevel=2)
            return None

    def store(self, kind: str, parts: dict, meta: dict, tensors: dict | None = None) -> str | None:
        """Write an entry atomically; returns its key, or `None` (off, or it could not write: then with a warning).

        An entry already in place is kept as it is (an identical key holds identical evidence).
        """
        if not self.enabled:
            return None
        key = self.key(kind, parts)
        final = self._folder(kind, key)
        if (final / _ENTRY).is_file():
            return key
        tmp = final.parent / f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            names = sorted(tensors or {})
            if names:
                from safetensors.torch import save_file

                save_file({n: tensors[n].detach().to("cpu").contiguous() for n in names}, str(tmp / _TENSORS))
            header = {"format": FORMAT, "kind": kind, "key": key, "written_by": f"hf_depthgrow {package_version()}",
                      "parts": parts, "tensors": names, "meta": meta}  # fmt: skip
            (tmp / _ENTRY).write_text(json.dumps(header, indent=1, sort_keys=True, allow_nan=False), encoding="utf-8")
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / _ENTRY).is_file():
                    raise
                # Another run wrote the same entry first: keep theirs.
        except Exception as err:  # a full disk or a read-only cache must not fail the run it speeds up
            warnings.warn(f"evidence cache: could not write the {kind} entry under {self.root} ({err}); the run goes on", stacklevel=2)
            key = None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # our own temporary folder only
        return key
