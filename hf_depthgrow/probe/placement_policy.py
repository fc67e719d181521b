"""Placement policies held to the committed oracle sweeps: which rule for where a block goes loses least where it is wrong.

An oracle sweep (`comparison.validation.validate_probe`) trains one block at each position and records the
realized gain there. A placement *policy* picks one position: the argmax of a predictor's scores (the probe's `z`
and `signal`, the gradient norm, block influence, the look-ahead, ADEPT's and MIDAS's rules), or a fixed rule
(`depth` = the top of the stack, `midas` = the middle, `bottom`), or a uniformly random position (`random`: its
expected regret, and a Spearman of 0 in expectation). Per task a policy has

- its **regret**: the best position's realized gain minus the gain at its pick, in nats (ties in the scores go to
  the lower position, as `evaluation.decisions.regret` breaks them);
- its **relative regret**: the regret over the task's best-minus-worst range (tasks differ in scale by 50x), so 0
  is the best position and 1 the worst;
- the **Spearman** correlation of its scores with the realized gains.

`choose_default` picks the policy with the smallest **worst-case relative regret** over the tasks, among the
policies measured on every task; ties go to the smaller mean relative regret, then the higher mean Spearman, then
the order of `POLICIES` (cheapest first). `DEFAULT_PLACEMENT` is that choice on the committed tasks, and
`DEFAULT_TRACK_RECORD` its row; a test recomputes both from the committed JSON, so they cannot drift from it.

Example:
    ```python
    >>> from hf_depthgrow.probe.placement_policy import TaskOracle, choose_default, policy_table
    >>> task = TaskOracle("a", positions=[0, 1, 2, 3], realized=[0.1, 0.4, 0.3, 0.2],
    ...                   scores={"z": [0.0, 3.0, 1.0, 2.0], "depth": [0.0, 1.0, 2.0, 3.0]})
    >>> rows = policy_table([task])
    >>> [r["policy"] for r in rows], choose_default(rows)["policy"]
    (['z', 'random', 'depth', 'bottom'], 'z')
    ```
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = [
    "DEFAULT_PLACEMENT",
    "DEFAULT_TRACK_RECORD",
    "POLICIES",
    "TaskOracle",
    "choose_default",
    "could_win",
    "load_task",
    "policy_table",
    "probe_policy_scores",
    "track_record",
    "track_record_line",
    "track_record_markdown",
]

# Every policy, cheapest first (the last tie-break), with what it costs beyond the probe `run` and `probe` always run.
POLICIES = {
    "depth": "nothing (the top of the stack)",
    "midas": "nothing (the middle of the stack)",
    "bottom": "nothing (the bottom of the stack)",
    "random": "nothing (a uniformly random position; expected regret)",
    "z": "nothing beyond the probe (its z-score)",
    "signal": "nothing beyond the probe (its signal norm)",
    "block_influence": "one forward pass per batch",
    "gradient_norm": "one forward and backward pass of the original per batch",
    "adept": "one retention-set forward pass per candidate layer, and a retention set",
    "lookahead": "a few training steps at every candidate position",
}
# The choice on the committed oracle sweeps and its row (`docs/decisions/placement/track_record.py` writes the table; a test
# recomputes both from the committed JSON).
DEFAULT_PLACEMENT = "z"
DEFAULT_TRACK_RECORD = {
    "policy": "z", "measured": 4, "worst_relative_regret": 0.5982694618438164, "worst_task": "vit-fashion-mnist-to-digits",
    "worst_regret": 0.2797953208663677, "worst_regret_task": "vit-fashion-mnist-to-digits", "mean_spearman": 0.3464285714285714,
}
_FIXED = {"depth": lambda k: float(k), "bottom": lambda k: -float(k)}  # rules that need no committed score
_TIE = 1e-12
# Policies a `ProbeResult` holds everything for: the probe's recommendation can rank by them at no extra cost.
PROBE_POLICIES = ("z", "signal", "depth", "bottom", "midas")


def probe_policy_scores(policy: str, positions: Sequence[int], *, z: Sequence[float], signal: Sequence[float] | None = None,
                        num_layers: int | None = None) -> list[float]:
    """A policy's scores (higher = better) from what the probe measured: its `z`, its `signal`, or the positions.

    Example:
        ```python
        >>> probe_policy_scores("depth", [0, 2, 4], z=[1.0, 0.5, 0.2])
        [0.0, 2.0, 4.0]
        ```
    """
    if policy == "z":
        return [float(v) for v in z]
    if policy == "signal" and signal is not None:
        return [float(v) for v in signal]
    if policy in _FIXED:
        return [_FIXED[policy](k) for k in positions]
    if policy == "midas" and num_layers is not None:
        from .placement_rules import midas_rule

        return midas_rule(num_layers, positions)
    if policy in POLICIES and policy not in PROBE_POLICIES:
        raise ValueError(f"placement policy {policy!r} needs {POLICIES[policy]}, which the probe does not compute")
    raise ValueError(f"placement policy {policy!r} cannot be scored from these inputs (known: {', '.join(POLICIES)})")


@dataclass
class TaskOracle:
    """One committed oracle sweep: the positions, the realized gain at each, and every predictor's scores there."""

    name: str
    positions: list[int]
    realized: list[float]
    scores: dict[str, list[float]]

    def __post_init__(self):
        if len(self.positions) < 2 or len(self.realized) != len(self.positions):
            raise ValueError(f"task {self.name!r}: needs >= 2 positions and one realized gain per position, got "
                             f"{len(self.positions)} positions and {len(self.realized)} gains")
        bad = sorted(n for n, s in self.scores.items() if len(s) != len(self.positions))
        if bad:
            raise ValueError(f"task {self.name!r}: scores of {bad} do not have one value per position ({len(self.positions)})")


def load_task(folder, name: str | None = None) -> TaskOracle:
    """A task from a committed oracle folder: `probe_validation.json`, plus `placement_scores.json` where present.

    The validation's own scores win over the added ones; its seeded `random` draw is left out (the `random` policy is
    the expectation over every position). The positions of both files must agree.

    Example:
        ```python
        >>> load_task("docs/decisions/smollm2-shakespeare").positions
        [0, 6, 12, 18, 24, 30]
        ```
    """
    folder = Path(folder)
    validation = json.loads((folder / "probe_validation.json").read_text())
    scores = {k: v for k, v in validation["scores"].items() if k != "random"}
    extra = folder / "placement_scores.json"
    if extra.is_file():
        added = json.loads(extra.read_text())
        if added["positions"] != validation["positions"]:
            raise ValueError(f"{extra}: positions {added['positions']} differ from the oracle's {validation['positions']}")
        scores.update({k: v for k, v in added["scores"].items() if k not in scores})
    return TaskOracle(name or folder.name, list(validation["positions"]), [float(g) for g in validation["realized"]], scores)


def _pick_regret(scores: Sequence[float], gains: np.ndarray) -> tuple[int, float]:
    from ..evaluation.decisions import regret

    top = int(np.flatnonzero(np.asarray(scores, dtype=float) == np.max(scores))[0])  # the lower position on ties
    return top, regret(scores, gains)


def _on_task(policy: str, task: TaskOracle) -> dict | None:
    """A policy's pick, regret (nats and relative) and Spearman on one task; `None` where it was not measured."""
    from ..evaluation.decisions import spearman

    gains = np.asarray(task.realized, dtype=float)
    spread = float(gains.max() - gains.min())

    def relative(r: float) -> float:
        return r / spread if spread > 0 else 0.0  # every position equal: nothing to lose

    if policy == "random":
        r = float(np.mean(gains.max() - gains))
        return {"pick": None, "regret": r, "relative_regret": relative(r), "spearman": 0.0}
    scores = task.scores.get(policy)
    if scores is None and policy in _FIXED:
        scores = [_FIXED[policy](k) for k in task.positions]
    if scores is None:
        return None
    index, r = _pick_regret(scores, gains)
    rho = spearman(scores, gains, n_permutations=1)[0] if np.ptp(scores) > 0 else 0.0
    return {"pick": task.positions[index], "regret": r, "relative_regret": relative(r), "spearman": float(rho)}


def policy_table(tasks: Sequence[TaskOracle], policies: Sequence[str] | None = None) -> list[dict]:
    """One row per policy: per task its pick, regret, relative regret and Spearman; the worst case and the means.

    Args:
        tasks: The committed oracle sweeps (`load_task`), at least one.
        policies: Names among `POLICIES` (default: every one that any task measured, in `POLICIES` order, plus the
            fixed rules and `random`).

    Returns:
        Rows with `policy`, `cost`, `tasks` (`{task: {"pick", "regret", "relative_regret", "spearman"}}`, measured tasks
        only), `measured` (how many tasks), `complete` (measured on every task), `worst_relative_regret` and
        `worst_task`, `worst_regret` (nats, largest over the tasks) and its task, `mean_relative_regret`,
        `mean_spearman`, `min_spearman`; sorted by `choose_default`'s order (incomplete rows last).
    """
    if not tasks:
        raise ValueError("policy_table needs at least one task")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be distinct, got {names}")
    if policies is None:
        seen = {n for t in tasks for n in t.scores} | set(_FIXED) | {"random"}
        policies = [p for p in POLICIES if p in seen]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown placement policies {unknown}; known: {', '.join(POLICIES)}")
    rows = []
    for policy in policies:
        per_task = {t.name: row for t in tasks if (row := _on_task(policy, t)) is not None}
        if not per_task:
            continue
        relative = {n: r["relative_regret"] for n, r in per_task.items()}
        nats = {n: r["regret"] for n, r in per_task.items()}
        rhos = [r["spearman"] for r in per_task.values()]
        worst = max(relative, key=relative.get)
        worst_nats = max(nats, key=nats.get)
        rows.append({
            "policy": policy, "cost": POLICIES[policy], "tasks": per_task, "measured": len(per_task), "complete": len(per_task) == len(tasks),
            "worst_relative_regret": relative[worst], "worst_task": worst, "worst_regret": nats[worst_nats], "worst_regret_task": worst_nats,
            "mean_relative_regret": float(np.mean(list(relative.values()))), "mean_spearman": float(np.mean(rhos)), "min_spearman": float(min(rhos)),
        })
    return sorted(rows, key=_order)


def _order(row: dict) -> tuple:
    # Worst case first; equal worst cases (to rounding) by the mean, then Spearman, then cost (the POLICIES order).
    return (not row["complete"], round(row["worst_relative_regret"] / _TIE), round(row["mean_relative_regret"] / _TIE),
            -row["mean_spearman"], list(POLICIES).index(row["policy"]))


def choose_default(rows: Sequence[dict]) -> dict:
    """The row with the smallest worst-case relative regret among policies measured on every task (ties: smaller mean
    relative regret, higher mean Spearman, then the `POLICIES` order)."""
    complete = [r for r in rows if r["complete"]]
    if not complete:
        raise ValueError("no policy was measured on every task: nothing to choose a default from")
    return min(complete, key=_order)


def track_record(tasks: Sequence[TaskOracle]) -> dict:
    """`{"tasks": [...], "task_gains": {task: best and worst position and gain, range}, "policies": policy_table(tasks),
    "default": choose_default(...)["policy"], "rule": str}`; each row
    also says whether it `could_win` (measured on fewer tasks, with a measured worst case below the default's)."""
    rows = policy_table(tasks)
    default = choose_default(rows)
    for row in rows:
        row["could_win"] = could_win(row, default)  # not measured everywhere, and its measured worst case is below the default's
    ranges = {t.name: {"positions": t.positions, "best_position": t.positions[int(np.argmax(t.realized))], "best_gain": max(t.realized),
                       "worst_position": t.positions[int(np.argmin(t.realized))], "worst_gain": min(t.realized),
                       "range": max(t.realized) - min(t.realized)} for t in tasks}
    return {"tasks": [t.name for t in tasks], "task_gains": ranges, "policies": rows, "default": default["policy"],
            "rule": "smallest worst-case relative regret (regret / the task's best-minus-worst range) among policies measured on "
                    "every task; ties: smaller mean relative regret, higher mean Spearman, then cost"}


def could_win(row: dict, default: dict) -> bool:
    """Whether a policy not measured on every task could still become the default: its worst case over the tasks it was
    measured on is below the default's (a missing task can only raise a worst case)."""
    return not row["complete"] and _order({**row, "complete": True})[1:3] < _order(default)[1:3]


def track_record_markdown(record: dict) -> str:
    """The policy table of `track_record(...)`: per task the regret in nats (relative to the task's range) and the pick,
    the worst case, the mean Spearman and the cost; the default first, in bold."""
    tasks, rows = record["tasks"], record["policies"]
    default = next(r for r in rows if r["policy"] == record["default"])
    head = ["policy", *tasks, "worst (of range)", "worst (nats)", "mean (of range)", "mean Spearman", "costs beyond the probe"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = []
        for task in tasks:
            got = row["tasks"].get(task)
            pick = "" if got is None or got["pick"] is None else f", k = {got['pick']}"
            cells.append("not measured" if got is None else f"{got['regret']:.3g} ({got['relative_regret']:.2f}{pick})")
        name = f"**{row['policy']}**" if row is default else row["policy"]
        worst = f"{row['worst_relative_regret']:.2f} ({row['worst_task']})"
        if not row["complete"]:
            worst += f", {row['measured']} of {len(tasks)} tasks: " + ("could still win" if could_win(row, default) else "cannot win")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {worst} | {row['worst_regret']:.3g} ({row['worst_regret_task']}) | "
                     f"{row['mean_relative_regret']:.2f} | {row['mean_spearman']:.2f} | {row['cost']} |")
    return "\n".join(lines) + "\n"


def track_record_line(row: dict | None = None) -> str:
    """One sentence of a policy's track record for reports (default: `DEFAULT_TRACK_RECORD`).

    Example:
        ```python
        >>> track_record_line()[:21]
        'placement policy: z, '
        ```
    """
    row = DEFAULT_TRACK_RECORD if row is None else row
    return (f"placement policy: {row['policy']}, chosen for the smallest worst-case regret on "
            f"{row['measured']} committed oracle tasks: at worst {row['worst_relative_regret']:.2f} of a task's best-worst range "
            f"({row['worst_task']}), at worst {row['worst_regret']:.3g} nats ({row['worst_regret_task']}); mean Spearman "
            f"{row['mean_spearman']:.2f}; it costs {POLICIES[row['policy']]} (docs/decisions.md, 'Where to place a block')")
