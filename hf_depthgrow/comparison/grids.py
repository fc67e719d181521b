"""Learning-rate grids per arm kind, the rule that extends a grid whose choice sits at its edge, and halving replayed.

One grid shared by every arm is not an equal budget: it favours whichever arm it happens to suit. In the
committed SmolLM2 comparison (docs/decisions.md) every arm but one chose 1e-3, the top edge of the shared
grid {3e-4, 1e-3}. LoRA's best rate is typically about 10x that of full fine-tuning (more for short runs;
arXiv:2405.09673), and a zero-initialised block, like LoRA's zero-initialised B, starts from a zero output
and needs a LoRA-like rate to move in a few steps. So each kind gets its own three-point grid (x3 apart),
the rate is chosen on held-out data per arm and per budget, and a choice at an edge of the rates tried
extends that arm's grid by one x3 step beyond it, until the choice is interior, `lr_extensions` steps
were added, or the next rate would pass `max_learning_rate`; the table says which. Where forgetting is
measured every grid also reaches below its lowest rate (`rates_below`): the lower rates trace each kind's
learning-vs-forgetting curve, which the gain x forgetting comparison ranges over.
"""

from __future__ import annotations

import math
from typing import Iterable

from .arms import ARM_KINDS

DEFAULT_GRIDS = {name: kind.grid for name, kind in ARM_KINDS.items() if kind.trainable is not None}  # per kind that trains
EXTENSION_FACTOR = 3.0


def _finite(x) -> float:
    return x if x is not None and math.isfinite(x) else math.inf


def best_rate(heldout: dict[float, float]) -> float | None:
    """The rate with the lowest finite held-out loss (ties: the smaller rate); `None` if every run diverged."""
    finite = {lr: loss for lr, loss in heldout.items() if math.isfinite(_finite(loss))}
    return min(finite, key=lambda lr: (finite[lr], lr)) if finite else None


def edge(rates: Iterable[float], chosen: float | None) -> str | None:
    """`"low"` / `"high"` when `chosen` is the smallest / largest of two or more rates tried, else `None`.

    A single rate is the user's choice, not a grid: it has no edge to extend.
    """
    rates = sorted(rates)
    if chosen is None or len(rates) < 2:
        return None
    if chosen == rates[-1]:
        return "high"
    if chosen == rates[0]:
        return "low"
    return None


def extension(rates: Iterable[float], edges: Iterable[str | None], *, added: int, limit: int, cap: float) -> tuple[float | None, str]:
    """The next rate to try for an arm whose choices (one per budget) sit at `edges`, and why (or why not).

    Returns `(rate, "")` to train, or `(None, reason)`: `"interior"`, `"limit"` (`limit` rates added already)
    or `"cap"` (the next rate up would pass `cap`). A choice at the top edge is extended first: growth and
    LoRA arms that want a larger rate are what a shared grid gets wrong.

    Example:
        ```python
        >>> extension([1e-3, 3e-3, 1e-2], ["high"], added=0, limit=2, cap=0.1)
        (0.03, '')
        >>> extension([1e-3, 3e-3, 1e-2], [None, None], added=0, limit=2, cap=0.1)
        (None, 'interior')
        ```
    """
    rates, wanted = sorted(rates), set(edges) - {None}
    if not wanted:
        return None, "interior"
    if added >= limit:
        return None, "limit"
    if "high" in wanted:
        up = rates[-1] * EXTENSION_FACTOR
        if up <= cap * (1 + 1e-9):
            return _tidy(up), ""
        if "low" not in wanted:
            return None, "cap"
    return _tidy(rates[0] / EXTENSION_FACTOR), ""


def rates_below(rates: Iterable[float], n: int) -> list[float]:
    """`n` rates below the lowest of `rates`, x3 apart (increasing): where a forgetting curve is traced.

    The gain-optimal rate forgets the most that gain buys; lower rates gain less and forget less, and a
    control's lower rates may dominate a growth arm on both axes (`CompareConfig.forgetting_rates`, default 2).

    Example:
        ```python
        >>> rates_below([3e-5, 1e-4, 3e-4], 2)
        [3.33333e-06, 1e-05]
        ```
    """
    low = min(rates)
    return [_tidy(low / EXTENSION_FACTOR**k) for k in range(n, 0, -1)]


def _tidy(rate: float) -> float:
    """x3 steps of 1e-3 give 3e-3, 9e-3...; rounded to 6 significant digits so labels and keys stay clean."""
    return float(f"{rate:.6g}")


def halving_survivor(rungs: list[dict[float, float]], final: dict[float, float]) -> float | None:
    """The rate successive halving keeps: at each rung the better half (on held-out) of the rates still running goes on.

    `rungs[i][lr]` is the held-out loss of `lr` at the i-th rung; `final[lr]` at the end. Replays, from a
    full grid's held-out curves, the choice halving would have made without training the whole grid.

    Example:
        ```python
        >>> halving_survivor([{1e-3: 3.0, 1e-2: 2.9}], {1e-3: 2.5, 1e-2: 2.7})  # 1e-2 leads early, 1e-3 wins
        0.01
        ```
    """
    alive = sorted(final)
    for values in rungs:
        if len(alive) < 2:
            break
        alive = sorted(alive, key=lambda lr: (_finite(values.get(lr)), lr))[: math.ceil(len(alive) / 2)]
    return best_rate({lr: final[lr] for lr in alive})
