"""What every command shares: parsing into settings dataclasses, and input errors as one line with exit code 2."""

from __future__ import annotations

import os
import shlex
import sys

# Problems with what the user typed or pointed at: one line, no traceback (HF_DEPTHGROW_TRACEBACK=1 shows it).
INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)


def run_command(name: str, body, argv: list[str] | None) -> int:
    """Call `body(argv)` and turn an input error into `hf-depthgrow <name>: <message>` on stderr, exit code 2.

    Example:
        ```python
        >>> def main(argv=None):
        ...     return run_command("grow", _grow, argv)
        ```
    """
    from ..pipeline.output import command_scope

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Output folders locked during the command stay locked until it ends (the holder record names it).
        with command_scope(f"hf-depthgrow {name} " + shlex.join(argv)):
            return int(body(argv) or 0)
    except INPUT_ERRORS as err:
        if os.environ.get("HF_DEPTHGROW_TRACEBACK", "").lower() in ("1", "true", "yes"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"hf-depthgrow {name}: {message}", file=sys.stderr)
        # A full disk is the machine's state, not bad input: exit code 1, so that scripts can tell them apart.
        return 1 if isinstance(err, OSError) and err.errno in (28, 122) else 2  # ENOSPC, EDQUOT


def parse(name: str, argv: list[str], *dataclass_types, description: str | None = None) -> tuple:
    """The command's settings from `argv` and `--config` (see `hf_depthgrow.config`)."""
    from ..config import ConfigParser

    return ConfigParser(dataclass_types, prog=f"hf-depthgrow {name}", description=description).parse(argv)


def dtype_of(name: str):
    """`"bfloat16"` -> `torch.bfloat16`."""
    import torch

    return getattr(torch, name)


def record_dict(model) -> dict | None:
    """The model's growth record as plain JSON data (`None` for an ungrown model)."""
    from ..growth.engine import growth_record

    record = growth_record(model)
    return record.to_dict() if hasattr(record, "to_dict") else record
