"""What every command shares: parsing into settings dataclasses, and input errors as one line with exit code 2."""

from __future__ import annotations

import os
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
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(body(argv) or 0)
    except INPUT_ERRORS as err:
        if os.environ.get("HF_DEPTHGROW_TRACEBACK", "").lower() in ("1", "true", "yes"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"hf-depthgrow {name}: {message}", file=sys.stderr)
        return 2


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
