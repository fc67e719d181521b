"""Output folders: checked before anything runs, locked while a command writes them, replaced atomically,
never deleted unless this tool wrote them.

Every output folder gets a marker file (`.hf_depthgrow_run`, holding the version). `--overwrite`
replaces only a folder that has it, and never one that is or holds the working directory, the home
directory, the filesystem root or an input. A run writes into a sibling `.NAME.tmp-<pid>` and is
swapped into place only when it succeeded, so a failure leaves the old output as it was.

One writer per folder: `check_output_dir` and `staged_output` take an exclusive lock on the file
`.NAME.lock` beside the folder (`filelock`: an OS lock, released by the kernel when its process dies),
and record the holder (pid, host, command) in `.NAME.lock.json`, so that a second command writing the
same folder fails at once naming the first. Inside a command (`command_scope`, which every
`hf-depthgrow` command runs in) the lock is held until the command ends; called from Python, each
helper holds it while it works. Whoever takes the lock first puts back or removes what a killed run
left beside the folder (see `_recover`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..utils import at_command_end, atomic_write_text, command_line, command_scope, in_command, pid_alive

MARKER = ".hf_depthgrow_run"

__all__ = ["MARKER", "OutputInUseError", "check_output_dir", "command_scope", "staged_output"]

_HELD: dict[Path, "_Lock"] = {}  # output folders this process holds the lock of
_CHECKED: dict[Path, bool] = {}  # output folder -> the `overwrite` it was checked with


def _unlink_safe() -> bool:
    # filelock >= 4 checks, once it holds a lock, that its file was not unlinked meanwhile (and then fails the
    # attempt), so the holder may remove the file; with 3.x two processes could then hold "the" lock.
    from filelock import __version__

    return int(__version__.split(".")[0]) >= 4


_UNLINK_SAFE = _unlink_safe()


class OutputInUseError(OSError):
    """Another process holds the lock of the output folder (an input error: exit code 2 in the CLI)."""


def _resolved(path) -> Path:
    return Path(path).expanduser().resolve()


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _why_not_replace(out: Path, inputs: dict) -> str | None:
    """Why `--overwrite` must not delete `out` (`None`: it may)."""
    if out == Path(out.anchor):
        return "it is the filesystem root"
    if _inside(Path.home().resolve(), out):
        return "it is or holds the home directory"
    if _inside(Path.cwd().resolve(), out):
        return "it is or holds the working directory"
    for label, value in inputs.items():
        if value and Path(str(value)).expanduser().exists() and _inside(_resolved(value), out):
            return f"it holds the input {label} {value}"
    if not (out / MARKER).is_file():
        return f"it was not written by hf-depthgrow (no {MARKER} file)"
    return None


def _check_contents(out: Path, path, overwrite: bool, inputs: dict) -> None:
    if not out.exists() or not any(out.iterdir()):
        return
    why = _why_not_replace(out, inputs)
    if not overwrite:
        # --overwrite is offered only where it would be accepted.
        if why:
            raise FileExistsError(f"{path} exists and is not empty, and --overwrite would not replace it: {why}; "
                                  "choose another output folder")
        raise FileExistsError(f"{path} exists and is not empty; pass --overwrite to replace it")
    if why:
        raise FileExistsError(f"will not replace {path} with --overwrite: {why}")


def check_output_dir(path, *, overwrite: bool, inputs: dict | None = None) -> Path:
    """Refuse, touching nothing, an output folder that a run could not write without losing something.

    Also refused: a folder another process is writing (its lock is held). Inside `command_scope` the
    lock taken here stays held until the command ends, so nobody else can write the folder meanwhile.

    Args:
        path: The output folder (it may not exist yet).
        overwrite: Whether a non-empty folder may be replaced (only one this tool wrote).
        inputs: `{label: path or name}` of the run's inputs; a folder holding one is never replaced.

    Example:
        ```python
        >>> check_output_dir("runs/x", overwrite=True, inputs={"model": "smollm2"})
        ```
    """
    out = _resolved(path)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder")
    with _locked(out, path):
        _check_contents(out, path, overwrite, inputs or {})
    _CHECKED[out] = overwrite
    return out


# ------------------------------------------------------------------ the lock


@contextmanager
def _locked(out: Path, path):
    """Hold `out`'s lock in the block (and after it, inside a command scope); yield whether it was taken here."""
    if out in _HELD:
        yield False
        return
    _HELD[out] = _Lock(out).acquire(path)
    try:
        yield True
    except BaseException:
        _HELD.pop(out).release()
        raise
    if in_command():
        at_command_end(lambda: _HELD.pop(out).release())
    else:
        _HELD.pop(out).release()


def _lock_file(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _owner_file(out: Path) -> Path:
    return out.parent / f".{out.name}.lock.json"



def _read_owner(out: Path) -> dict:
    try:
        owner = json.loads(_owner_file(out).read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


class _Lock:
    """The exclusive lock of one output folder, with its holder record."""

    def __init__(self, out: Path):
        self.out = out
        self.created: list[Path] = []
        self.lock = None

    def acquire(self, path) -> "_Lock":
        from filelock import FileLock, Timeout

        self.created = _make_parents(self.out)  # the lock file lives beside the folder
        self.lock = FileLock(str(_lock_file(self.out)), timeout=0, thread_local=False)
        try:
            self.lock.acquire()
        except Timeout:
            _remove_empty(self.created)
            raise OutputInUseError(
                f"{path} is being written by another hf-depthgrow process ({_holder(self.out)}); two commands writing one "
                "output folder would lose one result: wait for it to finish or choose another output folder"
            ) from None
        try:
            previous = _read_owner(self.out)  # the record of a run that died holding the lock, if any
            earlier = previous.get("leftovers_of")
            dead = [p for p in [previous.get("pid"), *(earlier if isinstance(earlier, list) else [])] if isinstance(p, int)]
            if previous.get("host") not in (None, socket.gethostname()):
                dead = []  # another machine's pids say nothing here
            command = command_line() or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
            record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
            # Written before the recovery: were this run killed during it, the next one still knows whose leftovers they are.
            self._write_owner({**record, "leftovers_of": dead})
            _recover(self.out, set(dead))
            self._write_owner(record)
        except BaseException:
            self.release()
            raise
        return self

    def _write_owner(self, record: dict) -> None:
        atomic_write_text(_owner_file(self.out), json.dumps(record) + "\n")

    def release(self) -> None:
        if self.lock is None or not self.lock.is_locked:
            return
        try:
            _owner_file(self.out).unlink(missing_ok=True)
            if _UNLINK_SAFE:  # removed while still held: nothing of the lock stays beside the folder
                _lock_file(self.out).unlink(missing_ok=True)
        finally:
            self.lock.release()
            _remove_empty(self.created)


def _holder(out: Path) -> str:
    """Who holds `out`'s lock, in words (the record is written right after the lock is taken: wait a moment for it)."""
    for _ in range(20):
        owner = _read_owner(out)
        pid = owner.get("pid")
        if isinstance(pid, int) and (owner.get("host") != socket.gethostname() or pid_alive(pid)):
            where = "" if owner.get("host") == socket.gethostname() else f" on {owner.get('host')}"
            return f"pid {pid}{where}: {owner.get('command') or 'command unknown'}"
        time.sleep(0.05)
    return "pid unknown"


# ------------------------------------------------------------------ what a killed run left


def _leftovers(out: Path, dead: set[int]) -> tuple[list[Path], list[Path], list[Path]]:
    """`(olds, tmps, unknown)`: the `.NAME.old-<pid>` and `.NAME.tmp-<pid>` folders of dead runs.

    One is this tool's when its pid is dead (or this process's: it holds the lock, so it is not writing
    one) and it holds the output marker, is empty, or is named in the record of the run that died
    holding the lock. Anything else matching the pattern is `unknown` and left alone.
    """
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)$")
    olds, tmps, unknown = [], [], []
    for entry in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        match = pattern.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match.group(2))
        if pid != os.getpid() and pid_alive(pid):
            continue
        ours = pid in dead or (entry / MARKER).is_file() or not any(entry.iterdir())
        (unknown if not ours else olds if match.group(1) == "old" else tmps).append(entry)
    return olds, tmps, unknown


def _recover(out: Path, dead: set[int]) -> None:
    """Put back an output that a killed `--overwrite` had moved aside, and remove the rest of what killed runs left.

    A run killed between the two renames of `_swap` leaves no output and `.NAME.old-<pid>`: the old
    output goes back (the new one was never reported). A temp folder of a killed run, or a moved-aside
    output whose replacement is in place, is removed.
    """
    olds, tmps, unknown = _leftovers(out, dead)
    if not os.path.lexists(out) and olds:
        newest = max(olds, key=lambda p: p.stat().st_mtime)
        newest.rename(out)
        olds.remove(newest)
        warnings.warn(f"put back {out} from {newest.name}: a run replacing it was killed half-way", stacklevel=2)
    if olds or tmps:
        names = ", ".join(p.name for p in olds + tmps)
        warnings.warn(f"removing what killed hf-depthgrow runs left beside {out}: {names}", stacklevel=2)
        for folder in olds + tmps:
            _remove_ours(folder)
    if unknown:
        warnings.warn(f"left alone beside {out}: {', '.join(p.name for p in unknown)} (not provably hf-depthgrow's)", stacklevel=2)


def _remove_ours(folder: Path) -> None:
    """Remove a folder this tool wrote, its marker last: a removal cut short still says whose the folder is."""
    for child in folder.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (folder / MARKER).unlink(missing_ok=True)
    folder.rmdir()


# ------------------------------------------------------------------ writing


def _make_parents(folder: Path) -> list[Path]:
    """Create the missing parents of `folder`; return them, deepest first, for removal on failure."""
    missing = [p for p in folder.parents if not p.exists()]
    for parent in reversed(missing):
        parent.mkdir()
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()


def _swap(tmp: Path, out: Path) -> None:
    """Put the finished `tmp` where `out` is: the old folder is moved aside first, then removed."""
    if not out.exists():
        tmp.rename(out)
        return
    if not any(out.iterdir()):  # an empty folder (perhaps the working directory): fill it, never remove it
        for child in tmp.iterdir():
            child.rename(out / child.name)
        tmp.rmdir()
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)  # a kill from here to the next rename is undone by the next run (_recover)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the old output back before reporting
        raise
    _remove_ours(old)


@contextmanager
def staged_output(path):
    """Yield a fresh, empty sibling temp folder; on success it gets the marker and replaces `path`, on failure it goes.

    Call `check_output_dir` first: this replaces whatever is at `path`. The folder's lock is held
    throughout; if it was not held since the check, the folder is checked again under the lock
    (another process may have written it meanwhile).

    Example:
        ```python
        >>> with staged_output("runs/x") as tmp:
        ...     (tmp / "summary.json").write_text("{}")
        ```
    """
    from .. import __version__

    out = _resolved(path)
    with _locked(out, path) as fresh:
        overwrite = _CHECKED.pop(out, None)  # one check, one write: a later staged_output replaces as before
        if fresh and overwrite is not None:
            _check_contents(out, path, overwrite, {})
        created = _make_parents(out)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()  # outside the cleanup below were it to exist already: not ours to delete
        except OSError:
            _remove_empty(created)
            raise
        try:
            yield tmp
            # Written last: save_pretrained refuses a non-empty folder it did not write, and the temp folder is one.
            (tmp / MARKER).write_text(f"hf_depthgrow {__version__}\n")
            _swap(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_empty(created)
            raise
