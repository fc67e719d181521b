"""The sections of a grown model's card: growth, probe, training, evaluation and the fallback selection.

Each takes what the run recorded (a result object, its `to_dict()`, or a summary dict) and returns
the plain values the template shows, or `None` when that step was not run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

from ..evaluation.formatting import format_value, table_cell
from ..growth.record import GrowthRecord
from ..utils import json_number

def plain(value, *, finite: bool = True):
    """Plain data for YAML/JSON: result objects via `to_dict()`, dataclasses, paths and tuples converted.

    `finite=True` turns inf/nan into `None` (a section shows "–"); the reproducing config keeps them
    (YAML writes `.inf`), so it stays exactly what was run.
    """
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v, finite=finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, finite=finite) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v, finite=finite) for v in value), key=repr)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, float) and finite and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return plain(value.item(), finite=finite)
    return str(value)


def seconds_text(x) -> str:
    """A duration in seconds as "12.0 s", "3.5 min" or "2.10 h"."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return format_value(x)
    if x < 120:
        return f"{x:.1f} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.2f} h"


def growth_section(record: GrowthRecord | None) -> dict | None:
    if not record:
        return None
    history = []
    for step in record.history:
        where = ", ".join(str(k) for k in step.positions)
        how = f"init `{step.init}`" if step.block == "native" else "W_out = 0"
        history.append(
            f"{step.block} block(s) inserted at position(s) k = {where} of a {step.num_layers_before}-layer stack "
            f"({how}, eps {format_value(step.eps)}, seed {step.seed}); each sees the residual stream entering layer k."
        )
    adapters = [
        f"adapter block on layer {a.host} ({a.where}-hook): width {a.dim}, {a.norm} norm "
        f"with eps {format_value(a.eps)}, {a.act} activation."
        for a in record.adapters
    ]
    return {
        "history": history,
        "native_indices": ", ".join(str(i) for i in record.native_indices),
        "num_layers": record.num_layers,
        "adapters": adapters,
    }


def probe_section(probe) -> dict | None:
    if probe is None:
        return None
    p = plain(probe)
    positions = p.get("positions") or []
    per = lambda key: p.get(key) if isinstance(p.get(key), list) else None  # noqa: E731
    signal, z, verdict = per("signal"), per("z"), per("verdict")
    rows = [
        {
            "k": k,
            "signal": table_cell(signal[i] if signal and i < len(signal) else None),
            "z": table_cell(z[i] if z and i < len(z) else None),
            "verdict": table_cell(verdict[i] if verdict and i < len(verdict) else None),
        }
        for i, k in enumerate(positions)
    ]
    lines = []
    if isinstance(p.get("verdict"), str):
        lines.append(f"Verdict: {p['verdict']}")
    rec = p.get("recommendation")
    if isinstance(rec, Mapping):
        if rec.get("reason"):
            lines.append(f"Recommendation: {rec['reason']}")
        elif rec.get("positions") is not None:
            lines.append(f"Recommendation: grow at {format_value(rec['positions'])}.")
    elif rec:
        lines.append(f"Recommendation: {rec}")
    facts = []
    if p.get("block"):
        facts.append(f"probed block kind `{p['block']}`")
    if p.get("num_examples") is not None:
        facts.append(f"{p['num_examples']} examples")
    if p.get("z_threshold") is not None:
        facts.append(f"improvable where z > {format_value(p['z_threshold'])}")
    if facts:
        lines.append("Probe settings: " + ", ".join(facts) + ".")
    lines.append(
        "The signal is the norm of the loss gradient with respect to the new block's parameters at zero init; the z-score "
        "tests whether its population counterpart is positive (a first-order decrease of the test risk is available)."
    )
    return {"rows": rows, "lines": lines}


_TRAIN_ROWS = (
    ("trainable set", ("trainable",), format_value),
    ("optimizer steps", ("steps", "global_step", "max_steps"), format_value),
    ("learning rate", ("learning_rate", "lr"), format_value),
    ("batch size", ("batch_size", "per_device_train_batch_size"), format_value),
    ("gradient accumulation", ("gradient_accumulation_steps",), format_value),
    ("sequence length", ("seq_length", "block_size", "max_length", "seq_len"), format_value),
    ("data", ("data", "dataset", "train_data"), format_value),
    ("training time", ("time", "train_runtime", "seconds"), seconds_text),
)
# Keys that belong to other sections or are bulky; they stay out of the training table.
_TRAIN_SKIP = {"selected", "delta_erm", "reference", "train_losses", "history", "eval_history", "model_path", "output_dir"}


def training_section(training) -> dict | None:
    if training is None:
        return None
    t = plain(training)
    rows, used = [], set()
    for label, keys, fmt in _TRAIN_ROWS:
        for key in keys:
            if t.get(key) is not None and not (key == "max_steps" and t[key] == -1):
                rows.append((label, table_cell(fmt(t[key]))))
                used.update(keys)
                break
    for key in sorted(set(t) - used - _TRAIN_SKIP):
        value = t[key]
        if value is not None and isinstance(value, (str, int, float, bool)):
            rows.append((key, table_cell(value)))
    return {"rows": rows} if rows else {"rows": [("record", "given but empty")]}


def _auto_verdict(intervals: dict, certified: dict) -> str:
    up = [n for n, (lo, hi) in intervals.items() if certified.get(n, lo is not None and lo > 0)]
    down = [n for n, (lo, hi) in intervals.items() if hi is not None and hi < 0]
    if up:
        return f"Certified improvement by: {', '.join(up)}."
    if down:
        return f"Certified degradation by: {', '.join(down)}."
    return "No certified difference: every interval contains 0."


def _bernstein_line(intervals: dict, confidence) -> list[str]:
    """Why Bernstein's interval is wider than Hoeffding's, where it is: a reader takes it for a bug."""
    from ..evaluation.report import bernstein_crossover

    def finite(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    width = {n: hi - lo for n, (lo, hi) in intervals.items() if finite(lo) and finite(hi)}
    if width.get("bernstein", -math.inf) <= width.get("hoeffding", math.inf):
        return []
    level = 1 - confidence if finite(confidence) and 0 < confidence < 1 else 0.05
    return [
        "Bernstein's interval is wider than Hoeffding's: at this number of test examples its range term, which shrinks as "
        f"1/m where Hoeffding's half-width shrinks as 1/sqrt(m), dominates (at confidence {1 - level:.0%} Bernstein can be "
        f"narrower only from {bernstein_crossover(level)} test examples on). Both are valid bounds."
    ]


def evaluation_section(evaluation) -> dict | None:
    if evaluation is None:
        return None
    e = plain(evaluation)
    intervals = {}
    raw = e.get("intervals") or ({"interval": e["interval"]} if e.get("interval") is not None else {})
    for name, bounds in raw.items():
        lo, hi = (list(bounds) + [None, None])[:2] if isinstance(bounds, (list, tuple)) else (None, None)
        intervals[name] = (json_number(lo), json_number(hi))  # an EvalResult's to_dict writes inf as "inf"
    certified = e.get("certified") or {}

    def row(label, old, new, delta):
        return {"label": label, "old": table_cell(old), "new": table_cell(new), "delta": table_cell(delta)}  # "" stays an empty cell

    loss_rows = []
    if any(e.get(k) is not None for k in ("loss_old", "loss_new", "delta")):
        loss_rows.append(row("test loss", e.get("loss_old"), e.get("loss_new"), e.get("delta")))
    if e.get("mean_delta") is not None and e.get("mean_delta") != e.get("delta"):
        loss_rows.append(row("mean per-example delta (the intervals' target)", "", "", e["mean_delta"]))
    metrics = e.get("metrics") or {}
    for name in metrics.get("old") or {}:
        loss_rows.append(row(name, metrics["old"].get(name), (metrics.get("new") or {}).get(name), (metrics.get("delta") or {}).get(name)))
    confidence = e.get("confidence")
    if confidence is None and e.get("level") is not None:
        confidence = 1 - e["level"]
    interval_rows = [
        {"name": table_cell(n), "low": table_cell(lo), "high": table_cell(hi), "certified": table_cell(bool(certified.get(n, lo is not None and lo > 0)))}
        for n, (lo, hi) in intervals.items()
    ]
    # A run with a control or a retention set says first, in one sentence each, what they showed.
    lines = [part["sentence"] for part in (e.get("control"), e.get("retention")) if isinstance(part, Mapping) and part.get("sentence")]
    if e.get("num_examples") is not None:
        lines.append(f"{e['num_examples']} test examples" + (f", {e['num_tokens']} supervised tokens." if e.get("num_tokens") else "."))
    if e.get("data"):
        lines.append(f"Test data: {e['data']}.")
    for warning in e.get("warnings") or []:
        lines.append(f"Warning: {warning}")
    lines += _bernstein_line(intervals, confidence)
    return {
        "verdict": e.get("verdict") or _auto_verdict(intervals, certified),
        "confidence": f"{confidence:.0%}" if isinstance(confidence, (int, float)) else (confidence or ""),
        "target": e.get("interval_target") or "the mean test-loss difference",
        "loss_rows": loss_rows,
        "interval_rows": interval_rows,
        "lines": lines,
    }


_SELECTED = {
    "new": "the trained grown model (`new`)",
    "stepping_stone": "the stepping-stone model (`stepping_stone`)",
    "old": "the original model's function (`old`: the new blocks are left at zero, so the model computes exactly what the base does)",
}


def selection_section(selection, training) -> dict | None:
    s = plain(selection) if selection is not None else None
    if s is None and isinstance(plain(training), Mapping):
        t = plain(training)
        if t.get("selected") is not None or t.get("delta_erm") is not None:
            s = {k: t.get(k) for k in ("selected", "delta_erm", "reference", "train_losses")}
    if s is None:
        return None
    lines = []
    if s.get("selected"):
        chosen = _SELECTED.get(s["selected"], f"`{s['selected']}`")
        lines.append(
            f"The fallback rule selected {chosen}: the candidate with the lowest training loss, so the selected model "
            "is never worse than the original on the training data."
        )
    if s.get("delta_erm") is not None:
        ref = s.get("reference") or "old"
        gain = f"the training-loss gain of the trained model over `{ref}`"
        lines.append(f"Delta_ERM = L_S({ref}) - L_S(new) = {format_value(s['delta_erm'])} ({gain}).")
    for name, value in (s.get("train_losses") or {}).items():
        lines.append(f"Training loss L_S({name}) = {format_value(value)}.")
    return {"lines": lines or ["Recorded, but empty."]}
