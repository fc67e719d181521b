"""`CompareResult`: every arm's numbers, the corrected intervals, the verdict, and writing them out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..evaluation.formatting import format_value
from ..utils import atomic_write_text, json_safe, write_json


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

    @classmethod
    def original(cls, arm, original: dict) -> "ArmResult":
        test, weight = original["test"]
        ret = original.get("retention")
        return cls(
            name=arm.name, kind=arm.kind, arm=arm.to_dict(), heldout_loss=original["heldout"],
            test_loss=_weighted(test, weight), retention_loss=_weighted(*ret) if ret else None,
            test_per_example=test, retention_per_example=ret[0] if ret else None,
        )  # fmt: skip

    @classmethod
    def trained(cls, arm, lr, res, tried, seconds, units, scored, eval_seconds) -> "ArmResult":
        ret = scored.get("retention")
        return cls(
            name=arm.name, kind=arm.kind, arm=arm.to_dict(), learning_rate=lr, tried=tried, selected=res.selected,
            heldout_loss=res.eval_loss_selected, test_loss=_weighted(*scored["test"]),
            retention_loss=_weighted(*ret) if ret else None, train_seconds=seconds, eval_seconds=eval_seconds,
            units_seen=units, trainable_parameters=res.num_trainable_parameters, test_per_example=scored["test"][0],
            retention_per_example=ret[0] if ret else None,
        )  # fmt: skip

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.endswith("_per_example")}
        return json_safe(out)


def _weighted(per: np.ndarray, weight: np.ndarray) -> float:
    return float((per * weight).sum() / max(weight.sum(), 1.0))


@dataclass
class CompareResult:
    """What `compare_plans` returns; `save(folder)` writes `compare.json`, `compare.md` and `compare.png`.

    Attributes:
        arms: `ArmResult`s, the original first.
        statistics: `vs_original`, `vs_best_control`, `retention` (each `corrected_intervals`' output,
            positive mean = better than the reference / no forgetting), `best_control`, `best_growth`
            (each chosen by held-out loss, never by test loss).
        probe: The probe's positions, signal and z (when it ran or was given).
        seconds, num_examples, config: cost, sizes, settings.
    """

    arms: list[ArmResult]
    config: dict
    statistics: dict
    probe: dict | None = None
    seconds: dict = field(default_factory=dict)
    num_examples: dict = field(default_factory=dict)

    def arm(self, name: str) -> ArmResult:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(f"no arm {name!r} (have {[a.name for a in self.arms]})")

    @property
    def verdict(self) -> str:
        """One plain sentence: did growth beat the best control, and by how much."""
        stats = self.statistics
        best_growth, control = stats.get("best_growth"), stats.get("best_control")
        level = 1 - stats["vs_original"]["delta"]
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
            for key in ("vs_original", "vs_best_control", "retention"):
                block = stats.get(key)
                if block and a.name in block["arms"]:
                    r = block["arms"][a.name]
                    row[key] = {"mean": r["mean"], "low": r["low"], "high": r["high"], "certified": r["certified"], "worse": r["worse"]}
            out.append(row)
        return json_safe(out)

    def to_dict(self) -> dict:
        return json_safe({
            "verdict": self.verdict, "rows": self.rows(), "arms": [a.to_dict() for a in self.arms],
            "statistics": self.statistics, "probe": self.probe, "seconds": self.seconds,
            "num_examples": self.num_examples, "config": self.config,
        })

    def to_markdown(self) -> str:
        """The comparison table and the verdict as Markdown."""
        level = 1 - self.statistics["vs_original"]["delta"]
        method = self.statistics["vs_original"]["method"]
        lines = [
            "# Comparison at an equal budget", "",
            f"**Verdict:** {self.verdict}.", "",
            f"Every arm: {self.config['max_steps']} optimizer steps of {self.config['batch_size']} examples, "
            f"{self.config['lr_scheduler']} schedule, learning rate chosen on held-out from {self.config['learning_rates']}. "
            f"Intervals: {self.config['interval']}, {level:.0%} family-wise ({method} over the arms). "
            "Deltas are `loss(reference) - loss(arm)`: positive = the arm is better; forgetting = retention loss "
            "of the arm minus the original's (positive = forgot).", "",
            "| arm | kind | trainable | lr | held-out | test | vs original | vs best control | forgetting | train s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows():
            ret = row.get("retention")
            forgetting = _span({"mean": -ret["mean"], "low": -ret["high"], "high": -ret["low"]}) + (" *" if ret["worse"] else "") if ret else ""
            lines.append(
                f"| {row['arm']} | {row['kind']} | {row['trainable_parameters'] or 0:,} | {format_value(row['learning_rate'])} | "
                f"{format_value(row['heldout_loss'])} | {format_value(row['test_loss'])} | "
                f"{_cell(row.get('vs_original'))} | {_cell(row.get('vs_best_control'))} | {forgetting} | {format_value(row['train_seconds'])} |"
            )
        lines += ["", "`+` certified better, `-` certified worse (after the correction); `*` certified forgetting. "
                  "train s: the arm's whole training time (every rate of the grid until it stopped, set-up and held-out "
                  "evaluations included).", ""]
        lines.append(f"Best control (held-out): {self.statistics.get('best_control')}; best growth arm (held-out): {self.statistics.get('best_growth')}.")
        lines.append(f"Seconds: {', '.join(f'{k} {v:.1f}' for k, v in self.seconds.items())}.")
        return "\n".join(lines) + "\n"

    def save(self, folder) -> dict[str, str]:
        """Write `compare.json`, `compare.md` and `compare.png` into `folder` (atomically); returns their paths."""
        from ..plots import plot_comparison

        return write_outputs(folder, "compare", self, plot_comparison)

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


def _span(row: dict) -> str:
    return f"{format_value(row['mean'])} [{format_value(row['low'])}, {format_value(row['high'])}]"


def _cell(row: dict | None) -> str:
    if not row:
        return ""
    mark = " +" if row["certified"] else " -" if row["worse"] else ""
    return _span(row) + mark
