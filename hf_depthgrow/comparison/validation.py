"""Probe validation: does a predictor's ranking of positions match the gains that training realizes there?

The oracle sweep trains one single-block growth arm per position (an even grid or every gap) and per
seed (the data order), all at one budget, and scores each on the same test examples. Per position the
realized gain is the seed-averaged paired test delta against the original; its interval is over
examples of the seed-averaged per-example differences, corrected across positions. Each predictor
(the probe's signal and z, per-layer gradient norm, block influence, depth, a short look-ahead, a seeded
random order) is then scored by `evaluation.decisions.predictor_table`: Spearman with a permutation
p-value, the same with depth partialled out, top-1/top-3 hit rates, and the regret of its pick.

The trials of every position and seed are one engine call (`config.engine`: `ray` runs them at once; the
serial engine gives the same numbers as one `compare_plans` per seed). With several budgets each position
trains once (warmup-stable-decay, scored at every budget). With `retention_data` each position's forgetting
(retention loss rise, seed-averaged, corrected upper bound) is reported, and every predictor is also scored on
the gain *within the forgetting budget* (`gain_within`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import numpy as np

from ..evaluation.decisions import predictor_table
from ..evaluation.formatting import format_value
from ..utils import json_safe
from .aggregate import _corrected
from .config import CompareConfig
from .result import write_outputs
from .sweep_report import mark, table

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
    budget: int | None = None
    forgetting: list[float] | None = None
    forgetting_high: list[float] | None = None
    max_forgetting: float | None = None
    within: list[float] | None = None
    within_table: list[dict] | None = None
    at_smaller_budgets: list["ProbeValidation"] = field(default_factory=list)

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
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(best_position=self.best_position, verdict_agreement=self.verdict_agreement(),
                   at_smaller_budgets=[v.to_dict() for v in self.at_smaller_budgets], across_budgets=self.across_budgets())
        return json_safe(out)

    def across_budgets(self) -> dict | None:
        """Does the ranking hold across budgets: per predictor its Spearman and regret at every budget (smallest first),
        on gain and within the forgetting budget; and the smallest budget's realized gains ranking the largest's."""
        views = [*self.at_smaller_budgets, self]
        if len(views) < 2:
            return None
        rows = []
        for name in [r["predictor"] for r in self.table]:
            row = {"predictor": name}
            for key, attr in (("gain", "table"), ("within", "within_table")):
                found = [next((r for r in (getattr(v, attr) or []) if r["predictor"] == name), None) for v in views]
                if all(found):
                    row[key] = {"spearman": [r["spearman"] for r in found], "regret": [r["regret"] for r in found]}
            rows.append(row)
        held = predictor_table({"smallest": views[0].realized}, self.realized, self.positions, n_permutations=2000, seed=self.seeds[0])[0]
        return {"budgets": [v.budget for v in views], "predictors": rows,
                "smallest_ranks_largest": {k: held[k] for k in ("spearman", "p_value", "regret")}}

    def to_markdown(self) -> str:
        lines = ["# Probe validation (oracle sweep)", "", *self._markdown_body()]
        for view in self.at_smaller_budgets:
            lines += ["", f"## At {view.budget} steps", "", *view._markdown_body()]
        across = self.across_budgets()
        if across:
            budgets = across["budgets"]
            header = ["predictor", *(f"Spearman at {b}" for b in budgets), *(f"regret at {b}" for b in budgets),
                      f"Spearman within at {format_value(budgets)}"]
            rows = []
            for row in across["predictors"]:
                gain, within = row.get("gain") or {}, row.get("within") or {}
                cells = [*gain.get("spearman", []), *gain.get("regret", [])] or [""]  # a predictor missing at a budget: one blank
                rows.append([row["predictor"], *cells, format_value(within.get("spearman", []))])
            lines += ["", f"## Does the ranking hold from {budgets[0]} to {budgets[-1]} steps?", "", *table(header, rows)]
            held = across["smallest_ranks_largest"]
            lines += ["", f"The realized gains at {budgets[0]} steps rank those at {budgets[-1]} at Spearman "
                      f"{format_value(held['spearman'])} (p {format_value(held['p_value'])}; regret of the smaller budget's "
                      f"best position {format_value(held['regret'])})."]
        return "\n".join(lines) + "\n"

    def _markdown_body(self) -> list[str]:
        level = 1 - self.intervals["delta"]
        at = f" at {self.budget} steps" if self.budget is not None else ""
        forgets = self.forgetting is not None
        lines = [
            f"One block at each of {len(self.positions)} positions{at}, {len(self.seeds)} seeds (data orders), learning "
            f"rate {format_value(self.learning_rate)}; realized gain = seed-averaged paired test delta vs the original "
            f"({level:.0%} {self.intervals['method']}-corrected across positions). Best realized position: "
            f"k = {self.best_position}.", "",
        ]
        rows = []
        for i, k in enumerate(self.positions):
            row = self.intervals["arms"][f"at:{k}"]
            rows.append([k, self.realized[i], f"[{format_value(row['low'])}, {format_value(row['high'])}]{mark(row)}",
                         *(self.realized_by_seed[s][i] for s in self.seeds)])
            if forgets:
                rows[-1] += [self.forgetting[i], self.forgetting_high[i], "" if self.within is None else self.within[i]]
        lines += table(["k", "realized delta", "interval", *(f"seed {s}" for s in self.seeds),
                        *(["forgetting", "its upper bound", "within budget"] if forgets else [])], rows)
        lines += ["", *table(["predictor", "Spearman (p)", "partial on depth (p)", "top-1 hit", "top-3 hit", "regret", "seconds"],
                             [[r["predictor"], _with_p(r["spearman"], r["p_value"]), _with_p(r["partial_spearman"], r["partial_p_value"]),
                               r["top1_hit"], r["top3_hit"], r["regret"], self.predictor_seconds.get(r["predictor"], 0.0)] for r in self.table])]
        if self.within is not None and not self.within_table:
            lines += ["", f"Within the forgetting budget ({format_value(self.max_forgetting)} nats) every position gives the same "
                      "gain (a position over it counts as the original kept, gain 0): no ranking to score."]
        if self.within_table:
            lines += ["", f"Within the forgetting budget ({format_value(self.max_forgetting)} nats; a position whose forgetting upper "
                      "bound exceeds it counts as the original kept, gain 0):", "",
                      *table(["predictor", "Spearman (p)", "top-1 hit", "regret"],
                             [[r["predictor"], _with_p(r["spearman"], r["p_value"]), r["top1_hit"], r["regret"]] for r in self.within_table])]
        agreement = self.verdict_agreement()
        if agreement:
            lines += ["", f"The probe's \"improvable\" verdict agreed with a certified realized gain at {agreement['agree']} of "
                      f"{agreement['positions']} positions (probe said improvable at {agreement['probe_improvable']}, "
                      f"certified gains at {agreement['certified_gain']})."]
        return lines

    def save(self, folder) -> dict[str, str]:
        """Write `probe_validation.json`, `.md` and `.png` into `folder` (atomically); returns their paths."""
        from ..plots import plot_validation

        return write_outputs(folder, "probe_validation", self, plot_validation)


def _with_p(value, p_value) -> str:
    return f"{format_value(value)} ({format_value(p_value)})"


def _predictor_scores(model, train_data, eval_data, positions, probe_result, predictors, batch_size, seed, lookahead_steps,
                      retention_data=None):
    from ..probe.baselines import predictor_scores

    kwargs = {"batch_size": batch_size}
    if "lookahead" in predictors:
        kwargs.update(steps=lookahead_steps, seed=seed)
    if "adept" in predictors:
        kwargs["retention_data"] = retention_data
    out = predictor_scores(model, train_data, positions, eval_data=eval_data, probe_result=probe_result, which=tuple(predictors), **kwargs)
    scores, seconds = dict(out["scores"]), dict(out["seconds"])
    rng = np.random.default_rng(seed)
    scores["random"], seconds["random"] = rng.permutation(len(positions)).astype(float).tolist(), 0.0
    scores["bottom"], seconds["bottom"] = [-float(k) for k in positions], 0.0
    return scores, seconds


def _forgetting(trials, original: dict, names: list[str], budget: int, cfg) -> tuple[list[float], list[float]] | None:
    """Per position the seed-averaged retention loss rise (mean over examples) and its corrected upper bound."""
    if original.get("retention") is None:
        return None
    rise = {}
    for n in names:
        per_seed = [t.scores[budget].retention - original["retention"][0] for t in trials if t.spec.arm.name == n]
        rise[n] = np.mean(np.stack(per_seed), axis=0)
    bounds = _corrected({n: -r for n, r in rise.items()}, cfg)
    return [float(rise[n].mean()) for n in names], [float(-bounds["arms"][n]["low"]) for n in names]


def _view(results: dict, trials, original, names, positions, index: int, budget: int, cfg, scores, n_permutations) -> dict:
    """The fields of one budget's `ProbeValidation`: realized gains, intervals, forgetting, both predictor tables."""
    seeds = list(results)
    by_seed, diffs = {}, {}
    for seed, result in results.items():
        view = result.views[index]
        base = view.arm_result("original").test_per_example
        by_seed[seed] = [view.statistics["vs_original"]["arms"][n]["mean"] for n in names]
        for n in names:
            diffs.setdefault(n, []).append(base - view.arm_result(n).test_per_example)
    averaged = {n: np.mean(np.stack(d), axis=0) for n, d in diffs.items()}
    intervals = _corrected(averaged, cfg, seed=seeds[0])
    realized = [float(averaged[n].mean()) for n in names]
    out = {"budget": budget, "realized_by_seed": by_seed, "realized": realized, "intervals": intervals,
           "table": predictor_table(scores, realized, positions, n_permutations=n_permutations, seed=seeds[0])}
    forgetting = _forgetting(trials, original, names, budget, cfg)
    if forgetting is not None:
        out.update(forgetting=forgetting[0], forgetting_high=forgetting[1], max_forgetting=cfg.max_forgetting)
        if cfg.max_forgetting is not None:
            within = gain_within(realized, forgetting[1], cfg.max_forgetting)
            table = None  # every position equal (e.g. all over the budget): no ranking to score
            if np.ptp(within) > 0:
                table = predictor_table(scores, within, positions, n_permutations=n_permutations, seed=seeds[0])
            out.update(within=within, within_table=table)
    return out


def _checked(positions, seeds, predictors, retention_data) -> tuple[list[int], list[int]]:
    """`validate_probe`'s arguments checked before anything runs."""
    positions = [int(k) for k in positions]
    if len(positions) < 4 or len(set(positions)) != len(positions):
        raise ValueError(f"the oracle sweep needs at least 4 distinct positions, got {positions}")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")
    if "adept" in predictors and retention_data is None:
        raise ValueError("the 'adept' predictor scores layer removal on a retention set: pass retention_data")
    return positions, seeds


def gain_within(realized: Sequence[float], forgetting_high: Sequence[float], max_forgetting: float) -> list[float]:
    """Each position's gain within the forgetting budget: its gain where the forgetting upper bound is <= the budget, else
    0 (the original kept, as `frontier.best_within` decides for a comparison's arms).

    Example:
        ```python
        >>> gain_within([0.3, 0.5, -0.1], [0.01, 0.2, 0.0], 0.05)
        [0.3, 0.0, -0.1]
        ```
    """
    return [float(g) if h <= max_forgetting else 0.0 for g, h in zip(realized, forgetting_high)]


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
    retention_data=None,
    trials_dir=None,
) -> ProbeValidation:
    """Oracle sweep over `positions` x `seeds` (at each of the config's budgets), and every predictor's ranking scored against it.

    Args:
        model: The base model (not changed).
        train_data, eval_data, test_data: as for `compare_plans` (the look-ahead predictor scores on `eval_data`).
        positions: Candidate insertion points (at least 4; an even grid or every gap).
        seeds: Data orders; realized gains are averaged over them.
        learning_rate: The rate of every oracle arm (default: the largest of the config's growth grid).
        config: Budgets, engine and statistics (`CompareConfig`; its `growth`/`controls` are ignored here). With
            several budgets the result is the largest's, the others in `at_smaller_budgets`.
        probe_result: A `ProbeResult` covering `positions` (else the probe runs on `train_data`).
        predictors: Names `hf_depthgrow.probe.baselines.predictor_scores` knows (`adept` needs `retention_data`);
            `random` and `bottom` are added.
        lookahead_steps: Optimizer steps of the look-ahead predictor per position.
        retention_data: A general-domain set (as for `compare_plans`): per-position forgetting, and the predictors
            scored on the gain within `config.max_forgetting`.
        trials_dir: Where each oracle trial is stored (`comparison.store`): a rerun trains only what is missing.

    Example:
        ```python
        >>> v = validate_probe(model, train_rows, heldout_rows, test_rows, positions=[0, 2, 4, 6], seeds=[0, 1])
        >>> v.table[0]["predictor"], v.best_position
        ('signal', 4)
        ```
    """
    from ..training.data_order import training_rows
    from .runner import fresh_data_check, oracle_trials
    from .store import check_trials_dir

    positions, seeds = _checked(positions, seeds, predictors, retention_data)
    check_trials_dir(trials_dir, inputs={"model": getattr(model, "name_or_path", None)})
    cfg = config or CompareConfig()
    fresh_data_check(cfg, len(training_rows(train_data, "train_data")))  # before the probe: short data costs nothing
    lr = float(learning_rate if learning_rate is not None else max(cfg.grid("growth")))
    names = [f"at:{k}" for k in positions]
    cfgs = {seed: replace(cfg, growth=names, controls=[], reference=None, learning_rates=[lr], seed=seed) for seed in seeds}
    started = time.perf_counter()
    if probe_result is None and any(p in ("signal", "z") for p in predictors):
        from ..probe.signal import probe

        probe_result = probe(model, train_data, positions=positions, batch_size=cfg.batch_size, progress=cfg.progress)
    probe_seconds = time.perf_counter() - started
    data = {"train": train_data, "eval": eval_data, "test": test_data, "retention": retention_data}
    results, trials, original = oracle_trials(model, data, names, cfgs, probe_result, trials_dir)
    sweep_seconds = time.perf_counter() - started - probe_seconds
    scores, seconds = _predictor_scores(model, train_data, eval_data, positions, probe_result, predictors, cfg.batch_size, seeds[0],
                                        lookahead_steps, retention_data)
    verdicts = None
    if probe_result is not None:
        seconds.update({k: probe_seconds for k in ("signal", "z") if k in seconds})
        lookup = dict(zip(probe_result.positions, probe_result.verdict))
        verdicts = [lookup.get(k, "") for k in positions]
    budgets = list(cfgs[seeds[0]].sweep)
    views = [
        ProbeValidation(positions=positions, seeds=seeds, learning_rate=lr, scores=scores, predictor_seconds=seconds, probe_verdicts=verdicts,
                        **_view(results, trials, original, names, positions, i, b, cfg, scores, n_permutations))
        for i, b in enumerate(budgets)
    ]
    final = views[-1]
    final.at_smaller_budgets = views[:-1]
    final.seconds = {"total": time.perf_counter() - started, "oracle_sweep": sweep_seconds, "probe": probe_seconds}
    return final
