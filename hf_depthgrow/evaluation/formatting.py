"""The one number formatter of reports, route sentences and model cards.

It lives here, not in `hf_depthgrow.utils`, only because this subpackage owns its callers; it has
no dependency and can move to `utils` unchanged.
"""

from __future__ import annotations

import math
import numbers
import re
from pathlib import PurePosixPath

MISSING = "–"  # what a table shows for a value that was not measured

# An absolute local path (`/a/b...` or `~/a...`) inside text; not a URL's path (after `:`, `/` or a word).
ABS_PATH = re.compile(r"(?<![\w.:/~\\-])~?/[^\s/'\"`<>|(),;\[\]]+(?:/[^\s/'\"`<>|(),;\[\]]*)+")
# The Hub cache stores a repository as `.../models--owner--name/snapshots/<rev>`: that is its Hub id.
_CACHE_REPO = re.compile(r"(?:models|datasets|spaces)--([\w.-]+?)--([\w.-]+)")


def public_name(path: str) -> str:
    """How a report or card names a local path: the Hub id of a Hub-cache folder, else the folder name.

    Absolute paths say where files sat on one machine (a home or temp folder), nothing about the model.

    Example:
        ```python
        >>> public_name("/home/me/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/abc")
        'HuggingFaceTB/SmolLM2-135M'
        >>> public_name("/tmp/run3/model"), public_name("runs/x/model")
        ('model', 'runs/x/model')
        ```
    """
    if not isinstance(path, str) or not path.startswith(("/", "~/")):
        return path
    cached = _CACHE_REPO.search(path)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    return PurePosixPath(path.rstrip("/")).name or path


def scrub_paths(value):
    """`value` (text, or dicts/lists of it) with every absolute local path replaced by `public_name`."""
    if isinstance(value, str):
        def name(m):
            text, dot = (m.group(0)[:-1], ".") if m.group(0).endswith(".") else (m.group(0), "")
            return public_name(text) + dot

        return ABS_PATH.sub(name, value)
    if isinstance(value, dict):
        return {k: scrub_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub_paths(v) for v in value)
    return value


def format_value(x, digits: int = 4) -> str:
    """A value as a short string for a Markdown table or a sentence.

    `None` is "–", booleans "yes"/"no", integers exact, other real numbers to `digits` significant
    digits (non-finite as "∞", "-∞", "nan"), lists and tuples joined with ", ", strings unchanged.

    Example:
        ```python
        >>> format_value(0.0123456), format_value(float("inf")), format_value(None), format_value([1, 2.5])
        ('0.01235', '∞', '–', '1, 2.5')
        ```
    """
    if x is None:
        return MISSING
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (list, tuple)):
        return ", ".join(format_value(v, digits) for v in x)
    if isinstance(x, numbers.Integral):
        return str(int(x))
    if isinstance(x, numbers.Real):
        x = float(x)
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else ("∞" if x > 0 else "-∞")
        return f"{x:.{digits}g}"
    return str(x)


def table_cell(x) -> str:
    """`format_value(x)` as one Markdown table cell: on one line, with `|` escaped (a bare `|` ends the cell).

    Example:
        ```python
        >>> table_cell("a | b")
        'a \\\\| b'
        ```
    """
    return format_value(x).replace("\n", " ").replace("|", "\\|")


_PART_NAMES = {"train": "train", "heldout": "held-out", "held_out": "held-out", "test": "test", "retention": "retention",
               "retention_selection": "retention selection", "retention_test": "retention test"}


# Below this many documents a cluster bootstrap has too few distinct resamples to stand for the domain.
FEW_DOCUMENTS = 10


def _few_documents(parts: dict) -> str:
    few = [f"{_PART_NAMES.get(n, n)} ({p['documents']})" for n, p in parts.items()
           if p.get("resampled") == "documents" and p.get("documents") is not None and p["documents"] < FEW_DOCUMENTS]
    if not few:
        return ""
    return (f" Too few documents for a document-level interval to stand for the domain on {', '.join(few)}: there it is the "
            "spread between those documents (sample blocks across more documents and split the parts by document).")


def data_parts_text(parts: dict, cluster_key: str | None = "auto") -> str:
    """One sentence: blocks and documents per part, and whether the intervals resampled documents.

    Example:
        ```python
        >>> data_parts_text({"test": {"blocks": 80, "documents": 40, "resampled": "documents"}})
        'Data: test 80 blocks of 40 documents. Intervals resample documents (cluster bootstrap) on test.'
        ```
    """
    def one(name, part):
        docs = part.get("documents")
        of = f" of {docs} document{'s' if docs != 1 else ''}" if docs is not None else " (documents not named)"
        return f"{_PART_NAMES.get(name, name)} {part['blocks']} blocks{of}"

    text = "Data: " + "; ".join(one(n, p) for n, p in parts.items()) + "."
    by_documents = [_PART_NAMES.get(n, n) for n, p in parts.items() if p.get("resampled") == "documents"]
    by_blocks = [_PART_NAMES.get(n, n) for n, p in parts.items() if p.get("resampled") == "blocks"]
    if by_documents:
        text += f" Intervals resample documents (cluster bootstrap) on {', '.join(by_documents)}"
        text += f"; blocks on {', '.join(by_blocks)}." if by_blocks else "."
        return text + _few_documents(parts)
    if by_blocks:
        why = " (cluster_key none)" if cluster_key is None else ""
        return text + f" Intervals resample blocks{why}: blocks of one document are treated as independent."
    return text
