"""`CompareResult`: every arm's numbers, the corrected intervals, the verdict, and writing them out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from ..evaluation.formatting import data_parts_text
from ..utils import atomic_write_text, json_safe, write_json
from .sweep_report import (_span, family_delta, family_text, frontier_sentence, mark, matched_sentence, negated, overall_sentence,
                           sweep_markdown, table, view_dict)


@dataclass
class ArmResult:
    """One arm after training: its chosen learning rate, losses, cost and per-example test/retention losses.

    `tried` holds, per learning rate, the held-out loss where it stopped (`stopped_at`); `train_seconds` the
    arm's whole training time (every rate of the grid), `eval_seconds` its test and retention scoring.
    """

    name: str
    kind: str
    arm: dict
    learning_rate: float | None = None
    tried: dict = field(default_factory=dict)
    selected: str | None = None
    heldout_loss: float = float("nan")
    test_loss: float = float("nan")
    retention_loss: float | None = None
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    units_seen: int = 0
    trainable_parameters: int = 0
    test_per_example: np.ndarray | None = None
    retention_per_example: np.ndarray | None = None
    retention_selection: np.ndarray | None = None

    @classmethod
    def original(cls, arm, original: dict, parts=None) -> "ArmResult":
        """The untrained original; `parts`: the retention set's `(selection, test)` indices."""
        return cls._losses(arm, original["test"], original.get("retention"), parts, heldout_loss=original["heldout"])

    @classmethod
    def scored(cls, arm, lr, score, tried, seconds, trainable, parts=None) -> "ArmResult":
        """An arm at one budget from its chosen trial's `BudgetScore`; `seconds`: every rate of its grid."""
        ret = (score.retention, score.retention_weight) if score.retention is not None else None
        return cls._losses(arm, (score.test, score.test_weight), ret, parts, learning_rate=lr, tried=tried, selected=score.selected,
                           heldout_loss=score.heldout_loss, train_seconds=seconds, units_seen=score.units_seen, trainable_parameters=trainable)

    @classmethod
    def _losses(cls, arm, test, ret, parts, **more) -> "ArmResult":
        """The row of `arm` with its `(losses, weights)` on test and on retention (`None`: no retention set), and `more` fields."""
        sel, ret_test = _retention_split(ret, parts)
        return cls(name=arm.name, kind=arm.kind, arm=arm.to_dict(), test_loss=_weighted(*test), test_per_example=test[0],
                   retention_loss=_weighted(*ret_test) if ret_test else None, retention_per_example=ret_test[0] if ret_test else None,
                   retention_selection=sel, **more)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.endswith("_per_example") and k != "retention_selection"}
        return json_safe(out)


def _retention_split(ret, parts):
    """`(selection-part losses, (test-part losses, weights))` of retention losses; no split without `parts`."""
    if ret is None:
        return None, None
    if parts is None:
        return None, ret
    sel, test = parts
    return ret[0][sel], (ret[0][test], ret[1][test])


@dataclass
class BudgetView:
    """A comparison at one budget: every arm at its rate chosen for that budget, the statistics, the frontier."""

    steps: int
    units_seen: int
    arms: list[ArmResult]
    statistics: dict
    frontier: dict | None = None
    epochs: float | None = None  # passes over the training data this budget makes

    def arm_result(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.name == name)


def _weighted(per: np.ndarray, weight: np.ndarray) -> float:
    return float((per * weight).sum() / max(weight.sum(), 1.0))


@dataclass
class CompareResult:
    """What `compare_plans` returns; `save(folder)` writes `compare.json`, `compare.md`, `compare.png` (and the sweep plots).

    Attributes:
        arms: `ArmResult`s, the original first.
        statistics: `vs_original`, `vs_best_control`, `vs_matched` (each growth arm against its matched control,
            named in `matched`), `retention` (each `corrected_intervals`' output, positive mean = better than the
            reference / no forgetting), `best_control`, `best_growth` (each chosen by held-out loss, never by
            test loss), `family` (the error level of the whole comparison and the blocks it is split over).
        probe: The probe's positions, signal and z (when it ran or was given).
        seconds, num_examples, config: cost, sizes, settings.
        views: One `BudgetView` per budget (`arms` and `statistics` are the largest budget's), each with the
            frontier (`comparison.frontier`) when a retention set was given.
        grids: Per arm, the learning-rate grid, the rates added by the extension rule and why it stopped.
        halving_agreement: Per arm kind, how often successive halving (replayed from the full grid's held-out
            curves) keeps the full grid's choice (`None` when halving ran).
        curves: With 3+ budgets: learning-curve fits, the predicted crossover and the fit's validation.
        data_parts: Per part (`train`, `heldout`, `test`, `retention_selection`, `retention_test`) its `blocks` and
            `documents` (`None` where the data names no documents).
        overall: With several budgets and a retention set: the frontier, the point within the forgetting
            budget and the control curve over every trained point of every budget.
    """

    arms: list[ArmResult]
    config: dict
    statistics: dict
    probe: dict | None = None
    seconds: dict = field(default_factory=dict)
    num_examples: dict = field(default_factory=dict)
    views: list[BudgetView] = field(default_factory=list)
    grids: dict = field(default_factory=dict)
    halving_agreement: dict | None = None
    curves: dict | None = None
    data_parts: dict = field(default_factory=dict)
    overall: dict | None = None

    def arm(self, name: str) -> ArmResult:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(f"no arm {name!r} (have {[a.name for a in self.arms]})")

    @property
    def verdict(self) -> str:
        """Plain sentences: growth vs the best control and vs its matched control on gain (at the largest budget), the
        frontier verdict over every point at that budget, and over every point of every budget."""
        sentences = [self.gain_verdict, matched_sentence(self.statistics)]
        sentences += [frontier_sentence(self.views[-1]) if self.views else None, overall_sentence(self.overall)]
        first, *rest = [s for s in sentences if s]
        return ". ".join([first] + [s[0].upper() + s[1:] for s in rest])

    @property
    def gain_verdict(self) -> str:
        """One plain sentence: did growth beat the best control, and by how much."""
        stats = self.statistics
        best_growth, control = stats.get("best_growth"), stats.get("best_control")
        level = 1 - family_delta(stats)
        if control is None:
            row = stats["vs_original"]["arms"][best_growth]
            return f"no control arm was trained; {best_growth} vs the original: {_span(row)} ({level:.0%}, {stats['vs_original']['method']})"
        vs = stats["vs_best_control"]
        certified = vs["certified"]
        if certified:
            name = max(certified, key=lambda n: vs["arms"][n]["mean"])
            return f"growth beat the best control ({control}): {name} by {_span(vs['arms'][name])} nats ({level:.0%}, {vs['method']}-corrected over {len(vs['arms'])} growth arms)"
        row = vs["arms"][best_growth]
        worse = " and was certified worse" if best_growth in vs["worse"] else ""
        return (f"growth did NOT beat the best control ({control}): the best growth arm on held-out, {best_growth}, "
                f"differs by {_span(row)} nats{worse} ({level:.0%}, {vs['method']}-corrected)")

    def rows(self) -> list[dict]:
        """One table row per arm (JSON-ready)."""
        stats = self.statistics
        out = []
        for a in self.arms:
            row = {"arm": a.name, "kind": a.kind, "positions": a.arm.get("positions"), "layers": a.arm.get("layers"),
                   "trainable_parameters": a.trainable_parameters or a.arm.get("trainable_parameters"),
                   "learning_rate": a.learning_rate, "selected": a.selected, "heldout_loss": a.heldout_loss,
                   "test_loss": a.test_loss, "retention_loss": a.retention_loss, "train_seconds": a.train_seconds}
            for key in ("vs_original", "vs_best_control", "vs_matched", "retention"):
                block = stats.get(key)
                if block and a.name in block["arms"]:
                    row[key] = {k: block["arms"][a.name][k] for k in ("mean", "low", "high", "certified", "worse")}
            out.append(row)
        return json_safe(out)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "views"}
        out.update(verdict=self.verdict, rows=self.rows(), arms=[a.to_dict() for a in self.arms], budgets=[view_dict(v) for v in self.views])
        return json_safe(out)

    def to_markdown(self) -> str:
        """The comparison table and the verdict as Markdown."""
        level = 1 - family_delta(self.statistics)
        method = self.statistics["vs_original"]["method"]
        lines = [
            "# Comparison at an equal budget", "",
            f"**Verdict:** {self.verdict}.", "",
            f"Every arm: {self._steps_text()} of {self.config['batch_size']} examples, "
            f"{self._schedule_text()}, learning rate chosen on held-out from {self._grid_text()}. "
            f"Intervals: {self.config['interval']}, {level:.0%} family-wise ({family_text(self.statistics, method)}). "
            "Deltas are `loss(reference) - loss(arm)`: positive = the arm is better; forgetting = retention loss "
            "of the arm minus the original's (positive = forgot).", "",
            *([data_parts_text(self.data_parts, self.config.get("cluster_key")), ""] if self.data_parts else []),
        ]
        rows = []
        for r in self.rows():
            ret = r.get("retention")
            forgetting = _span(negated(ret)) + (" *" if ret["worse"] else "") if ret else ""
            rows.append([r["arm"], r["kind"], f"{r['trainable_parameters'] or 0:,}", r["learning_rate"], r["heldout_loss"], r["test_loss"],
                         *(_cell(r.get(k)) for k in ("vs_original", "vs_best_control", "vs_matched")), forgetting, r["train_seconds"]])
        lines += table(["arm", "kind", "trainable", "lr", "held-out", "test", "vs original", "vs best control", "vs its match", "forgetting",
                        "train s"], rows)
        lines += ["", "`+` certified better, `-` certified worse (after the correction); `*` certified forgetting. "
                  "train s: the arm's whole training time (every rate of the grid until it stopped, set-up and held-out "
                  "evaluations included).", ""]
        lines.append(f"Best control (held-out): {self.statistics.get('best_control')}; best growth arm (held-out): {self.statistics.get('best_growth')}.")
        lines.append(f"Seconds: {', '.join(f'{k} {v:.1f}' for k, v in self.seconds.items())}.")
        lines += ["", *sweep_markdown(self)]
        return "\n".join(lines).rstrip() + "\n"

    def _steps_text(self) -> str:
        """The optimizer steps every arm had: its budgets when it was scored at several (`max_steps` is then unused)."""
        budgets = self.config.get("budgets") or [self.config["max_steps"]]
        if len(budgets) == 1:
            return f"{budgets[0]} optimizer steps"
        listed = ", ".join(str(b) for b in budgets[:-1]) + f" and {budgets[-1]}"
        return f"{listed} optimizer steps (scored at each budget as if trained alone; the table: {budgets[-1]})"

    def _schedule_text(self) -> str:
        budgets = self.config.get("budgets")
        if budgets and len(budgets) > 1:
            return f"warmup-stable-decay schedule decaying over the last {self.config['decay_ratio']:.0%} of each budget"
        name = self.config["lr_scheduler"]
        return f"{'cosine' if name == 'auto' else name} schedule"  # auto is cosine for one budget

    def _grid_text(self) -> str:
        grids = {a.kind: self.config.get(f"{a.kind}_learning_rates") for a in self.arms if a.kind != "original"}
        text = str(self.config["learning_rates"]) if self.config.get("learning_rates") else (
            "each kind's grid (" + "; ".join(f"{k} {v}" for k, v in grids.items()) + ")")
        below = max((g.get("below") or 0 for g in self.grids.values()), default=0)
        if below:  # the forgetting curve is traced below each grid
            text += f", each reaching {below} x3 steps below its lowest rate (forgetting is measured)"
        return text

    def save(self, folder) -> dict[str, str]:
        """Write `compare.json`, `compare.md` and `compare.png` into `folder` (atomically); returns their paths."""
        from ..plots import plot_comparison
        from .plots import plot_gain_forgetting, plot_learning_curves

        paths = write_outputs(folder, "compare", self, plot_comparison)
        sweep = self.sweep_dict()
        if len(self.views) > 1 or (self.views and self.views[-1].frontier):
            paths["frontier_plot"] = str(plot_gain_forgetting(sweep, Path(folder) / "compare_frontier.png"))
        if self.curves:
            paths["curves_plot"] = str(plot_learning_curves(sweep, Path(folder) / "compare_curves.png"))
        return paths

    def sweep_dict(self) -> dict:
        """Per budget rows, the fits and the crossover: what the two sweep plots draw (JSON-ready)."""
        crossover = (self.curves or {}).get("crossover") or {}
        return json_safe({"budgets": [view_dict(v) for v in self.views], "fits": crossover.get("fits") or {}, "crossover": crossover})

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def write_outputs(folder, stem: str, result, plot) -> dict[str, str]:
    """`<stem>.json` (`result.to_dict()`), `<stem>.md` (`result.to_markdown()`) and `<stem>.png` (`plot`), each atomic."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md", "plot": out / f"{stem}.png"}
    write_json(paths["json"], result.to_dict())
    atomic_write_text(paths["markdown"], result.to_markdown())
    plot(result, paths["plot"])
    return {k: str(v) for k, v in paths.items()}


def _cell(row: dict | None) -> str:
    return _span(row) + mark(row) if row else ""
