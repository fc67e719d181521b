"""The stepping stones' line search over the step size `eta`: geometric bracketing, then parabolic refinement.

Each evaluation of `loss_at(eta)` is a forward pass over the line search's training batches, so the
search is built to need few: see `line_search`.
"""

from __future__ import annotations

import math
from typing import Callable

_GOLDEN_STEP = (3 - math.sqrt(5)) / 2  # the golden-section fraction of an interval


def line_search(loss_at: Callable[[float], float], *, eta0: float, expand: float, max_expand: int, refine_steps: int) -> None:
    """Bracket the best step geometrically, then `refine_steps` parabolic-interpolation steps inside the bracket.

    A bracket is three evaluated steps `a < b < c` with the lowest loss at `b` (`a` may be 0, the original).
    Each refinement evaluates the vertex of the parabola through them (in `log eta`, or in `eta` while
    `a = 0`), kept strictly inside `(a, c)`, and keeps the three points around the new best: one forward
    pass per step where a golden-section step needs about 1.5 for the same shrinkage, and fewer still on a
    smooth loss (one step lands near the minimum of a locally quadratic curve).
    """
    base = loss_at(0.0)
    eta = eta0
    if loss_at(eta) >= base:
        # Too far already (strong curvature): shrink until a step helps.
        for _ in range(max_expand):
            eta /= expand
            if loss_at(eta) < base:
                break
        else:
            return
        bracket = [0.0, eta, eta * expand]
    else:
        lower = 0.0
        for _ in range(max_expand):
            if loss_at(eta * expand) >= loss_at(eta):
                break
            lower, eta = eta, eta * expand
        bracket = [lower, eta, eta * expand]
    for _ in range(refine_steps):
        x = _vertex(bracket, [loss_at(e) for e in bracket])
        if x is None:
            return
        loss_at(x)
        points = sorted({*bracket, x})
        i = min(range(len(points)), key=lambda j: (loss_at(points[j]), points[j]))
        if i == 0 or i == len(points) - 1:  # pragma: no cover - the vertex stays inside (a, c), where b is lowest
            return
        bracket = points[i - 1 : i + 2]


def _vertex(bracket: list[float], losses: list[float]) -> float | None:
    """The parabola's vertex through `(a, b, c)` (in log space unless `a = 0`), kept 10% of a gap inside `(a, c)` and away from `b`."""
    a, b, c = bracket
    fa, fb, fc = losses
    if not all(math.isfinite(f) for f in losses):  # an overflowing end: golden-section point on the wider side
        return None if not math.isfinite(fb) else _golden_point(a, b, c)
    log = a > 0
    xa, xb, xc = (math.log(v) for v in bracket) if log else bracket
    num = (xb - xa) ** 2 * (fb - fc) - (xb - xc) ** 2 * (fb - fa)
    den = (xb - xa) * (fb - fc) - (xb - xc) * (fb - fa)
    x = xb - 0.5 * num / den if den != 0 else None
    margin = 0.1 * min(xb - xa, xc - xb)
    if x is None or not math.isfinite(x) or abs(x - xb) < margin:  # flat or degenerate: golden-section point instead
        return _golden_point(a, b, c)
    x = min(max(x, xa + margin), xc - margin)
    return math.exp(x) if log else x


def _golden_point(a: float, b: float, c: float) -> float:
    """A golden-section trial point in the wider of `(a, b)` and `(b, c)` (log space where `a > 0`)."""
    if a > 0:
        la, lb, lc = math.log(a), math.log(b), math.log(c)
        x = lb + _GOLDEN_STEP * (lc - lb) if lc - lb >= lb - la else lb - _GOLDEN_STEP * (lb - la)
        return math.exp(x)
    return b + _GOLDEN_STEP * (c - b) if c - b >= b - a else b - _GOLDEN_STEP * (b - a)
