"""Output folders: checked before anything runs, replaced atomically, never deleted unless this tool wrote them.

Every output folder gets a marker file (`.hf_depthgrow_run`, holding the version). `--overwrite`
replaces only a folder that has it, and never one that is or holds the working directory, the home
directory, the filesystem root or an input. A run writes into a sibling `.NAME.tmp-<pid>` and is
swapped into place only when it succeeded, so a failure leaves the old output as it was.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

MARKER = ".hf_depthgrow_run"

__all__ = ["MARKER", "check_output_dir", "staged_output"]


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


def check_output_dir(path, *, overwrite: bool, inputs: dict | None = None) -> Path:
    """Refuse, touching nothing, an output folder that a run could not write without losing something.

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
    if not out.exists() or not any(out.iterdir()):
        return out
    if not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass --overwrite to replace it")
    why = _why_not_replace(out, inputs or {})
    if why:
        raise FileExistsError(f"will not replace {path} with --overwrite: {why}")
    return out


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
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the old output back before reporting
        raise
    shutil.rmtree(old)


@contextmanager
def staged_output(path):
    """Yield a fresh, empty sibling temp folder; on success it gets the marker and replaces `path`, on failure it goes.

    Call `check_output_dir` first: this replaces whatever is at `path`.

    Example:
        ```python
        >>> with staged_output("runs/x") as tmp:
        ...     (tmp / "summary.json").write_text("{}")
        ```
    """
    from .. import __version__

    out = _resolved(path)
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
