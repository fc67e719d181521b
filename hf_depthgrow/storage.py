"""Content-addressed entries on disk: the one storage format of the evidence cache, the trial store and its checkpoints.

An entry is a folder `<root>/<kind>/<key>/` with `entry.json` (what it depends on and what it holds),
for tensors `tensors.safetensors` (never pickle), and `digest.json`, the sha256 of each of those files,
written last. It is written in a temporary folder beside it and renamed into place whole, so a reader
(on this machine or another one sharing the folder) sees a whole entry or none; of two writers of the
same key, the first rename wins and the other keeps it. Every read hashes the bytes it then parses: an
entry whose files do not match its digest (bit rot, a hand edit, a partial copy) or that has none is
never reused, nor is one that cannot be parsed or that was written for another key (a folder renamed or
copied). It is moved aside to `<kind>/.rejected-<key>-...` (kept for inspection, never deleted), with one
warning, and the caller computes it afresh. A write that fails (a full disk, a read-only folder) warns
once, naming the folder and why, and the caller goes on without it. The digest detects damage and edits,
not a forger who rewrites the digest too. Nothing here deletes an entry.

Keys hash what an entry depends on: `sha256_of` (sorted JSON), `weights_fingerprint` (every weight and the
config of a model), `rows_fingerprint` (every row of the data), `environment` (this package's source, torch
and transformers).

Example:
    ```python
    >>> store = EntryStore("runs/store")
    >>> parts = {"model": weights_fingerprint(model), "train": rows_fingerprint(train_rows), "batch_size": 8}
    >>> store.store("probe", parts, {"signal": [0.1, 0.2]})  # the key, or None where it cannot write
    >>> store.load("probe", parts).meta
    {'signal': [0.1, 0.2]}
    ```
"""


from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .losses import DOCUMENT_COLUMN
from .utils import package_version

__all__ = [
    "ENTRY_FILE", "Entry", "EntryStore", "TENSORS_FILE", "UnverifiedEntryError", "code_fingerprint", "environment", "is_whole",
    "read_verified", "rows_fingerprint", "set_aside", "sha256_of", "weights_fingerprint", "write_digest",
]

FORMAT = 2  # 2: entries carry digest.json
ENTRY_FILE, TENSORS_FILE, _DIGEST = "entry.json", "tensors.safetensors", "digest.json"


def sha256_of(data) -> str:
    """The sha256 of `data` as sorted JSON: the key of an evidence entry or a stored trial."""
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

    Every row, not a sample: a reused probe must have read exactly these examples. The `document` column is left
    out: which document a block came from changes no loss, only how the statistics group the blocks.
    """
    h = hashlib.sha256()
    if hasattr(rows, "column_names") and hasattr(rows, "with_format"):
        table = rows.with_format("numpy")
        h.update(f"dataset:{len(rows)}".encode())
        for start in range(0, len(rows), 1024):  # slices read as arrays (a column alone is a lazy view)
            chunk = table[start : start + 1024]
            for column in sorted(c for c in rows.column_names if c != DOCUMENT_COLUMN):
                h.update(f"\0{column}\0".encode())
                _update(h, chunk[column])
        return h.hexdigest()
    h.update(f"rows:{len(rows)}".encode())
    for row in rows:
        for key in sorted(k for k in row if k != DOCUMENT_COLUMN):
            h.update(f"\0{key}\0".encode())
            _update(h, row[key])
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 over this package's Python source: an entry written by other code is never reused."""
    h = hashlib.sha256(package_version().encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def environment() -> dict:
    """The software an entry was computed with (part of every key)."""
    import transformers

    return {"code": code_fingerprint(), "torch": torch.__version__, "transformers": transformers.__version__}


class UnverifiedEntryError(ValueError):
    """An entry whose files do not match its digest, or that has none: never reused."""


def _sha_files(folder: Path, names) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(names)}


def write_digest(folder: str | os.PathLike) -> None:
    """Write `digest.json`: the sha256 of every other file of the entry in `folder` (its last file)."""
    folder = Path(folder)
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != _DIGEST]
    digest = {"algorithm": "sha256", "files": _sha_files(folder, names)}
    (folder / _DIGEST).write_text(json.dumps(digest, indent=1, sort_keys=True), encoding="utf-8")


def read_verified(folder: str | os.PathLike) -> dict[str, bytes]:
    """The bytes of every file `folder`'s digest lists, each checked against its sha256.

    Raises `UnverifiedEntryError` naming the first problem: no digest (written without one, or copied
    in part), a listed file missing or not matching, or a digest that does not cover `entry.json`.
    """
    folder = Path(folder)
    try:
        listed = json.loads((folder / _DIGEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        raise UnverifiedEntryError(f"it has no {_DIGEST} (written by an older version, or copied in part)") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise UnverifiedEntryError(f"its {_DIGEST} cannot be read ({err})") from None
    if not isinstance(listed, dict) or ENTRY_FILE not in listed or not set(listed) <= {ENTRY_FILE, TENSORS_FILE}:
        raise UnverifiedEntryError(f"its {_DIGEST} does not list exactly its files")
    files = {}
    for name, expected in listed.items():
        try:
            files[name] = (folder / name).read_bytes()
        except FileNotFoundError:
            raise UnverifiedEntryError(f"{name}, which its digest lists, is missing") from None
        if hashlib.sha256(files[name]).hexdigest() != expected:
            raise UnverifiedEntryError(f"{name} does not match its sha256 in {_DIGEST} (edited or damaged)")
    return files


def is_whole(folder: Path) -> bool:
    """Whether `folder` holds an entry that passes its digest (no warning: `load` is where damage is reported)."""
    try:
        read_verified(folder)
        return True
    except (UnverifiedEntryError, OSError):
        return False


def _in_place(folder: Path, kind: str, key: str) -> bool:
    """Whether `folder` holds a whole entry written for this `kind` and `key` (a whole entry renamed from another
    key's folder passes its digest, yet holds another key's evidence)."""
    if not is_whole(folder):
        return False
    try:
        header = json.loads((folder / ENTRY_FILE).read_text(encoding="utf-8"))
        return header.get("format") == FORMAT and header.get("kind") == kind and header.get("key") == key
    except (OSError, ValueError, AttributeError):
        return False


def set_aside(folder: Path, key: str, into: Path | None = None) -> Path | None:
    """Move an unverified entry to `.rejected-<key>-<time>-<pid>` beside it (or in `into`); `None` where it cannot.

    A rename, not a deletion: what is wrong with it stays there to be looked at. Of two runs doing this at
    once, one renames and the other finds it gone; both then compute the evidence and store it.
    """
    name = f".rejected-{key[:16]}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    aside = (into if into is not None else folder.parent) / name
    try:
        os.rename(folder, aside)
    except OSError:
        return None
    return aside


def _why_unwritable(root: Path, err: BaseException) -> str:
    """Why a write under `root` failed, in words: a file where a folder should be, else the error's own reason."""
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return f"{blocker} is a file, not a folder"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror  # "No space left on device", "Read-only file system", "Permission denied"
    text = str(err).strip()
    for known in ("No space left on device", "Read-only file system", "Permission denied", "Disk quota exceeded"):
        if known in text:  # safetensors wraps the OS error in its own, as a debug string
            return known
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class Entry:
    """One stored entry: its `key`, the JSON `meta` it holds and its `tensors` (empty without)."""

    key: str
    meta: dict
    tensors: dict


class EntryStore:
    """Entries under `root` (`None`: switched off: every `load` misses and `store` writes nothing).

    A write that fails (a full disk, a read-only folder, a file where the folder should be) warns once, naming
    the folder and why, and the run goes on; later failures of the same cache are silent.

    Args:
        root: The cache folder; created on the first `store`.
    """

    label = "entry store"  # how its warnings name it

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None
        self.write_failed = False

    def redo(self) -> str:
        """What the run does instead of reusing an entry it does not trust (the end of each such warning)."""
        return "computing it afresh"

    def unstored(self) -> str:
        """What a failed write costs (said once, in its warning)."""
        return "the evidence is not stored"

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @staticmethod
    def key(kind: str, parts: dict) -> str:
        """The entry's key: a hash of its kind, the format, the environment and `parts`."""
        return sha256_of({"kind": kind, "format": FORMAT, "environment": environment(), "parts": parts})

    def _folder(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def load(self, kind: str, parts: dict, *, name: str | None = None) -> Entry | None:
        """The entry `parts` names, or `None` (missing, off, unverified or unreadable: the last two with a warning).

        An entry that fails its digest, cannot be parsed, or was written for another key (a folder renamed) is
        moved aside, so that the fresh result `store` writes takes its place. `name` names the entry in warnings.
        """
        if not self.enabled:
            return None
        key = self.key(kind, parts)
        folder = self._folder(kind, key)
        if not folder.exists():
            return None
        what = name or f"{kind} entry {key[:12]}"
        try:
            files = read_verified(folder)
            entry = json.loads(files[ENTRY_FILE].decode("utf-8"))
            if entry.get("format") != FORMAT or entry.get("kind") != kind or entry.get("key") != key:
                raise ValueError("its header does not match the key it is stored under (a folder renamed or copied from another key)")
            tensors = {}
            if entry.get("tensors"):
                from safetensors.torch import load as load_bytes

                if TENSORS_FILE not in files:
                    raise UnverifiedEntryError(f"its digest does not cover {TENSORS_FILE}")
                tensors = load_bytes(files[TENSORS_FILE])  # the very bytes that were hashed
                if sorted(tensors) != sorted(entry["tensors"]):
                    raise ValueError("its tensor file does not hold the tensors its header lists")
            return Entry(key, entry["meta"], tensors)
        except UnverifiedEntryError as err:
            self.reject(kind, key, f"not reusing the {what}: {err}", damaged=True)
        except OSError as err:  # a file it cannot read (permissions): left where it is
            warnings.warn(f"{self.label}: cannot read the {what} ({err}); {self.redo()}", stacklevel=2)
        except Exception as err:  # any unreadable entry: never fatal, never trusted
            self.reject(kind, key, f"ignoring the unreadable {what} ({err})")
        return None

    def reject(self, kind: str, key: str, message: str, *, damaged: bool = False) -> None:
        """Move the entry of `key` aside (kept, never deleted) and warn with `message`: it is not reused."""
        aside = set_aside(self._folder(kind, key), key)
        where = f"moved aside to {aside}" if aside else "not moved: a read-only store, or another run moved it first"
        warnings.warn(f"{self.label}: {message}; {self.redo()} (the {'damaged ' if damaged else ''}entry is {where})", stacklevel=3)

    def store(self, kind: str, parts: dict, meta: dict, tensors: dict | None = None) -> str | None:
        """Write an entry atomically; returns its key, or `None` (off, or it could not write: then with a warning).

        An entry already in place that passes its digest and names this key is kept as it is (an identical key
        holds identical evidence); any other is moved aside, with a warning, and replaced.
        """
        if not self.enabled:
            return None
        key = self.key(kind, parts)
        final = self._folder(kind, key)
        if _in_place(final, kind, key):
            return key
        tmp = final.parent / f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            names = sorted(tensors or {})
            if names:
                from safetensors.torch import save_file

                save_file({n: tensors[n].detach().to("cpu").contiguous() for n in names}, str(tmp / TENSORS_FILE))
            header = {"format": FORMAT, "kind": kind, "key": key, "written_by": f"hf_depthgrow {package_version()}",
                      "parts": parts, "tensors": names, "meta": meta}
            (tmp / ENTRY_FILE).write_text(json.dumps(header, indent=1, sort_keys=True, allow_nan=False), encoding="utf-8")
            write_digest(tmp)  # last: a folder with a valid digest holds every file it lists
            if final.exists() and not _in_place(final, kind, key):  # an entry `load` did not move aside: out of the way
                why = "fails its digest" if not is_whole(final) else "was written for another key"
                if aside := set_aside(final, key):
                    warnings.warn(f"{self.label}: the {kind} entry {key[:12]} in place {why}; replacing it "
                                  f"(the entry in place is moved aside to {aside})", stacklevel=2)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _in_place(final, kind, key):
                    raise
                # Another run (here or on another machine sharing the folder) wrote the same entry first: keep theirs.
        except Exception as err:  # a full disk or a read-only cache must not fail the run it speeds up
            self.warn_unwritable(err)
            key = None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # our own temporary folder only
        return key

    def warn_unwritable(self, err: BaseException) -> None:
        """A write under `root` failed: warn the first time, naming the folder and why (the run goes on)."""
        if not self.write_failed:
            warnings.warn(f"{self.label}: could not write under {self.root} ({_why_unwritable(self.root, err)}): {self.unstored()}; "
                          "the run goes on", stacklevel=3)
        self.write_failed = True
