"""Small helpers shared by every subpackage: JSON that survives non-finite numbers, atomic writes, the version."""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def package_version() -> str:
    """The installed hf_depthgrow version, stamped into every result record."""
    from . import __version__

    return __version__


def json_safe(value, *, nonfinite: str = "string"):
    """`value` with numpy scalars made plain and non-finite floats made JSON-safe.

    Args:
        nonfinite: `"string"` writes NaN/inf as `"nan"`, `"inf"`, `"-inf"` (read back with
            `json_number`); `"null"` writes `None` where a missing value is what they mean
            (a probe statistic that could not be measured).

    Example:
        ```python
        >>> json_safe({"a": float("inf"), "b": [1.5, float("nan")]})
        {'a': 'inf', 'b': [1.5, 'nan']}
        ```
    """
    if isinstance(value, dict):
        return {str(k): json_safe(v, nonfinite=nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, nonfinite=nonfinite) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        if nonfinite == "null":
            return None
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def json_number(value):
    """Undo `json_safe` for one number: `"nan"`, `"inf"`, `"-inf"` become floats again."""
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


@contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = ".tmp"):
    """A temp file beside `path` to write into; when the block ends without error it gets the usual mode and replaces `path`.

    One `os.replace`: a reader sees the old file or the new one, never half of it. The mode is the
    umask-derived one a plain `open` gives (0644 under umask 022), not mkstemp's 0600.

    Example:
        ```python
        >>> with atomic_path("out/loss.png", suffix=".png") as tmp:
        ...     fig.savefig(tmp)
        ```
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (`atomic_path`), with the usual file mode."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data, *, indent: int = 2) -> Path:
    """`data` as sorted, strict JSON (non-finite numbers as strings), written atomically."""
    return atomic_write_text(path, json.dumps(json_safe(data), indent=indent, sort_keys=True, allow_nan=False) + "\n")


def umask() -> int:
    """The process umask (read without changing it for good)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ the command a process is running

_COMMAND = {"depth": 0, "line": None, "at_end": []}


@contextmanager
def command_scope(command: str | None = None):
    """Mark the block as one command: what registers with `at_command_end` inside it runs when it ends.

    Every `hf-depthgrow` command runs in one; the output folders it locks stay locked until it ends
    (`hf_depthgrow.pipeline.output`). Kept here, away from the heavy packages, so `--help` stays fast.

    Args:
        command: The command line, recorded beside a locked output folder so that a second writer can name it.

    Example:
        ```python
        >>> with command_scope("hf-depthgrow grow ..."):
        ...     check_output_dir("runs/x", overwrite=False)  # locked until the block ends
        ```
    """
    outer = _COMMAND["line"]
    _COMMAND["depth"] += 1
    _COMMAND["line"] = command or outer
    try:
        yield
    finally:
        _COMMAND["depth"] -= 1
        _COMMAND["line"] = outer
        if not _COMMAND["depth"]:
            callbacks, _COMMAND["at_end"] = _COMMAND["at_end"], []
            for callback in reversed(callbacks):
                callback()


def in_command() -> bool:
    """Whether a `command_scope` is open."""
    return _COMMAND["depth"] > 0


def command_line() -> str | None:
    """The command line given to the open `command_scope` (`None` outside one)."""
    return _COMMAND["line"]


def at_command_end(callback) -> None:
    """Call `callback()` when the open `command_scope` ends."""
    _COMMAND["at_end"].append(callback)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (a live process of another user, or an unknowable answer, counts as alive:
    callers use it to decide whether files a process left may be cleaned, and must leave them when in doubt)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True
