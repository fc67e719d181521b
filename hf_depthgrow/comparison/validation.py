"""Probe validation: does a predictor's ranking of positions match the gains that training realizes there?

The oracle sweep trains one single-block growth arm per position (an even grid or every gap) and per
seed (the data order), all at one budget, and scores each on the same test examples. Per position the
realized gain is the seed-averaged paired test delta against the original; its interval is over
examples of the seed-averaged per-example differences, corrected across positions. Each predictor
(the probe's signal and z, per-layer gradient norm, block influence, depth, a short look-ahead, a seeded
random order) is then scored by `evaluation.decisions.predictor_table`: Spearman with a permutation
p-value, the same with depth partialled out, top-1/top-3 hit rates, and the regret of its pick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..evaluation.decisions import corrected_intervals, predictor_table
from ..evaluation.formatting import format_value
from ..utils import json_safe
from .config import CompareConfig
from .result import write_outputs

DEFAULT_PREDICTORS = ("signal", "z", "gradient_norm", "block_influence", "depth", "lookahead")


@dataclass
class ProbeValidation:
    """What `validate_probe` measured; `save(folder)` writes `probe_validation.json/.md/.png`."""

    positions: list[int]
    seeds: list[int]
    learning_rate: float
    realized_by_seed: dict[int, list[float]]
    realized: list[float]
    intervals: dict
    scores: dict[str, list[float]]
    predictor_seconds: dict[str, float]
    table: list[dict]
    probe_verdicts: list[str] | None = None
    seconds: dict = field(default_factory=dict)

    @property
    def best_position(self) -> int:
        return self.positions[int(np.argmax(self.realized))]

    def verdict_agreement(self) -> dict | None:
        """How often the probe's "improvable" verdict agrees with a certified realized gain, per position."""
        if not self.probe_verdicts:
            return None
        certified = [self.intervals["arms"][f"at:{k}"]["certified"] for k in self.positions]
        said = [v == "improvable" for v in self.probe_verdicts]
        agree = sum(a == b for a, b in zip(said, certified))
        return {"agree": agree, "positions": len(self.positions), "probe_improvable": sum(said), "certified_gain": sum(certified)}

    def to_dict(self) -> dict:
        return json_safe({
            "positions": self.positions, "seeds": self.seeds, "learning_rate": self.learning_rate,
            "realized_by_seed": {str(s): v for s, v in self.realized_by_seed.items()}, "realized": self.realized,
            "best_position": self.best_position, "intervals": self.intervals, "scores": self.scores,
            "predictor_seconds": self.predictor_seconds, "table": self.table, "probe_verdicts": self.probe_verdicts,
            "verdict_agreement": self.verdict_agreement(), "seconds": self.seconds,
        })

    def to_markdown(self) -> str:
        level = 1 - self.intervals["delta"]
        lines = [
            "# Probe validation (oracle sweep)", "",
            f"One block at each of {len(self.positions)} positions, {len(self.seeds)} seeds (data orders), learning "
            f"rate {format_value(self.learning_rate)}; realized gain = seed-averaged paired test delta vs the original "
            f"({level:.0%} {self.intervals['method']}-corrected across positions). Best realized position: "
            f"k = {self.best_position}.", "",
            "| k | realized delta | interval | " + " | ".join(self.seeds_header()) + " |",
            "|---|---|---|" + "---|" * len(self.seeds),
        ]
        for i, k in enumerate(self.positions):
            row = self.intervals["arms"][f"at:{k}"]
            per_seed = " | ".join(format_value(self.realized_by_seed[s][i]) for s in self.seeds)
            mark = " +" if row["certified"] else " -" if row["worse"] else ""
            lines.append(f"| {k} | {format_value(self.realized[i])} | [{format_value(row['low'])}, {format_value(row['high'])}]{mark} | {per_seed} |")
        lines += ["", "| predictor | Spearman (p) | partial on depth (p) | top-1 hit | top-3 hit | regret | seconds |",
                  "|---|---|---|---|---|---|---|"]
        for row in self.table:
            lines.append(
                f"| {row['predictor']} | {format_value(row['spearman'])} ({format_value(row['p_value'])}) | "
                f"{format_value(row['partial_spearman'])} ({format_value(row['partial_p_value'])}) | "
                f"{format_value(row['top1_hit'])} | {format_value(row['top3_hit'])} | {format_value(row['regret'])} | "
                f"{format_value(self.predictor_seconds.get(row['predictor'], 0.0))} |"
            )
        agreement = self.verdict_agreement()
        if agreement:
            lines += ["", f"The probe's \"improvable\" verdict agreed with a certified realized gain at {agreement['agree']} of "
                      f"{agreement['positions']} positions (probe said improvable at {agreement['probe_improvable']}, "
                      f"certified gains at {agreement['certified_gain']})."]
        return "\n".join(lines) + "\n"

    def seeds_header(self) -> list[str]:
        return [f"seed {s}" for s in self.seeds]

    def save(self, folder) -> dict[str, str]:
        """Write `probe_validation.json`, `.md` and `.png` into `folder` (atomically); returns their paths."""
        from ..plots import plot_validation

        return write_outputs(folder, "probe_validation", self, plot_validation)


def _predictor_scores(model, train_data, eval_data, positions, probe_result, predictors, batch_size, seed, lookahead_steps):
    from ..probe.baselines import predictor_scores

    kwargs = {"batch_size": batch_size}
    if "lookahead" in predictors:
        kwargs.update(steps=lookahead_steps, seed=seed)
    out = predictor_scores(model, train_data, positions, eval_data=eval_data, probe_result=probe_result, which=tuple(predictors), **kwargs)
    scores, seconds = dict(out["scores"]), dict(out["seconds"])
    rng = np.random.default_rng(seed)
    scores["random"], seconds["random"] = rng.permutation(len(positions)).astype(float).tolist(), 0.0
    scores["bottom"], seconds["bottom"] = [-float(k) for k in positions], 0.0
    return scores, seconds


def validate_probe(
    model,
    train_data,
    eval_data,
    test_data,
    *,
    positions: Sequence[int],
    seeds: Sequence[int] = (0, 1, 2),
    learning_rate: float | None = None,
    config: CompareConfig | None = None,
    probe_result=None,
    predictors: Sequence[str] = DEFAULT_PREDICTORS,
    lookahead_steps: int = 4,
    n_permutations: int = 10000,
) -> ProbeValidation:
    """Oracle sweep over `positions` x `seeds` at one budget, and every predictor's ranking scored against it.

    Args:
        model: The base model (not changed).
        train_data, eval_data, test_data: as for `compare_plans` (the look-ahead predictor scores on `eval_data`).
        positions: Candidate insertion points (at least 4; an even grid or every gap).
        seeds: Data orders; realized gains are averaged over them.
        learning_rate: The rate of every oracle arm (default: the largest of the config's growth grid).
        config: Budget and statistics (`CompareConfig`; its `growth`/`controls` are ignored here).
        probe_result: A `ProbeResult` covering `positions` (else the probe runs on `train_data`).
        predictors: Names `hf_depthgrow.probe.baselines.predictor_scores` knows; `random` and `bottom` are added.
        lookahead_steps: Optimizer steps of the look-ahead predictor per position.

    Example:
        ```python
        >>> v = validate_probe(model, train_rows, heldout_rows, test_rows, positions=[0, 2, 4, 6], seeds=[0, 1])
        >>> v.table[0]["predictor"], v.best_position
        ('signal', 4)
        ```
    """
    from dataclasses import replace

    from .runner import compare_plans

    positions = [int(k) for k in positions]
    if len(positions) < 4 or len(set(positions)) != len(positions):
        raise ValueError(f"the oracle sweep needs at least 4 distinct positions, got {positions}")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")
    cfg = config or CompareConfig()
    lr = float(learning_rate if learning_rate is not None else max(cfg.grid("growth")))
    started = time.perf_counter()
    if probe_result is None and any(p in ("signal", "z") for p in predictors):
        from ..probe.signal import probe

        probe_result = probe(model, train_data, positions=positions, batch_size=cfg.batch_size, progress=cfg.progress)
    probe_seconds = time.perf_counter() - started
    names = [f"at:{k}" for k in positions]
    by_seed, diffs = {}, {}
    for seed in seeds:
        run_cfg = replace(cfg, growth=names, controls=[], reference=None, learning_rates=[lr], seed=seed)
        result = compare_plans(model, train_data, eval_data, test_data, config=run_cfg)
        base = result.arm("original").test_per_example
        by_seed[seed] = [result.statistics["vs_original"]["arms"][n]["mean"] for n in names]
        for n in names:
            diffs.setdefault(n, []).append(base - result.arm(n).test_per_example)
    sweep_seconds = time.perf_counter() - started - probe_seconds
    averaged = {n: np.mean(np.stack(d), axis=0) for n, d in diffs.items()}
    intervals = corrected_intervals(averaged, delta=cfg.delta, method=cfg.method, kind=cfg.interval,
                                    loss_bound=cfg.loss_bound, n_bootstrap=cfg.n_bootstrap, seed=seeds[0])  # fmt: skip
    realized = [float(averaged[n].mean()) for n in names]
    scores, seconds = _predictor_scores(model, train_data, eval_data, positions, probe_result, predictors, cfg.batch_size, seeds[0], lookahead_steps)
    if probe_result is not None:
        seconds.update({k: probe_seconds for k in ("signal", "z") if k in seconds})
    table = predictor_table(scores, realized, positions, n_permutations=n_permutations, seed=seeds[0])
    verdicts = None
    if probe_result is not None:
        lookup = dict(zip(probe_result.positions, probe_result.verdict))
        verdicts = [lookup.get(k, "") for k in positions]
    return ProbeValidation(
        positions=positions, seeds=seeds, learning_rate=lr, realized_by_seed=by_seed, realized=realized,
        intervals=intervals, scores=scores, predictor_seconds=seconds, table=table, probe_verdicts=verdicts,
        seconds={"total": time.perf_counter() - started, "oracle_sweep": sweep_seconds, "probe": probe_seconds},
    )  # fmt: skip
