"""What a comparison says beyond one table: the frontier verdict, the per-budget tables, the grids and the fits.

`CompareResult.to_markdown()` and `.to_dict()` call these; they read only the result's fields.
"""

from __future__ import annotations

from ..evaluation.formatting import format_value
from ..utils import json_safe
from .fresh_data import DataPlan, format_epochs


def _span(row: dict) -> str:
    return f"{format_value(row['mean'])} [{format_value(row['low'])}, {format_value(row['high'])}]"


def frontier_sentence(view) -> str | None:
    """The frontier verdict at one budget: best on gain, best within the forgetting budget, growth vs the frontier and curve."""
    fr = view.frontier
    if not fr:
        return None
    growth = [a.name for a in view.arms if a.kind == "growth"]
    parts = [f"at {view.steps} steps, the best arm on gain (held-out) is {fr['best_gain']}"]
    if "best_within" in fr:
        parts.append(f"the best within forgetting {format_value(fr['max_forgetting'])} nats is {fr['best_within']}")
    on = [n for n in fr["frontier"] if n in growth]
    parts.append(f"growth on the gain x forgetting frontier: {', '.join(on) if on else 'none'}")
    curve = fr.get("control_curve")
    if curve:
        off = [n for n, r in curve["arms"].items() if r["status"] == "off the curve"]
        more = [n for n, r in curve["arms"].items() if r["status"] == "forgets more than the curve"]
        text = f"off the control curve (forgets less at matched gain): {', '.join(off) if off else 'none'}"
        if more:
            text += f"; forgets more than it: {', '.join(more)}"
        parts.append(text)
    return "; ".join(parts)


def data_lines(result) -> list[str]:
    """compare.md's training-data section: blocks, epochs per budget, and whether blocks repeat."""
    blocks = (result.num_examples or {}).get("train")
    if not blocks or not result.views:
        return []
    cfg = result.config
    plan = DataPlan(blocks, cfg["batch_size"], tuple(v.steps for v in result.views), bool(cfg.get("allow_repeated_data")))
    return ["## Training data", "", plan.markdown(), ""]


def tokens_per_parameter(arm, units: int) -> float | None:
    return units / arm.trainable_parameters if arm.trainable_parameters else None


def view_dict(view) -> dict:
    """One budget, JSON-ready: per arm its rate, tokens per trainable parameter, gain and forgetting with intervals."""
    stats, arms = view.statistics, {}
    for a in view.arms:
        row = {"kind": a.kind, "learning_rate": a.learning_rate, "selected": a.selected, "heldout_loss": a.heldout_loss,
               "test_loss": a.test_loss, "retention_loss": a.retention_loss, "trainable_parameters": a.trainable_parameters,
               "tokens_per_parameter": tokens_per_parameter(a, view.units_seen)}  # fmt: skip
        gain = (stats.get("vs_original") or {}).get("arms", {}).get(a.name)
        row["gain"] = {k: gain[k] for k in ("mean", "low", "high", "certified")} if gain else None
        ret = (stats.get("retention") or {}).get("arms", {}).get(a.name)
        row["forgetting"] = {"mean": -ret["mean"], "low": -ret["high"], "high": -ret["low"], "certified": ret["worse"]} if ret else None
        if a.kind == "original":  # the reference of both axes
            zero = {"mean": 0.0, "low": 0.0, "high": 0.0}
            row["gain"], row["forgetting"] = zero, (zero if a.retention_loss is not None else None)
        arms[a.name] = row
    return json_safe({"steps": view.steps, "tokens": view.units_seen, "epochs": view.epochs, "arms": arms, "best_control": stats.get("best_control"),
                      "best_growth": stats.get("best_growth"), "frontier": (view.frontier or {}).get("frontier"),
                      "frontier_detail": view.frontier, "verdict": frontier_sentence(view)})  # fmt: skip


def grid_lines(grids: dict) -> list[str]:
    """One line per arm whose grid was extended or whose choice stayed at an edge."""
    lines = []
    for name, g in grids.items():
        edges = {b: e for b, e in (g.get("edges") or {}).items() if e}
        if g.get("added"):
            lines.append(f"- {name}: grid {[format_value(r) for r in g['grid']]} extended by {[format_value(r) for r in g['added']]} "
                         f"({'choice now interior' if g.get('stopped') == 'interior' else 'stopped: ' + str(g.get('stopped'))}).")
        if edges and g.get("stopped") in ("limit", "cap"):
            where = ", ".join(f"{b} steps: {e}" for b, e in edges.items())
            lines.append(f"- {name}: the chosen rate is still at an edge ({where}); the {g['stopped']} stopped the extension.")
    return lines


def sweep_markdown(result) -> list[str]:
    """Markdown sections for the frontier, the per-budget tables (several budgets), the grids, halving and the fits."""
    lines = data_lines(result)
    views = result.views
    if len(views) > 1:
        lines += ["## Per budget", "", "Every budget is a complete run with its own decay (warmup-stable-decay), its rate chosen "
                  "on held-out for that budget. gain = paired test delta vs the original; forgetting on the retention "
                  "set's test part; epochs = passes over the training data; tok/param = tokens per trainable parameter; "
                  "`F` = on the gain x forgetting frontier (held-out and retention selection part).", "",
                  "| steps | epochs | arm | lr | tok/param | gain | forgetting | F |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for view in views:
            d = view_dict(view)
            for name, row in d["arms"].items():
                if row["kind"] == "original":
                    continue
                mark = "F" if name in (d["frontier"] or []) else ""
                forget = _span(row["forgetting"]) if row["forgetting"] else ""
                epochs = format_epochs(view.epochs) if view.epochs is not None else ""
                lines.append(f"| {view.steps} | {epochs} | {name} | {format_value(row['learning_rate'])} | {format_value(row['tokens_per_parameter'])} | "
                             f"{_span(row['gain'])} | {forget} | {mark} |")
        lines.append("")
    sentences = [s for s in (frontier_sentence(v) for v in views) if s]
    if sentences:
        lines += ["## Gain x forgetting", ""] + [f"- {s[0].upper() + s[1:]}." for s in sentences] + [""]
        curve = views[-1].frontier.get("control_curve")
        if curve:
            lines += ["Control curve at the largest budget (margin = the curve's forgetting at the arm's gain minus the "
                      f"arm's, positive = forgets less; Bonferroni over growth arms, level {format_value(curve['level'])} each):", ""]
            lines += [f"- {n}: gain {format_value(r['gain'])}, forgetting {format_value(r['forgetting'])}, margin {_span(r['margin'])}: {r['status']}"
                      for n, r in curve["arms"].items()] + [""]
    notes = grid_lines(result.grids)
    if notes:
        lines += ["## Learning-rate grids", ""] + notes + [""]
    if result.halving_agreement:
        lines += ["## Successive halving, replayed", "", "How often halving's survivor (at 1/4 and 1/2 of each budget, on held-out) is the "
                  "full grid's choice:", ""]
        lines += [f"- {k}: {v['agree']} of {v['of']} ({v['share']:.0%})" for k, v in result.halving_agreement.items()] + [""]
    if result.curves:
        lines += curve_markdown(result.curves)
    return lines


def curve_markdown(curves: dict) -> list[str]:
    """The learning-curve fits, the predicted crossover and the fit's validation."""
    lines = ["## Learning curves and the predicted crossover", ""]
    for key in ("summary", "crossover_text", "within_text", "validation_text"):
        if curves.get(key):
            lines.append(f"- {curves[key]}")
    return lines + [""]
