"""Route A and Route B (docs/theory.md §7): their inputs, the eps terms, and each route's bound and verdict.

Plain arithmetic on numbers. The inputs measured on models and data (`Delta_R`, `rho`, `B_W`,
`B_a`, ...) are gathered by `hf_depthgrow.evaluation.route_terms.route_inputs`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .bounds import check_bound
from .formatting import format_value




def eps_k(bound: float, m: int, delta: float) -> float:
    """Test-side concentration term `B sqrt(ln(2/delta) / (2m))` (Hoeffding for a mean of `m` losses in `[0, B]`)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    return check_bound(bound) * math.sqrt(math.log(2.0 / delta) / (2.0 * m))


def eps_m(*, rho: float, b_w: float, b_a: float, n: int, delta: float, bound: float) -> float:
    """Generalisation cost of the block class: `2 rho B_W B_a / sqrt(n) + B sqrt(ln(2/delta) / (2n))`.

    Example:
        ```python
        >>> round(eps_m(rho=1.0, b_w=1.0, b_a=1.0, n=100, delta=0.05, bound=1.0), 4)
        0.3358
        ```
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for name, value in (("rho", rho), ("b_w", b_w), ("b_a", b_a)):
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return 2.0 * rho * b_w * b_a / math.sqrt(n) + check_bound(bound) * math.sqrt(math.log(2.0 / delta) / (2.0 * n))


@dataclass
class RouteInputs:
    """The inputs of Route A and Route B that come from outside the test set, with where each came from.

    Every field may be `None`; a route whose inputs are missing is reported as incomplete, never
    filled in with a guess.

    Args:
        n_train: `n`, the number of training examples the block was fitted on.
        delta_erm: `Delta_ERM = L_S(f~_S) - L_S(f_new) >= 0`, from the trainer (`TrainResult.delta_erm`).
        delta_r: `Delta_R = L_D(f_old) - L_D(f~_pop)`, the population stepping stone's margin on the
            held-out split.
        delta_r_test: `Delta^R_test = L_T(f_old) - L_T(f~)`, the stepping stone's margin on the test set.
        rho: Lipschitz constant of `loss o f_top` at the block's output (an estimate).
        b_w: `B_W = ||W||_F` of the trained block's output weights.
        b_a: `B_a = max ||a(z)||` of the block's pre-projection activation over the data.
        sources: How each value was obtained, by field name (shown in the report).
    """

    n_train: int | None = None
    delta_erm: float | None = None
    delta_r: float | None = None
    delta_r_test: float | None = None
    rho: float | None = None
    b_w: float | None = None
    b_a: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def route_bounds(inputs: RouteInputs, *, loss_old: float, bound: float, m: int, delta: float) -> dict:
    """Route A and Route B: every term, the bound on `L_test(f_new)`, and a plain verdict.

    - `eps_M = 2 rho B_W B_a / sqrt(n) + B sqrt(ln(2/delta) / (2n))`
    - `eps_K = B sqrt(ln(2/delta) / (2m))` (the test-side term)
    - Route A: `L_test(f_new) <= L_test(f_old) - Delta_R / 2 - Delta_ERM + 2 eps_M`
    - Route B: `L_test(f_new) <= L_test(f_old) - Delta^R_test - Delta_ERM + 2 (eps_M + eps_K)`

    A route's *guaranteed improvement* is `L_test(f_old)` minus its bound. The route is vacuous
    when that is <= 0 (it certifies no improvement); it says nothing at all when the bound is
    at or above `B`, the largest loss. Each concentration term holds with probability 1 - delta;
    a union bound over the terms a route uses lowers its joint confidence accordingly.
    `loss_old` is the test loss of the original model measured on T (the example-mean loss).
    """
    terms = {
        "loss_old_test": loss_old,
        "B": bound,
        "m": m,
        "delta": delta,
        **{k: v for k, v in inputs.to_dict().items() if k != "sources"},
        "sources": dict(inputs.sources),
    }
    terms["eps_K"] = eps_k(bound, m, delta)
    terms["eps_K_definition"] = "B sqrt(ln(2/delta) / (2m)): Hoeffding for the mean of m test losses in [0, B]"
    missing_m = [k for k in ("rho", "b_w", "b_a", "n_train") if getattr(inputs, k) is None]
    terms["eps_M"] = None
    if not missing_m:
        terms["eps_M"] = eps_m(rho=inputs.rho, b_w=inputs.b_w, b_a=inputs.b_a, n=inputs.n_train, delta=delta, bound=bound)
        terms["eps_M_complexity"] = 2.0 * inputs.rho * inputs.b_w * inputs.b_a / math.sqrt(inputs.n_train)
        terms["eps_M_concentration"] = bound * math.sqrt(math.log(2.0 / delta) / (2.0 * inputs.n_train))

    common = dict(loss_old=loss_old, bound=bound)
    route_a = _route("A", inputs, terms, missing_m, margin_key="delta_r", margin_factor=0.5, extra=0.0, **common)
    route_a["formula"] = "L_test(f_new) <= L_test(f_old) - Delta_R/2 - Delta_ERM + 2 eps_M"
    route_b = _route("B", inputs, terms, missing_m, margin_key="delta_r_test", margin_factor=1.0, extra=terms["eps_K"], **common)
    route_b["formula"] = "L_test(f_new) <= L_test(f_old) - Delta^R_test - Delta_ERM + 2 (eps_M + eps_K)"
    return {"terms": terms, "route_a": route_a, "route_b": route_b}


def _route(name: str, inputs: RouteInputs, terms: dict, missing_m: list[str], *, loss_old: float, bound: float,
           margin_key: str, margin_factor: float, extra: float) -> dict:
    """One route: its margin, cost, guaranteed improvement and bound, or what it is missing."""
    needed = [margin_key, "delta_erm"] + (["eps_M"] if terms["eps_M"] is None else [])
    missing = [k for k in (margin_key, "delta_erm") if getattr(inputs, k) is None] + (missing_m if terms["eps_M"] is None else [])
    if missing:
        # A term that was looked for but could not be measured (B_a of per-expert projections) says why.
        why = "; ".join(f"{k}: {inputs.sources[k]}" for k in missing if inputs.sources.get(k))
        return {
            "complete": False,
            "missing": missing,
            "sentence": f"Route {name} is not computed: missing {', '.join(missing)}" + (f" ({why})." if why else "."),
            "needed": needed,
        }
    margin = margin_factor * getattr(inputs, margin_key)
    cost = 2.0 * (terms["eps_M"] + extra)
    improvement = margin + inputs.delta_erm - cost
    upper = loss_old - improvement
    if upper >= bound:
        sentence = (
            f"Route {name} is vacuous: its bound on L_test(f_new) ({format_value(upper)}) is at or above the largest "
            f"loss B = {format_value(bound)}, so it says nothing."
        )
    elif improvement <= 0:
        sentence = (
            f"Route {name} is vacuous: the statistical cost {format_value(cost)} exceeds the margins "
            f"{format_value(margin + inputs.delta_erm)}, so it certifies no improvement (it only says "
            f"L_test(f_new) <= L_test(f_old) + {format_value(-improvement)})."
        )
    else:
        sentence = f"Route {name} certifies an improvement of at least {format_value(improvement)} (bound {format_value(upper)})."
    return {
        "complete": True,
        "margin": margin,
        "cost": cost,
        "guaranteed_improvement": improvement,
        "upper_bound_loss_new": upper,
        "vacuous": bool(improvement <= 0 or upper >= bound),
        "sentence": sentence,
    }
