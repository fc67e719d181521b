"""Small helpers shared by every subpackage: JSON that survives non-finite numbers, atomic writes, config files read and
named in every error, integer settings checked, the version."""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

__version__ = "0.1.0"  # pyproject.toml states it too

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def package_version() -> str:
    """The installed hf_depthgrow version, stamped into every result record."""
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
        os.close(fd)
    except OSError as err:
        raise write_error(err, path) from err
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, WriteError) and str(err.filename or tmp) in (tmp, str(path), str(path.parent)):
            raise write_error(err, path) from err
        raise


# Why a write fails that is the machine's state, not the writer's: full, over quota, read-only, no permission, too big.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG})


class WriteError(OSError):
    """A file could not be written (disk full, read-only, no permission); its message names the file, without `[Errno N]`."""

    def __str__(self) -> str:
        return self.strerror


def write_error(err: OSError, path) -> OSError:
    """`err` as a `WriteError` saying `cannot write <path>: <reason>`; other errors (a bug, a missing input) unchanged."""
    if isinstance(err, WriteError) or err.errno not in WRITE_ERRNOS:
        return err
    reason = err.strerror or " ".join(str(err).split()) or type(err).__name__
    return WriteError(err.errno, f"cannot write {path}: {reason}")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (`atomic_path`), with the usual file mode."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data, *, indent: int = 2) -> Path:
    """`data` as sorted, strict JSON (non-finite numbers as strings), written atomically."""
    return atomic_write_text(path, json.dumps(json_safe(data), indent=indent, sort_keys=True, allow_nan=False) + "\n")


def kind_of(value) -> str:
    """What a parsed YAML/JSON value is, in words: `"a string"`, `"a list"`, `"a mapping"`, `"nothing (an empty file)"`."""
    if value is None:
        return "nothing (an empty file)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def is_int(value, *, numpy: bool = False) -> bool:
    """Whether `value` is an int; a bool is not, though Python counts it as one. With `numpy`, a numpy integer is too."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral if numpy else int)


def check_int(name: str, value, low: int, *, allow_none: bool = False, numpy: bool = False, what: str = "") -> None:
    """Refuse `value` with a `ValueError` unless it is an int >= `low` (`is_int`), or `None` where `allow_none`.

    The message reads `"{name} must be an int >= {low}{what}, got {value!r}"`, with `" or None"` before the comma
    where `None` is allowed.

    Args:
        what: Words after the bound saying what is counted (`" (replicates)"`).
        numpy: Take a numpy integer as well (`is_int`).

    Example:
        ```python
        >>> check_int("stop_patience", None, 1, allow_none=True)
        >>> check_int("batch_size", True, 1)
        Traceback (most recent call last):
        ValueError: batch_size must be an int >= 1, got True
        ```
    """
    if value is None and allow_none:
        return
    if not is_int(value, numpy=numpy) or value < low:
        either = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {low}{what}{either}, got {value!r}")


def read_structured(path: str | os.PathLike, *, expected: str, label: str | None = None):
    """The YAML (or, for `.json`, JSON) data in `path`, parsed with `yaml.safe_load` / `json.loads`; not shape-checked.

    Every problem is one `ValueError` naming the file and what was `expected` (`"a mapping of option names to
    values"`): no such file, not UTF-8 text, not valid YAML or JSON. The caller checks the shape and says what it
    got with `kind_of`. `label` goes before the path (`"plan file"`, `"--routes"`).

    Example:
        ```python
        >>> data = read_structured("plan.yaml", expected="a list of objects", label="plan file")
        >>> if not isinstance(data, list):
        ...     raise ValueError(f"plan file plan.yaml: expected a list of objects, got {kind_of(data)}")
        ```
    """
    name = f"{label} {path}" if label else str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{name}: no such file")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); expected {expected}") from None
    if str(path).lower().endswith(".json"):
        try:
            return json.loads(text) if text.strip() else None
        except ValueError as err:
            raise ValueError(f"{name}: not valid JSON ({err}); expected {expected}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        words = ": ".join(w for w in (getattr(err, "context", None), getattr(err, "problem", None)) if w) or str(err).splitlines()[0]
        at = f", line {where.line + 1}" if where is not None else ""
        raise ValueError(f"{name}: not valid YAML ({words}{at}); expected {expected}") from None


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


# ------------------------------------------------------------------ Ctrl-C and SIGTERM in a command

# What the running command is doing and how to continue it; set by the command as it learns its arguments.
_INTERRUPT = {"stage": None, "hint": None}
_DEFAULT_HINT = "nothing it writes was left half-done; the same command starts it again"


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where the main thread was (as Python raises `KeyboardInterrupt` for a SIGINT).

    A `KeyboardInterrupt`, so that whatever a Ctrl-C cleans up on its way out (a staged output folder, a lock, a
    temp file) a SIGTERM cleans up too.
    """

    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


@contextmanager
def signals_raised():
    """Within the block a SIGTERM raises `Terminated`; `interrupt_stage` / `interrupt_hint` start afresh.

    The old handler is put back after. Only the main thread may set one: elsewhere SIGTERM keeps its handler.

    Example:
        ```python
        >>> with signals_raised():
        ...     try:
        ...         interrupt_hint("the same command with --resume continues it")
        ...         work()
        ...     except KeyboardInterrupt as err:
        ...         code = report_interrupt("hf-depthgrow compare", err)  # one line on stderr; 130 or 143
        ```
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    saved = dict(_INTERRUPT)
    _INTERRUPT.update(stage=None, hint=None)
    try:
        yield
    finally:
        _INTERRUPT.update(saved)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def interrupt_stage(text: str | None) -> None:
    """Name what the command is doing now (`"the oracle sweep"`), for the line an interrupt prints."""
    _INTERRUPT["stage"] = text


def interrupt_hint(text) -> None:
    """How the user goes on after an interrupt (`"the same command with --resume continues it"`); a callable is
    asked at the interrupt, for a hint that depends on what the run has written by then."""
    _INTERRUPT["hint"] = text


def report_interrupt(prog: str, err: KeyboardInterrupt) -> int:
    """Print the one line for an interrupted `prog` on stderr; return 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    import sys

    name = "SIGTERM" if isinstance(err, Terminated) else "SIGINT (Ctrl-C)"
    where = f" during {_INTERRUPT['stage']}" if _INTERRUPT["stage"] else ""
    hint = _INTERRUPT["hint"]
    hint = hint() if callable(hint) else hint
    print(f"{prog}: interrupted by {name}{where}; {hint or _DEFAULT_HINT}", file=sys.stderr, flush=True)
    return 128 + int(getattr(err, "signum", signal.SIGINT))


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
