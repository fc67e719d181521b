"""Write an evaluation as `report.json` (everything), `report.md` (what a person reads first) and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..utils import json_safe, package_version
from .bounds import INTERVALS, bernstein_half_width, hoeffding_half_width
from .formatting import format_value, scrub_paths, table_cell
from .result import EvalResult

PLOTS = {"differences": "eval_differences.png", "intervals": "eval_intervals.png"}


def _model_label(info: dict, fallback: str, *, describe: bool) -> str:
    """The model's name; with `describe`, also what it is (both sides of a shared-prefix run carry one path)."""
    name = info.get("name_or_path") or fallback
    if not describe:
        return name
    if info.get("note"):
        return f"{name}, {info['note']} ({info.get('num_layers')} layers)"
    growth = info.get("growth")
    if info.get("grown") and growth:
        where = list(growth.get("native_indices") or []) + [a["host"] for a in growth.get("adapters") or []]
        return f"{name}, grown to {info.get('num_layers')} layers (new blocks at stack index {where})"
    return name


def _header_lines(r: EvalResult, title: str | None) -> list[str]:
    lm = r.task == "causal_lm"
    old, new = r.models.get("old", {}), r.models.get("new", {})
    same = old.get("name_or_path") == new.get("name_or_path")
    return [
        f"# {title or 'Paired evaluation: new model vs original'}",
        "",
        f"**Verdict:** {r.verdict}",
        "",
        f"Old = {_model_label(old, 'model A', describe=same)}; new = {_model_label(new, 'the grown model', describe=same)}. "
        f"{r.num_examples} test examples" + (f", {r.num_tokens} supervised tokens" if lm else "") + ". "
        + ("Shared prefix: the layers below stack index "
           f"{r.prefix_index} ran once per batch for both models." if r.mode == "shared_prefix" else "Both models ran fully (no shared prefix)."),
    ]


def _loss_lines(r: EvalResult) -> list[str]:
    lm = r.task == "causal_lm"
    lines = [
        "",
        "## Losses (delta = old - new; positive = new is better)",
        "",
        "| | old | new | delta |",
        "|---|---:|---:|---:|",
        f"| loss ({'token-weighted' if lm else 'mean over examples'}) | {format_value(r.loss_old)} | {format_value(r.loss_new)} | {format_value(r.delta)} |",
    ]
    if lm:
        mean_old = sum(r.per_example_old) / r.num_examples
        mean_new = sum(r.per_example_new) / r.num_examples
        lines.append(f"| mean per-example loss (the intervals' target) | {format_value(mean_old)} | {format_value(mean_new)} | {format_value(r.mean_delta)} |")
    for name in r.metrics.get("old", {}):
        lines.append(
            f"| {name} | {format_value(r.metrics['old'][name])} | {format_value(r.metrics['new'][name])} | {format_value(r.metrics['delta'][name])} |"
        )
    if r.metrics:
        lines += ["", f"Metrics: {r.metrics['source']}. Metric delta: {r.metrics['delta_convention']}."]
    return lines


def _interval_lines(r: EvalResult) -> list[str]:
    lm = r.task == "causal_lm"
    bound_note = "given a priori" if r.loss_bound_source == "given" else "**taken from the data (not a valid a-priori bound)**"
    lines = [
        "",
        f"## Intervals for the mean per-example delta (confidence {r.confidence:.0%}, delta = {r.level:g})",
        "",
        f"Target: {r.interval_target}" + (" (for an LM, each example's loss is the mean over its tokens)." if lm else "."),
        f"Loss bound B = {format_value(r.loss_bound)}, {bound_note}.",
        "",
        "| interval | low | high | half-width | certified improvement (low > 0) |",
        "|---|---:|---:|---:|:---:|",
    ]
    for name in INTERVALS:
        d = r.interval_details[name]
        label = {"hoeffding": "Hoeffding (losses clipped to [0, B])", "bernstein": "empirical Bernstein (Maurer-Pontil)",
                 "bootstrap": f"paired bootstrap, percentile ({r.n_bootstrap}, seed {r.seed}; approximate)"}[name]
        lines.append(f"| {label} | {format_value(d['low'])} | {format_value(d['high'])} | {format_value(d['half_width'])} | {format_value(d['certified'])} |")
    return lines + _bernstein_note(r)


def _range_term(m: int, delta: float, bound: float) -> float:
    """Bernstein's half-width at zero variance: its range term `7 (2B) ln(4/delta) / (3 (m-1))` alone."""
    return bernstein_half_width(np.zeros(m), delta, bound)


def bernstein_crossover(delta: float) -> int:
    """The smallest `m` at which Bernstein's range term alone is narrower than Hoeffding's whole half-width.

    Below it Bernstein is wider than Hoeffding whatever the variance (both scale with `B`, so `B` drops
    out). The range term falls as `1/m`, Hoeffding as `1/sqrt(m)`: their ratio decreases, so bisect.

    Example:
        ```python
        >>> bernstein_crossover(0.05)
        59
        ```
    """
    def wider(m: int) -> bool:
        return _range_term(m, delta, 1.0) >= hoeffding_half_width(1.0, m, delta)

    low, high = 2, 4
    while wider(high):
        low, high = high, high * 2
    while high - low > 1:  # wider(low) or low == 2, not wider(high)
        mid = (low + high) // 2
        low, high = (mid, high) if wider(mid) else (low, mid)
    return high


def _bernstein_note(r: EvalResult) -> list[str]:
    """Why Bernstein's interval is wider than Hoeffding's, where it is: a reader takes it for a bug."""
    bern, hoef = r.interval_details.get("bernstein", {}), r.interval_details.get("hoeffding", {})
    widths = (bern.get("half_width"), hoef.get("half_width"))
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in widths) or widths[0] <= widths[1] or r.num_examples < 2:
        return []
    m, B = r.num_examples, r.loss_bound
    return [
        "",
        f"Bernstein's interval is wider than Hoeffding's here (half-width {format_value(widths[0])} against "
        f"{format_value(widths[1])}) because of its range term, 7 (2B) ln(4/delta) / (3 (m-1)) = "
        f"{format_value(_range_term(m, r.level, B))} at m = {m}, which shrinks as 1/m where Hoeffding's half-width shrinks "
        f"as 1/sqrt(m). At delta = {r.level:g} Bernstein can be narrower only from m = {bernstein_crossover(r.level)} test "
        "examples on (below that its range term alone is wider), and then only where the differences vary much less than "
        "their range. Both intervals are valid; the narrower one is the better bound.",
    ]


def _route_lines(r: EvalResult) -> list[str]:
    t = r.routes["terms"]
    src = t.get("sources", {})
    rows = [
        ("L_T(f_old) (mean per-example loss on T)", t["loss_old_test"], "measured here"),
        ("Delta_R = L_D(f_old) - L_D(f~_pop)", t["delta_r"], src.get("delta_r", "not given")),
        ("Delta^R_test = L_T(f_old) - L_T(f~)", t["delta_r_test"], src.get("delta_r_test", "not given")),
        ("Delta_ERM = L_S(f~_S) - L_S(f_new)", t["delta_erm"], src.get("delta_erm", "not given")),
        ("rho (estimate)", t["rho"], src.get("rho", "not given")),
        ("B_W", t["b_w"], src.get("b_w", "not given")),
        ("B_a", t["b_a"], src.get("b_a", "not given")),
        ("n (training examples)", t["n_train"], src.get("n_train", "not given")),
        ("m (test examples)", t["m"], "this test set"),
        ("B (loss bound)", t["B"], r.loss_bound_source),
        ("delta", t["delta"], "level of each term"),
        ("eps_M = 2 rho B_W B_a / sqrt(n) + B sqrt(ln(2/delta)/(2n))", t["eps_M"], "computed"),
        ("eps_K = B sqrt(ln(2/delta)/(2m))", t["eps_K"], "computed (test-side Hoeffding term)"),
    ]
    lines = ["", "## Route A and Route B (docs/theory.md §7)", "", "| term | value | how it was obtained |", "|---|---:|---|"]
    lines += [f"| {a} | {format_value(b)} | {table_cell(c)} |" for a, b, c in rows]
    for key, name in (("route_a", "A"), ("route_b", "B")):
        route = r.routes[key]
        lines += ["", f"**Route {name}:** `{route['formula']}`. {route['sentence']}"]
        if route.get("complete"):
            lines.append(
                f"Margin {format_value(route['margin'])}, statistical cost {format_value(route['cost'])}, bound on L_test(f_new) "
                f"{format_value(route['upper_bound_loss_new'])}."
            )
    lines += ["", "Each term holds at level delta on its own; a union bound over the terms a route uses lowers its joint confidence."]
    return lines


HOW_TO_READ = [
    "",
    "## How to read this",
    "",
    "- The delta is measured on the same examples for both models (paired), so the intervals are for the "
    "difference, not for each loss separately.",
    "- Hoeffding and Bernstein are finite-sample guarantees when B is an a-priori bound; the bootstrap is "
    "approximate (asymptotic) and usually the tightest.",
    "- An improvement is certified at level delta by an interval whose lower end is above 0.",
]


def render_markdown(
    result: EvalResult, *, title: str | None = None, command: str | None = None, plots: dict | None = None, extra: dict | None = None
) -> str:
    """The report as Markdown: verdict, loss table, intervals, metrics, routes, notes.

    Example:
        ```python
        >>> text = render_markdown(evaluate_delta(grown, test_data, loss_bound=20.0), title="My run")
        >>> text.splitlines()[0]
        '# My run'
        ```
    """
    r = result
    lines = scrub_paths(_header_lines(r, title)) + _loss_lines(r) + _interval_lines(r)
    if r.routes:
        lines += _route_lines(r)
    if extra:
        lines += ["", "## Setup", ""] + [scrub_paths(f"- {k}: {v}") for k, v in extra.items()]
    if r.warnings:
        lines += ["", "## Notes", ""] + [scrub_paths(f"- {w}") for w in r.warnings]
    if plots:
        lines += ["", "## Figures", ""]
        lines += [f"![{name}]({Path(path).name})" for name, path in plots.items()]
    lines += HOW_TO_READ
    if command:
        lines += ["", "Command:", "", "```bash", scrub_paths(command), "```"]
    return "\n".join(lines) + "\n"


def write_report(
    result: EvalResult, out_dir: str | Path, *, title: str | None = None, command: str | None = None, extra: dict | None = None
) -> dict[str, Path]:
    """Write `report.json`, `report.md` and the plots into `out_dir`; return their paths.

    Example:
        ```python
        >>> paths = write_report(evaluate_delta(grown, test_data), "eval_out", command="hf-depthgrow eval ...")
        >>> paths["markdown"].name
        'report.md'
        ```
    """
    from .plots import plot_differences, plot_intervals  # matplotlib loads only when a report is written

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "differences": plot_differences(result, out / PLOTS["differences"]),
        "intervals": plot_intervals(result, out / PLOTS["intervals"]),
    }
    data = result.to_dict()
    if command:
        data["command"] = scrub_paths(command)
    if extra:
        data["extra"] = scrub_paths(json_safe(extra))
    data["hf_depthgrow_version"] = package_version()
    (out / "report.json").write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    (out / "report.md").write_text(render_markdown(result, title=title, command=command, plots=plots, extra=extra))
    return {"json": out / "report.json", "markdown": out / "report.md", **plots}
