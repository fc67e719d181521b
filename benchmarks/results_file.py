"""One shared way for the benchmarks to write their section of RESULTS.md (atomically, others left alone)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace the section `heading` (from that line to the next '## ') with `text`, or append it; other sections stay.

    The file is replaced atomically (a temporary file, then `os.replace`), so an interrupted run never
    leaves RESULTS.md half written.
    """
    path = Path(path)
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == heading), None)
    body = text if text.endswith("\n") else text + "\n"
    if start is None:
        new = old.rstrip("\n") + "\n\n" + body
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + body + ("\n" + rest if rest else "")
    write_atomic(path, new)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` through a temporary file and `os.replace`: never half written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rerun_command(script: str, argv: list[str]) -> str:
    """The command line to record, as a reader would rerun it: `python benchmarks/<script> ...` without
    `--results PATH` (a local path; the default file is the repository's RESULTS.md)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results":
            skip = True
        elif not arg.startswith("--results="):
            out.append(arg)
    return " ".join([f"python benchmarks/{script}", *(shlex.quote(a) for a in out)])


def command_line(script: str, argv: list[str] | None) -> str:
    """`rerun_command` of `argv`, or of `sys.argv[1:]` when a benchmark runs as a script (`main()` without arguments)."""
    return rerun_command(script, sys.argv[1:] if argv is None else argv)


def machine() -> str:
    """The CPU's model name and core count (machines of one kind differ by day; their figures are not comparable)."""
    import platform

    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]}, {len(names)} cores" if names else platform.machine()


def publish(args, heading: str, text: str) -> None:
    """Print a benchmark's section; with `--write-results`, also write it into `args.results` (RESULTS.md)."""
    print(text)
    if args.write_results:
        write_section(args.results, heading, text)
        print(f"wrote the '{heading[3:]}' section of {args.results}", file=sys.stderr)
