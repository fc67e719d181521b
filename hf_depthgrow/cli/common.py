"""What every command shares: input errors as one line with exit code 2, old flags' warnings as one line."""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import sys
import warnings

# Problems with what the user typed or pointed at: one line, no traceback (HF_DEPTHGROW_TRACEBACK=1 shows it).
INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)
# Torch's words for a device string it cannot parse or a device this machine does not have.
_DEVICE_ERRORS = ("device string", "Torch not compiled with CUDA", "invalid device ordinal", "no NVIDIA driver")


def _input_error_message(err: BaseException) -> str | None:
    """The one-line message for an input error, or `None` for anything else (a bug: it keeps its traceback).

    Besides `INPUT_ERRORS`: a `MemoryError` that says what ran out (a Ray trial killed for memory), a pickle that
    `torch.load(weights_only=True)` refused (a hand-made or malicious checkpoint file; it was never run) and a device
    this machine cannot use (`--device tpu:7`), which torch raises as `UnpicklingError` and `RuntimeError`/`AssertionError`.
    """
    text = " ".join(str(err).split())
    if isinstance(err, MemoryError):  # the machine's state, like a full disk; a bare one (the allocator's) keeps its traceback
        return text or None
    if isinstance(err, INPUT_ERRORS):
        return text or type(err).__name__
    if isinstance(err, pickle.UnpicklingError):
        return (
            "refused to load a pickle file that holds more than tensors (loading it could run code; it was not run): "
            "only files this tool wrote, or safetensors, are loaded"
        )
    if isinstance(err, (RuntimeError, AssertionError)) and any(words in text for words in _DEVICE_ERRORS):
        return f"unusable device: {text}"
    return None


def _traceback_wanted() -> bool:
    return os.environ.get("HF_DEPTHGROW_TRACEBACK", "").lower() in ("1", "true", "yes")


@contextlib.contextmanager
def deprecations_on_one_line(prefix: str):
    """Inside the block, an old flag's warning (`FlagDeprecation`) reads as one line: `<prefix>: --out is deprecated, use --output-dir`.

    Only the format changes: warning filters (`-W error`) and recorders (`pytest.warns`) still see every warning.
    """
    from ..config import FlagDeprecation

    formatted = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):
        if issubclass(category, FlagDeprecation):
            return f"{prefix}: {message}\n"
        return formatted(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = formatted


def run_command(name: str, body, argv: list[str] | None) -> int:
    """Call `body(argv)` and turn an input error into `hf-depthgrow <name>: <message>` on stderr, exit code 2.

    Ctrl-C and SIGTERM are one line too, saying what stopped and how to go on (`utils.report_interrupt`), exit code 130 / 143.

    Example:
        ```python
        >>> def main(argv=None):
        ...     return run_command("grow", _grow, argv)
        ```
    """
    from ..utils import command_scope, report_interrupt, signals_raised

    argv = list(sys.argv[1:] if argv is None else argv)
    with signals_raised(), deprecations_on_one_line(f"hf-depthgrow {name}"):  # a SIGTERM raises, as Ctrl-C does, until the command has ended
        try:
            # Output folders locked during the command stay locked until it ends (the holder record names it).
            with command_scope(f"hf-depthgrow {name} " + shlex.join(argv)):
                return int(body(argv) or 0)
        except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: one line saying how to go on, exit 130 / 143
            if _traceback_wanted():
                raise
            return report_interrupt(f"hf-depthgrow {name}", err)
        except Exception as err:
            message = _input_error_message(err)
            if message is None or _traceback_wanted():
                raise
            print(f"hf-depthgrow {name}: {message}", file=sys.stderr)
            # A full disk or memory is the machine's state, not bad input: exit code 1, so that scripts can tell them apart.
            return 1 if isinstance(err, MemoryError) or (isinstance(err, OSError) and err.errno in (28, 122)) else 2  # ENOSPC, EDQUOT


def dtype_of(name: str):
    """`"bfloat16"` -> `torch.bfloat16`."""
    import torch

    return getattr(torch, name)


def record_dict(model) -> dict | None:
    """The model's growth record as plain JSON data (`None` for an ungrown model)."""
    from ..growth.record import growth_record

    record = growth_record(model)
    return record.to_dict() if hasattr(record, "to_dict") else record
