"""What a comparison says beyond one table: the frontier verdict, the per-budget tables, the grids and the fits.

`CompareResult.to_markdown()` and `.to_dict()` call these; they read only the result's fields.
"""

from __future__ import annotations

from ..evaluation.formatting import format_value
from ..utils import json_safe
from .fresh_data import DataPlan, format_epochs


def _span(row: dict) -> str:
    return f"{format_value(row['mean'])} [{format_value(row['low'])}, {format_value(row['high'])}]"


def mark(row: dict) -> str:
    """` +` for an interval certified better, ` -` for one certified worse (after the correction), else nothing."""
    return " +" if row["certified"] else " -" if row["worse"] else ""


def negated(row: dict) -> dict:
    """`{mean, low, high}` of minus the quantity: forgetting from a retention delta (positive = better kept)."""
    return {"mean": -row["mean"], "low": -row["high"], "high": -row["low"]}


def table(header: list[str], rows) -> list[str]:
    """A Markdown table: the header, its rule, and one line per row, each cell as `format_value` writes it."""
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
            *("| " + " | ".join(format_value(cell) for cell in row) + " |" for row in rows)]


def family_delta(stats: dict) -> float:
    """The error level of the whole comparison (its intervals split it over budgets and seeds)."""
    family = stats.get("family")
    return family["delta"] if family else stats["vs_original"]["delta"]


def family_text(stats: dict, method: str) -> str:
    """How the family-wise level is spent: over the arms of a budget, and over the budgets x seeds."""
    family = stats.get("family") or {}
    blocks = family.get("blocks", 1)
    if blocks <= 1:
        return f"{method} over the arms"
    return (f"{method} over the arms of a budget at {format_value(family['delta_per_block'])} each, Bonferroni over "
            f"{blocks} budgets x seeds: the family is every arm at every budget")


def matched_sentence(stats: dict) -> str | None:
    """Each growth arm against its matched control (the same trainable-parameter count), on test."""
    vs, matched, unmatched = stats.get("vs_matched"), stats.get("matched"), stats.get("unmatched")
    if not vs or not matched:
        return f"no matched control was trained for {', '.join(unmatched)}" if unmatched else None
    parts = []
    for g, m in matched.items():
        row = vs["arms"][g]
        word = "certified better" if row["certified"] else "certified worse" if row["worse"] else "not certified"
        parts.append(f"{g} vs {m}: {_span(row)} nats ({word})")
    parts += [f"{g}: no matched control was trained" for g in unmatched or []]
    return f"against its matched control (same trainable parameters, {vs['method']}-corrected): " + "; ".join(parts)


def _within_text(fr: dict) -> str:
    name = fr["best_within"]
    text = f"the best within forgetting {format_value(fr['max_forgetting'])} nats is {name}"
    if name == "original":
        return text + " (no trained point's selection-part upper bound stays within it)"
    bound, claim = fr.get("best_within_bound"), fr.get("best_within_test")
    bits = [f"selection-part forgetting upper bound {format_value(bound)}"] if bound is not None else []
    if claim:
        bits.append(f"test parts: gain {_span(claim['gain'])}, forgetting {_span(claim['forgetting'])}")
    return text + (f" ({'; '.join(bits)})" if bits else "")


def _not_off_text(name: str, r: dict, controls: dict) -> str:
    """Why a growth point is not off the curve: the control point that dominates it, or the curve it sits on."""
    dom = r.get("dominated_by")
    if dom is not None:
        gain, forgetting = controls[dom]
        return (f"{name} is dominated by {dom} (test gain {format_value(gain)} vs {format_value(r['gain'])}, forgetting "
                f"{format_value(forgetting)} vs {format_value(r['forgetting'])})")
    return f"{name} {'forgets more than' if r['status'] != 'on the curve' else 'is on'} the curve (margin {_span(r['margin'])})"


def curve_text(curve: dict) -> str:
    """Growth against the curve of every control point: which arms are off, which control point dominates the others."""
    arms = curve["arms"]
    off = [n for n, r in arms.items() if r["status"] == "off the curve"]
    text = f"off the curve of every control point (forgets less at matched gain): {', '.join(off) if off else 'none'}"
    rest = [_not_off_text(n, r, curve["controls"]) for n, r in arms.items() if r["status"] != "off the curve"]
    if rest:
        text += "; " + "; ".join(rest)
    every = curve["points"].values()
    return text + f" (growth points off it, every rate: {sum(r['status'] == 'off the curve' for r in every)} of {len(every)})"


def frontier_sentence(view) -> str | None:
    """The frontier verdict at one budget over every point trained to it: best on gain, within the budget, growth vs the curve."""
    fr = view.frontier
    if not fr:
        return None
    points = fr.get("points") or {}
    parts = [f"at {view.steps} steps, over every trained point ({len(points)} arm x rate), the best on gain (held-out) is {fr['best_gain']}"]
    if "best_within" in fr:
        parts.append(_within_text(fr))
    on = [n for n in fr["frontier"] if (points.get(n) or {}).get("kind") == "growth"]
    parts.append(f"growth on the gain x forgetting frontier: {', '.join(on) if on else 'none'}")
    curve = fr.get("control_curve")
    if curve:
        parts.append(curve_text(curve))
    return "; ".join(parts)


def overall_sentence(overall: dict | None) -> str | None:
    """Over every point of every budget: the best on gain, within the forgetting budget, and growth vs that curve."""
    if not overall:
        return None
    parts = [f"over every trained point of every budget ({overall['points']} arm x rate x budget), the best on gain (held-out) is {overall['best_gain']}"]
    if "best_within" in overall:
        parts.append(_within_text(overall))
    curve = overall.get("control_curve")
    if curve:
        growth = curve["points"]
        off = [n for n, r in growth.items() if r["status"] == "off the curve"]
        parts.append(f"growth points off the curve of every control point of every budget: {len(off)} of {len(growth)}"
                     + (f" ({', '.join(off[:3])}{' ...' if len(off) > 3 else ''})" if off else ""))
    return "; ".join(parts)


def data_lines(result) -> list[str]:
    """compare.md's training-data section: blocks, epochs per budget, and whether blocks repeat."""
    blocks = (result.num_examples or {}).get("train")
    if not blocks or not result.views:
        return []
    cfg = result.config
    plan = DataPlan(blocks, cfg["batch_size"], tuple(v.steps for v in result.views), bool(cfg.get("allow_repeated_data")))
    return ["## Training data", "", plan.markdown(), ""]


def view_dict(view) -> dict:
    """One budget, JSON-ready: per arm its rate, tokens per trainable parameter, gain and forgetting with intervals."""
    stats, arms = view.statistics, {}
    for a in view.arms:
        row = {k: getattr(a, k) for k in ("kind", "learning_rate", "selected", "heldout_loss", "test_loss", "retention_loss", "trainable_parameters")}
        row["tokens_per_parameter"] = view.units_seen / a.trainable_parameters if a.trainable_parameters else None
        gain = (stats.get("vs_original") or {}).get("arms", {}).get(a.name)
        row["gain"] = {k: gain[k] for k in ("mean", "low", "high", "certified")} if gain else None
        ret = (stats.get("retention") or {}).get("arms", {}).get(a.name)
        row["forgetting"] = {**negated(ret), "certified": ret["worse"]} if ret else None
        if a.kind == "original":  # the reference of both axes
            zero = {"mean": 0.0, "low": 0.0, "high": 0.0}
            row["gain"], row["forgetting"] = zero, (zero if a.retention_loss is not None else None)
        arms[a.name] = row
    return json_safe({"steps": view.steps, "tokens": view.units_seen, "epochs": view.epochs, "arms": arms, "best_control": stats.get("best_control"),
                      "best_growth": stats.get("best_growth"), "frontier": (view.frontier or {}).get("frontier_arms"),
                      "frontier_points": (view.frontier or {}).get("frontier"),
                      "frontier_detail": view.frontier, "verdict": frontier_sentence(view)})


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
                  "`F` = on the gain x forgetting frontier (held-out and retention selection part).", ""]
        rows = []
        for view in views:
            d = view_dict(view)
            epochs = format_epochs(view.epochs) if view.epochs is not None else ""
            rows += [[view.steps, epochs, name, row["learning_rate"], row["tokens_per_parameter"], _span(row["gain"]),
                      _span(row["forgetting"]) if row["forgetting"] else "", "F" if name in (d["frontier"] or []) else ""]
                     for name, row in d["arms"].items() if row["kind"] != "original"]
        lines += [*table(["steps", "epochs", "arm", "lr", "tok/param", "gain", "forgetting", "F"], rows), ""]
    sentences = [s for s in (frontier_sentence(v) for v in views) if s]
    if sentences:
        family = views[-1].frontier.get("family")
        intro = ([f"Every choice ranges over the trained points (arm x rate x budget); the selection-part forgetting upper "
                  f"bounds are corrected over all {family['points']} points of the comparison (level "
                  f"{format_value(family['level'])} each), so choosing one of them is inside the bound.", ""] if family else [])
        lines += ["## Gain x forgetting", "", *intro] + [f"- {s[0].upper() + s[1:]}." for s in sentences] + [""]
        curve = views[-1].frontier.get("control_curve")
        if curve:
            lines += ["Every growth point at the largest budget against the curve of every control point there (each kind at "
                      "every rate tried, low rates included; margin = the curve's forgetting at the point's gain minus the "
                      f"point's, positive = forgets less; Bonferroni over the {curve['tests']} growth points tested in the "
                      f"comparison, level {format_value(curve['level'])} each; `*`: the rate chosen on held-out):", ""]
            chosen = {r["point"] for r in curve["arms"].values()}
            lines += [f"- {n}{' *' if n in chosen else ''}: gain {format_value(r['gain'])}, forgetting {format_value(r['forgetting'])}, "
                      f"margin {_span(r['margin'])}: {r['status']}" + (f", dominated by {r['dominated_by']}" if r["dominated_by"] else "")
                      for n, r in curve["points"].items()] + [""]
    if result.overall:
        lines += ["## Every point of every budget", "", f"- {overall_sentence(result.overall)[0].upper()}{overall_sentence(result.overall)[1:]}.", ""]
    notes = grid_lines(result.grids)
    if notes:
        lines += ["## Learning-rate grids", ""] + notes + [""]
    if result.halving_agreement:
        lines += ["## Successive halving, replayed", "", "How often halving's survivor (at 1/4 and 1/2 of each budget, on held-out) is the "
                  "full grid's choice:", ""]
        lines += [f"- {k}: {v['agree']} of {v['of']} ({v['share']:.0%})" for k, v in result.halving_agreement.items()] + [""]
    if result.curves:  # the fits, the predicted crossover and the fit's validation
        texts = [result.curves.get(k) for k in ("summary", "crossover_text", "within_text", "validation_text")]
        lines += ["## Learning curves and the predicted crossover", "", *(f"- {t}" for t in texts if t), ""]
    return lines
