"""The one number formatter of reports, route sentences and model cards.

It lives here, not in `hf_depthgrow.utils`, only because this subpackage owns its callers; it has
no dependency and can move to `utils` unchanged.
"""

from __future__ import annotations

import math
import numbers

MISSING = "–"  # what a table shows for a value that was not measured


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
