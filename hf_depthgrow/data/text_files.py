"""Local data files: what may be read, and text read in bounded pieces so that a read stops once enough is made.

A data path must be a regular file or a folder. A named pipe (FIFO) blocks its reader until
someone writes to it, and a character device such as `/dev/zero` never ends, so both are refused
with one line before anything is opened. Inside a folder only regular files are read.

Text files are read lazily, `PIECE_CHARS` characters at a time, and cut at a line end or word; the
causal-LM blocks stop asking for more text once they have `max_examples` blocks, so a 10 GB
file costs what the blocks need. Bytes that are not UTF-8 become U+FFFD (as before), and a
warning says how many and in which file, once per file.

Example:
    ```python
    >>> check_data_path(Path("/dev/zero"))
    Traceback (most recent call last):
    ValueError: data path /dev/zero is a character device, not a regular file or folder
    >>> blocks = causal_lm_blocks(tokenizer, [TextFile(Path("big.txt"))], 128, max_blocks=64)  # reads ~100 kB
    ```
"""

from __future__ import annotations

import codecs
import re
import stat
import threading
import warnings
from pathlib import Path

__all__ = ["PIECE_CHARS", "TextFile", "check_data_path", "data_files"]

#: Characters read (and tokenized) at a time from a text file; a file this size or smaller is one piece.
PIECE_CHARS = 1 << 18

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# Cuts that byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2) also split at, so the pieces give the tokens
# of the whole text: a line end between two non-blank characters ("\n" is pre-tokenized on its own there), else
# before a space that follows a non-blank character and precedes a letter (" word" is one pre-token).
_CLEAN_CUTS = (re.compile(r"(?<=\S)\n(?=\S)"), re.compile(r"(?<=\S)(?= [^\W\d_])"))

_COUNT = threading.local()


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    # What errors="replace" does (one U+FFFD per invalid sequence), counting the bytes it replaces.
    _COUNT.bytes = getattr(_COUNT, "bytes", 0) + (err.end - err.start)
    return "\ufffd", err.end


_HANDLER = "hf_depthgrow.count_replace"
codecs.register_error(_HANDLER, _count_and_replace)


def check_data_path(path: Path, what: str = "data") -> None:
    """Raise `ValueError` unless `path` (symlinks followed) is a regular file or a folder.

    Only `stat` is called: a FIFO is refused without being opened (opening one blocks).
    """
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    raise ValueError(f"{what} path {path} is {kind}, not a regular file or folder")


def data_files(path: Path) -> list[Path]:
    """`[path]` for a file; the regular files under a folder (sorted; pipes, devices and sockets skipped)."""
    check_data_path(path)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file())  # is_file() is False for special files
    if not files:
        raise ValueError(f"no files under {path}")
    return files


class TextFile:
    """One UTF-8 text document, read lazily in pieces of about `PIECE_CHARS` characters.

    Iterating opens the file and yields its text in order, each piece but the last ending where a
    byte-level BPE tokenizer splits anyway (see `_cut`); the pieces join to what
    `Path.read_text(errors="replace")` gives.
    Each iteration reads the file afresh. Non-UTF-8 bytes are replaced by U+FFFD and counted; the
    count is warned once per file, also when the reader stops early (what it read so far).
    """

    def __init__(self, path: Path, piece_chars: int | None = None):
        self.path = Path(path)
        self.piece_chars = piece_chars
        self._warned = False

    def __repr__(self) -> str:
        return f"TextFile({str(self.path)!r})"

    def _read(self, f, size: int) -> tuple[str, int]:
        # The handler counts into a thread-local; save and restore it so that readers interleaved on one thread
        # each get their own count.
        saved, _COUNT.bytes = getattr(_COUNT, "bytes", 0), 0
        try:
            text = f.read(size)
            return text, _COUNT.bytes
        finally:
            _COUNT.bytes = saved

    def __iter__(self):
        size = self.piece_chars or PIECE_CHARS
        replaced, pending = 0, ""
        try:
            # newline=None: "\r\n" and "\r" become "\n", as read_text does.
            with open(self.path, encoding="utf-8", errors=_HANDLER, newline=None) as f:
                while True:
                    text, bad = self._read(f, size)
                    replaced += bad
                    if not text:
                        break
                    pending += text
                    while len(pending) > size:  # more than one piece: hand them on, keep the tail (<= 2 pieces held)
                        cut = _cut(pending, size)
                        yield pending[:cut]
                        pending = pending[cut:]
            yield pending
        finally:
            if replaced and not self._warned:
                self._warned = True
                warnings.warn(
                    f"{self.path}: {replaced} byte(s) that are not UTF-8 were replaced by U+FFFD", UnicodeWarning, stacklevel=2
                )


def _cut(text: str, size: int) -> int:
    """Where to end the next piece, within its first `size` characters: the last clean cut (see `_CLEAN_CUTS`),
    else the last line end, else `size` (a text with neither)."""
    head = text[:size]
    for pattern in _CLEAN_CUTS:
        found = None
        for found in pattern.finditer(head):
            pass
        if found is not None and found.end() > 0:
            return found.end()
    return head.rfind("\n") + 1 or size
