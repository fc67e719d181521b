"""Output folders: checked before anything runs, locked while a command writes them, replaced atomically,
never deleted unless this tool wrote them.

Every output folder gets a marker file (`.hf_depthgrow_run`, holding the version and every file the run
wrote). `--overwrite` replaces only a folder that has it and holds nothing else (a user's own files are
never deleted: the folder is refused, naming them), and never one that is or holds the working
directory, the home directory, the filesystem root or an input. A run writes into a sibling `.NAME.tmp-<pid>` and is
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

from ..utils import (
    WRITE_ERRNOS, WriteError, at_command_end, atomic_write_text, command_line, command_scope, in_command, pid_alive, write_error,
)

MARKER = ".hf_depthgrow_run"

__all__ = [
    "MARKER", "OutputInUseError", "check_output_dir", "claim_output_dir", "command_scope", "foreign_files", "record_outputs", "staged_output",
]

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
    theirs = foreign_files(out)
    if theirs:
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        return f"it holds files hf-depthgrow did not write ({shown}): move them out of it first"
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


# ------------------------------------------------------------------ what the tool wrote

# A file changed this long after the marker was written is the user's (for a marker without a list of files).
_LEGACY_SLACK_S = 2.0


def _walk(folder: Path) -> list[str]:
    """Every file, link and empty folder under `folder` (relative, `/`-separated), links not followed."""
    found = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            found.append((rel / name).as_posix())
        if not dirs and not files and Path(root) != folder:
            found.append(rel.as_posix() + "/")
    return sorted(found)


def _read_marker(folder: Path) -> dict | None:
    """The marker's record (`{"hf_depthgrow": version, "files": [...]}`), or `None` for a marker without one."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    return record if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def _write_marker(folder: Path, files: list[str]) -> None:
    from ..utils import __version__

    record = {"hf_depthgrow": __version__, "files": sorted(set(files) - {MARKER})}
    atomic_write_text(folder / MARKER, json.dumps(record, indent=0) + "\n")


def foreign_files(folder) -> list[str]:
    """What in an output folder this tool did not write (relative paths; a folder ends in `/`): `--overwrite` keeps them.

    The marker lists every file the tool wrote. A marker without the list (an older version's) says only when the
    folder was finished: a file changed after that is the user's.
    """
    folder = Path(folder)
    record = _read_marker(folder)
    present = [f for f in _walk(folder) if f != MARKER]
    if record is not None:
        ours = set(record["files"])
        parents = {p.as_posix() + "/" for f in ours for p in Path(f).parents if p != Path(".")}
        return [f for f in present if f not in ours and f not in parents]
    finished = (folder / MARKER).stat().st_mtime
    return [f for f in present if (folder / f.rstrip("/")).lstat().st_mtime > finished + _LEGACY_SLACK_S]


def record_outputs(folder, paths) -> None:
    """Add files written into a finished output folder (after `staged_output`) to what its marker says the tool wrote.

    A folder among `paths` adds everything under it (a job that wrote in place, inside `claim_output_dir`).

    Example:
        ```python
        >>> paths = validation.save("runs/compare")  # beside the comparison, after it was swapped into place
        >>> record_outputs("runs/compare", paths.values())
        ```
    """
    folder = _resolved(folder)
    record = _read_marker(folder)
    if record is None:
        return  # an older marker: files newer than it are the user's, and these are
    added = []
    for path in map(_resolved, paths):
        rel = path.relative_to(folder).as_posix()
        if path.is_dir() and not path.is_symlink():
            added += [f"{rel}/{f}" for f in _walk(path)] or [rel + "/"]
        else:
            added.append(rel)
    _write_marker(folder, record["files"] + added)


def claim_output_dir(path, *, resume: bool, overwrite: bool, what: str) -> Path:
    """An output folder a long job writes in place (a study that reuses what an earlier run of it left): checked, marked.

    Absent or empty: created with the marker. Holding the marker (an earlier run of this tool): `resume` continues in
    it, `overwrite` first removes what the tool wrote there (the user's own files refuse it, naming them); with
    neither it is refused. Without the marker it is refused either way: nothing of it is ever changed. Files the job
    writes afterwards go into the marker with `record_outputs`.

    Args:
        path: The output folder.
        resume: Continue an earlier run in the folder.
        overwrite: Replace what an earlier run wrote there.
        what: The job in words, for the messages (`"a regime study"`).

    Example:
        ```python
        >>> out = claim_output_dir("runs/study", resume=True, overwrite=False, what="a regime study")
        ```
    """
    if resume and overwrite:
        raise ValueError("resume continues an earlier run and overwrite replaces it: give one of them")
    out = _resolved(path)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder")
    with _locked(out, path):
        if out.exists() and [f for f in _walk(out) if f != MARKER]:  # a marker alone: a run that failed before writing anything
            why = _why_not_replace(out, {})
            if why and not (out / MARKER).is_file():
                raise FileExistsError(f"will not write into {path}: {why}; choose another output folder")
            if why:
                raise FileExistsError(f"will not {'resume in' if resume else 'replace'} {path}: {why}")
            if not (resume or overwrite):
                raise FileExistsError(f"{path} holds {what} written earlier: pass --resume to continue it or --overwrite to replace it")
            if overwrite:
                _remove_listed(out)
        out.mkdir(parents=True, exist_ok=True)
        if _read_marker(out) is None:
            _write_marker(out, [f for f in _walk(out) if f != MARKER])  # an older marker: what is there now was the tool's
    return out


def _remove_listed(folder: Path) -> None:
    """Remove the files the marker lists (and the folders they leave empty); the marker stays, listing nothing."""
    record = _read_marker(folder)
    for name in record["files"] if record else [f for f in _walk(folder) if f != MARKER]:
        target = folder / name.rstrip("/")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif os.path.lexists(target):
            target.unlink()
        for parent in target.parents:
            if parent == folder or not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()
    _write_marker(folder, [])


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

        try:
            self.created = _make_parents(self.out)  # the lock file lives beside the folder
        except OSError as err:
            raise write_error(err, path) from err
        self.lock = FileLock(str(_lock_file(self.out)), timeout=0, thread_local=False)
        try:
            self.lock.acquire()
        except Timeout:
            _remove_empty(self.created)
            raise OutputInUseError(
                f"{path} is being written by another hf-depthgrow process ({_holder(self.out)}); two commands writing one "
                "output folder would lose one result: wait for it to finish or choose another output folder"
            ) from None
        except OSError as err:  # a read-only or forbidden parent: the folder could not be written either
            _remove_empty(self.created)
            raise write_error(err, path) from err
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


def _output_write_error(err: OSError, tmp: Path, path) -> OSError | None:
    """A full, read-only or forbidden output as one line naming the output path (the staging folder is gone by then);
    `None` for any other error (an input's, a bug's), which keeps its own words."""
    if isinstance(err, OutputInUseError) or err.errno not in WRITE_ERRNOS:
        return None
    if err.filename is not None and not str(err.filename).startswith(str(tmp)) and not isinstance(err, WriteError):
        return None  # another file than the output's (an input that cannot be read)
    text = " ".join(str(err).split())
    if str(tmp) in text:  # the writer named its file (a WriteError, save_pretrained's NoSpaceError): say it by its final path
        return WriteError(err.errno, text.replace(str(tmp), str(path)) + ("" if "unchanged" in text else f" ({path} is unchanged)"))
    reason = err.strerror or text
    return WriteError(err.errno, f"cannot write {path}: {reason} ({path} is unchanged)")



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
    theirs = foreign_files(out) if (out / MARKER).is_file() else []  # put there while this run worked (checked before it)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)  # a kill from here to the next rename is undone by the next run (_recover)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the old output back before reporting
        raise
    if theirs:
        _keep_foreign(old, out, theirs)
    else:
        _remove_ours(old)


def _keep_foreign(old: Path, out: Path, theirs: list[str]) -> None:
    """Files a user put into the output while it was being replaced: carried into the new one, or kept aside."""
    if any(os.path.lexists(out / f.rstrip("/")) for f in theirs):
        kept = out.parent / f"{out.name}.kept-{os.getpid()}"
        (old / MARKER).unlink(missing_ok=True)  # no longer this tool's to remove: it holds the user's files
        old.rename(kept)
        warnings.warn(f"the previous {out.name} held files hf-depthgrow did not write, under names the new output uses: "
                      f"kept the previous folder as {kept.name}", stacklevel=3)
        return
    for f in theirs:
        (out / f.rstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        os.rename(old / f.rstrip("/"), out / f.rstrip("/"))
    _remove_ours(old)
    warnings.warn(f"kept in {out}: {', '.join(theirs)} (not written by hf-depthgrow)", stacklevel=3)


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
    out = _resolved(path)
    with _locked(out, path) as fresh:
        overwrite = _CHECKED.pop(out, None)  # one check, one write: a later staged_output replaces as before
        if fresh and overwrite is not None:
            _check_contents(out, path, overwrite, {})
        created = _make_parents(out)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()  # outside the cleanup below were it to exist already: not ours to delete
        except OSError as err:
            _remove_empty(created)
            raise write_error(err, path) from err
        try:
            yield tmp
            # Written last: save_pretrained refuses a non-empty folder it did not write, and the temp folder is one.
            _write_marker(tmp, _walk(tmp))  # what this run wrote: --overwrite later removes that and nothing else
            _swap(tmp, out)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_empty(created)
            public = _output_write_error(err, tmp, path) if isinstance(err, OSError) else None
            if public is not None:
                raise public from err
            raise
