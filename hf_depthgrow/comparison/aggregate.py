"""One aggregation from trial results to a `CompareResult`: choices on held-out, statistics on test, per budget.

Reads only `TrialResult`s and the original's losses, so trials run in this process, on another engine, or
read back from storage all give the same result. Per budget and arm, the learning rate is the one with the
lowest held-out loss at that budget; the arm's row is that trial's score. Then, per budget: the corrected
paired intervals (`statistics`), and, over *every* trained point (arm x rate x budget x seed, growth and
controls alike), the frontier, the point within the forgetting budget and each growth point against the curve
of every control point (`frontier`); with several budgets the same once more over the points of every budget;
the epochs of the training data each budget took (`fresh_data`); across budgets: learning-curve fits and the
predicted crossover (`crossover`). Corrections are family-wise over the whole comparison (`statistics`,
`_frontiers`); where the examples name their documents, every bootstrap resamples documents (`aggregate`'s `documents`).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ..evaluation.checks import cluster_labels
from ..evaluation.decisions import corrected_intervals
from . import frontier as fr
from .arms import TRAINED_CONTROLS as CONTROLS
from .arms import matched_control
from .fresh_data import DataPlan
from .grids import best_rate, halving_survivor
from .result import ArmResult, BudgetView, CompareResult
from .sweep_report import negated
from .trial_record import HALVING_RUNGS, TrialResult


def rungs_of(budget: int) -> list[int]:
    """The steps where a run of `budget` steps records its held-out loss (and halving may stop a rate)."""
    return [r for r in (round(f * budget) for f in HALVING_RUNGS) if 0 < r < budget]


def retention_parts(n: int, fraction: float, seed: int, documents=None) -> tuple[np.ndarray, np.ndarray]:
    """`(selection, test)` indices of a retention set of `n` examples (seeded; both parts non-empty).

    With `documents` (one label per example) the parts are disjoint documents: whole documents are dealt to the
    selection part until it holds `fraction` of the examples (`data.group_parts`), so choosing on the selection
    part and claiming on the test part never read two blocks of one page.
    """
    if n < 2:
        raise ValueError(f"the retention set needs at least 2 examples (a selection part and a test part), got {n}")
    if documents is not None:
        from ..data import group_parts

        selection, test = group_parts(documents, [fraction, 1.0 - fraction], seed=seed + 7919)
        if len(selection) == 0 or len(test) == 0:
            raise ValueError(f"the retention set has {len(set(documents))} document(s): a selection part and a test part of "
                             "disjoint documents need at least 2 (set cluster_key none to split blocks)")
        return selection, test
    order = np.random.default_rng(seed + 7919).permutation(n)
    cut = min(max(1, round(fraction * n)), n - 1)
    return np.sort(order[:cut]), np.sort(order[cut:])


def _corrected(diffs: dict, cfg, delta: float | None = None, clusters=None, seed: int | None = None) -> dict | None:
    """`corrected_intervals` of `diffs` with `cfg`'s statistics (its `delta` and `seed` unless given); `None` without diffs."""
    if not diffs:
        return None
    return corrected_intervals(diffs, delta=cfg.delta if delta is None else delta, method=cfg.method, kind=cfg.interval,
                               loss_bound=cfg.loss_bound, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed if seed is None else seed,
                               clusters=clusters)


def _part(documents, index):
    """The document labels of a part (`index` into the set's examples); `None` without documents."""
    return None if documents is None else [documents[i] for i in index]


def statistics(results: list[ArmResult], original: ArmResult, cfg, family: int = 1, clusters: dict | None = None) -> dict:
    """Corrected paired intervals: every trained arm vs the original, growth vs the best control and its match, forgetting.

    `family`: the budgets x seeds the same tests repeat over; each block of intervals spends `cfg.delta / family`
    (Bonferroni across the family, Holm within a block), so the whole family errs with probability <= `cfg.delta`.
    `clusters`: the document of each `test` and `retention` (test part) example, where known: their bootstraps
    then resample documents.
    """
    clusters = clusters or {}
    test_docs, ret_docs = clusters.get("test"), clusters.get("retention")
    delta = cfg.delta / family
    trained = [r for r in results if r.kind != "original"]
    by_name = {r.name: r for r in trained}
    stats = {"family": {"delta": cfg.delta, "blocks": family, "delta_per_block": delta},
             "vs_original": _corrected({r.name: original.test_per_example - r.test_per_example for r in trained}, cfg, delta, test_docs)}
    controls = [r for r in trained if r.kind in CONTROLS]
    growth = [r for r in trained if r.kind == "growth"]
    best = min(controls, key=lambda r: r.heldout_loss) if controls else None
    stats["best_control"] = best.name if best else None
    stats["vs_best_control"] = _corrected({r.name: best.test_per_example - r.test_per_example for r in growth}, cfg, delta, test_docs) if best else None
    matches = {r.name: matched_control([a.arm for a in results], r.name) for r in growth}
    stats["matched"] = {g: m for g, m in matches.items() if m in by_name}
    stats["unmatched"] = [g for g in matches if g not in stats["matched"]]
    stats["vs_matched"] = _corrected({g: by_name[m].test_per_example - by_name[g].test_per_example for g, m in stats["matched"].items()},
                                     cfg, delta, test_docs)
    if original.retention_per_example is not None:
        stats["retention"] = _corrected({r.name: original.retention_per_example - r.retention_per_example for r in trained}, cfg, delta, ret_docs)
    # An arm whose fallback rule kept the original is the original, not growth: it is the best growth arm
    # only when every growth arm fell back (its held-out loss may still be a rounding below a real one's).
    kept = [r for r in growth if r.selected != "old"] or growth
    stats["best_growth"] = min(kept, key=lambda r: r.heldout_loss).name if kept else None
    return stats


def point_label(arm: str, lr: float, steps: int, seed: int | None = None) -> str:
    """A trained point's name: arm, rate and budget (and the seed where several are pooled), e.g. `full@lr1e-05@20steps`."""
    return f"{arm}@lr{lr:g}@{steps}steps" + (f"@seed{seed}" if seed is not None else "")


def trial_points(by_arm: dict, budget: int, parts, pooled: bool) -> tuple[list[ArmResult], dict]:
    """Every trial scored at `budget` as an `ArmResult` named by its point label, and each label's arm, kind, rate, seed."""
    points, info = [], {}
    for arm, trials in by_arm.values():
        for t in sorted(trials, key=lambda t: (t.spec.learning_rate, t.spec.seed)):
            score = t.scores.get(budget)
            if score is None:
                continue  # stopped by successive halving before this budget
            row = ArmResult.scored(arm, t.spec.learning_rate, score, {}, t.seconds, t.trainable_parameters, parts)
            row.name = point_label(arm.name, t.spec.learning_rate, budget, t.spec.seed if pooled else None)
            points.append(row)
            info[row.name] = {"arm": arm.name, "kind": arm.kind, "learning_rate": t.spec.learning_rate, "steps": budget, "seed": t.spec.seed}
    return points, info


def _arm_row(arm, trials: list[TrialResult], budget: int, parts) -> ArmResult:
    """The arm at `budget`: the trial whose held-out loss there is lowest (every rate tried listed in `tried`)."""
    scored = {t.spec.learning_rate: t for t in trials if budget in t.scores}
    lr = best_rate({r: t.scores[budget].heldout_loss for r, t in scored.items()})
    lr = lr if lr is not None else min(scored)
    tried = {}
    for t in trials:
        s = t.scores.get(budget)
        if s is not None:
            tried[t.spec.learning_rate] = {"heldout_loss": s.heldout_loss, "stopped_at": budget, "selected": s.selected}
        elif t.stopped_at is not None:
            tried[t.spec.learning_rate] = {"heldout_loss": t.heldout_at(t.stopped_at), "stopped_at": t.stopped_at}
    score = scored[lr].scores[budget]
    return ArmResult.scored(arm, lr, score, tried, sum(t.seconds for t in trials), scored[lr].trainable_parameters, parts)


def _halving_agreement(by_arm: dict, budgets: list[int]) -> dict:
    """Per arm kind: how often successive halving's survivor (replayed from the held-out curves) is the full grid's choice."""
    counts = defaultdict(lambda: {"agree": 0, "of": 0})
    for arm, trials in by_arm.values():
        full = [t for t in trials if t.stopped_at is None]
        if len(full) < 2 or len(full) != len(trials):
            continue  # halving ran for real, or a single rate: nothing to replay
        for b in budgets:
            final = {t.spec.learning_rate: t.scores[b].heldout_loss for t in full}
            rungs = [{t.spec.learning_rate: t.heldout_at(r) for t in full} for r in rungs_of(b)]
            if any(math.isnan(v) for rung in rungs for v in rung.values()):
                continue
            c = counts[arm.kind]
            c["of"] += 1
            c["agree"] += int(halving_survivor(rungs, final) == best_rate(final))
    return {k: {**v, "share": v["agree"] / v["of"]} for k, v in counts.items()}


def _point_table(points: list[ArmResult], info: dict, base: ArmResult, ret_sel_base: np.ndarray, high: dict) -> dict:
    """Per point: its arm, kind, rate, budget, seed, held-out gain and selection-part forgetting with its upper bound."""
    table = {}
    for p in points:
        table[p.name] = {**info[p.name], "gain": base.heldout_loss - p.heldout_loss,
                         "forgetting": float((p.retention_selection - ret_sel_base).mean()), "forgetting_high": high[p.name]}
    return table


def _choices(table: dict, cfg) -> dict:
    """The frontier, the best point on gain and the best within the forgetting budget: selection parts only."""
    points = {n: (r["gain"], r["forgetting"]) for n, r in table.items()} | {"original": (0.0, 0.0)}
    gain = {n: r["gain"] for n, r in table.items()}
    out = {"frontier": fr.pareto(points), "best_gain": max(gain, key=lambda n: gain[n])}
    if cfg.max_forgetting is not None:
        out["max_forgetting"] = cfg.max_forgetting
        out["best_within"] = fr.best_within(gain, {n: r["forgetting_high"] for n, r in table.items()}, cfg.max_forgetting)
        out["best_within_bound"] = table[out["best_within"]]["forgetting_high"] if out["best_within"] in table else None
    return out


def _curve(points: list[ArmResult], info: dict, base: ArmResult, cfg, tests: int, clusters: dict) -> dict | None:
    """Every growth point against the curve of every control point (test parts), `tests` in the Bonferroni family."""
    gain = {p.name: base.test_per_example - p.test_per_example for p in points}
    forget = {p.name: p.retention_per_example - base.retention_per_example for p in points}
    controls = [p.name for p in points if info[p.name]["kind"] in CONTROLS]
    growth = [p.name for p in points if info[p.name]["kind"] == "growth"]
    out = fr.off_curve(gain, forget, controls, growth, delta=cfg.delta, tests=tests, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed,
                       test_clusters=clusters.get("test"), retention_clusters=clusters.get("retention"))
    if out is not None:
        out["points"] = out.pop("arms")
    return out


def _frontier(view: BudgetView, points: list[ArmResult], info: dict, base: ArmResult, cfg, ret_sel_base, high: dict, tests: int,
              seed: int | None, clusters: dict) -> dict:
    """One budget over every point trained to it: the frontier, the choice within eps, each growth arm against the curve."""
    table = _point_table(points, info, base, ret_sel_base, high)
    out = _choices(table, cfg)
    chosen = {a.name: point_label(a.name, a.learning_rate, view.steps, seed) for a in view.arms if a.kind != "original"}
    out.update(points=table, chosen=chosen, selection={arm: table[label] for arm, label in chosen.items()})
    out["frontier_arms"] = [a for a, label in chosen.items() if label in out["frontier"]] + (["original"] if "original" in out["frontier"] else [])
    curve = _curve(points, info, base, cfg, tests, clusters)
    if curve is not None:  # each growth arm as trained (its rate chosen on held-out), read off the every-point curve
        curve["arms"] = {a: {**curve["points"][label], "point": label} for a, label in chosen.items() if label in curve["points"]}
    out["control_curve"] = curve
    return out


def _within_claims(frontiers: list[dict], points: dict[str, ArmResult], base: ArmResult, cfg, clusters: dict) -> None:
    """The test parts' gain and forgetting of each point chosen within the forgetting budget, corrected over the choices."""
    chosen = sorted({f["best_within"] for f in frontiers if f.get("best_within") not in (None, "original")})
    if not chosen:
        return
    gain = _corrected({n: base.test_per_example - points[n].test_per_example for n in chosen}, cfg, clusters=clusters.get("test"))
    kept = _corrected({n: base.retention_per_example - points[n].retention_per_example for n in chosen}, cfg, clusters=clusters.get("retention"))
    for f in frontiers:
        n = f.get("best_within")
        if n in chosen:
            g, k = gain["arms"][n], kept["arms"][n]
            f["best_within_test"] = {"gain": {x: g[x] for x in ("mean", "low", "high")},
                                     "forgetting": negated(k), "claims": len(chosen)}


def _frontiers(views: list[BudgetView], by_arm: dict, base: ArmResult, cfg, parts, ret_sel_base, seeds: set, clusters: dict) -> dict | None:
    """Every budget's frontier (set on its view) and, over several budgets, the sweep-wide one over every point (returned).

    One family throughout: the selection-part bounds are corrected over every point of every budget, the curve tests
    over every growth point of every budget (twice with several budgets: per budget and sweep-wide).
    """
    pooled = len(seeds) > 1
    per_budget = [trial_points(by_arm, v.steps, parts, pooled) for v in views]
    points = [p for ps, _ in per_budget for p in ps]
    info = {k: v for _, i in per_budget for k, v in i.items()}
    # forgetting's upper bound = -(low)
    bounds = _corrected({p.name: ret_sel_base - p.retention_selection for p in points}, cfg, clusters=clusters.get("retention_selection"))
    high = {n: -r["low"] for n, r in bounds["arms"].items()}
    growth = sum(1 for i in info.values() if i["kind"] == "growth")
    tests = max(1, growth * (2 if len(views) > 1 else 1))
    seed = cfg.seed if pooled else None
    for v, (ps, i) in zip(views, per_budget):
        v.frontier = _frontier(v, ps, i, base, cfg, ret_sel_base, high, tests, seed, clusters)
        v.frontier["family"] = {"points": len(points), "level": bounds["level"]}
    overall = None
    if len(views) > 1:
        overall = _choices(_point_table(points, info, base, ret_sel_base, high), cfg)
        overall.update(points=len(points), control_curve=_curve(points, info, base, cfg, tests, clusters), family={"points": len(points), "level": bounds["level"]})
    _within_claims([v.frontier for v in views] + ([overall] if overall else []), {p.name: p for p in points}, base, cfg, clusters)
    return overall


def aggregate(arms, trials: list[TrialResult], original: dict, cfg, *, grids: dict, extra: dict, documents: dict | None = None) -> CompareResult:
    """A `CompareResult` from every trial of a comparison (see the module docstring).

    Args:
        arms: The resolved arms, the original first.
        trials: Every trial's result (any order).
        original: The original's per-example test losses and weights (`test`), retention losses (`retention`),
            held-out loss (`heldout`).
        cfg: The `CompareConfig`.
        grids: Per arm, the rates tried and why the grid stopped growing.
        extra: `probe`, `seconds`, `num_examples` of the `CompareResult`.
        documents: The document of every example of each set (`train`, `heldout`, `test`, `retention`), `None` for
            a set that names none (see `comparison.runner.set_documents`): the retention parts are then disjoint
            documents, the bootstraps resample documents, and `data_parts` counts them.
    """
    budgets = cfg.sweep
    documents = documents or {}
    by_arm = {a.name: (a, [t for t in trials if t.spec.arm.name == a.name]) for a in arms if a.kind != "original"}
    seeds = {t.spec.seed for t in trials} or {cfg.seed}
    family = len(budgets) * len(seeds)  # the tests of one budget repeat at every budget (and seed)
    parts = None
    clusters = {"test": cluster_labels(documents.get("test"), cfg.cluster_key)}
    if original.get("retention") is not None:
        ret_docs = cluster_labels(documents.get("retention"), cfg.cluster_key)
        parts = retention_parts(len(original["retention"][0]), cfg.retention_selection_fraction, cfg.seed, ret_docs)
        clusters.update(retention_selection=_part(ret_docs, parts[0]), retention=_part(ret_docs, parts[1]))
    base = ArmResult.original(arms[0], original, parts)
    blocks = (extra.get("num_examples") or {}).get("train")
    plan = DataPlan(blocks, cfg.batch_size, tuple(budgets), cfg.allow_repeated_data) if blocks else None
    views = []
    for b in budgets:
        rows = [base] + [_arm_row(arm, ts, b, parts) for arm, ts in by_arm.values()]
        units = {r.units_seen for r in rows[1:]}
        if len(units) > 1:
            raise RuntimeError(f"the arms saw different amounts of data at {b} steps {sorted(units)}: the budget was not equal")
        views.append(BudgetView(steps=b, units_seen=units.pop() if units else 0, arms=rows, statistics=statistics(rows, base, cfg, family, clusters),
                                epochs=plan.epochs(b) if plan else None))
    overall = None
    if parts is not None:
        overall = _frontiers(views, by_arm, base, cfg, parts, original["retention"][0][parts[0]], seeds, clusters)
    result = CompareResult(arms=views[-1].arms, config=cfg.to_dict(), statistics=views[-1].statistics, views=views, grids=grids,
                           overall=overall, data_parts=data_parts(extra.get("num_examples") or {}, documents, parts, clusters), **extra)
    if not cfg.successive_halving:
        result.halving_agreement = _halving_agreement(by_arm, budgets)
    if len(views) >= 3:
        result.curves = learning_curves(views, original["test"][1], cfg)
    return result


def data_parts(num_examples: dict, documents: dict, parts, clusters: dict | None = None) -> dict:
    """Per part of the data (`train`, `heldout`, `test`, `retention_selection`, `retention_test`): its `blocks` (examples),
    `documents` (distinct documents; `None` where the set names none) and, for the parts intervals are computed on,
    `resampled`: `"documents"` (cluster bootstrap) or `"blocks"`.

    Example:
        ```python
        >>> data_parts({"train": 4, "test": 2}, {"train": [0, 0, 1, 1], "test": None}, None)
        {'train': {'blocks': 4, 'documents': 2}, 'test': {'blocks': 2, 'documents': None, 'resampled': 'blocks'}}
        ```
    """
    clusters = clusters or {}

    def resampled(name):
        return {"resampled": "documents" if clusters.get(name) is not None else "blocks"}

    out = {}
    for name in ("train", "heldout", "test"):
        docs = documents.get(name)
        if name in num_examples or docs is not None:
            out[name] = {"blocks": len(docs) if docs is not None else int(num_examples[name]),
                         "documents": len(set(docs)) if docs is not None else None,
                         **(resampled(name) if name == "test" else {})}
    if parts is not None:
        docs = documents.get("retention")
        for name, index, key in zip(("retention_selection", "retention_test"), parts, ("retention_selection", "retention")):
            out[name] = {"blocks": len(index), "documents": len(set(_part(docs, index))) if docs is not None else None,
                         **resampled(key)}
    return out


def learning_curves(views: list[BudgetView], weight: np.ndarray, cfg) -> dict | None:
    """Fits of test loss against tokens per arm, the predicted crossover (on gain, and within EPS) and its validation."""
    from .crossover import predict_crossover, validate_fit

    last = views[-1]
    # One pass over the training data, in the tokens a block held at the largest budget: where fresh data ends.
    fresh = last.units_seen / last.epochs if last.epochs and last.units_seen else None
    trained = [a for a in last.arms if a.kind != "original"]
    growth, controls = [a.name for a in trained if a.kind == "growth"], [a.name for a in trained if a.kind in CONTROLS]
    tokens = [v.units_seen for v in views]
    losses = {a.name: [v.arm_result(a.name).test_per_example for v in views] for a in trained}
    weights = {name: [weight] * len(views) for name in losses}
    boot = {"n_bootstrap": min(cfg.n_bootstrap, 500), "seed": cfg.seed}
    out = {"validation": validate_fit(tokens, losses, weights, **boot)}
    out["validation_text"] = out["validation"].get("summary") or f"fit validation skipped: {out['validation'].get('reason')}"
    if not growth or not controls:
        return out
    within = best_within = None
    if last.frontier and cfg.max_forgetting is not None:
        sel = last.frontier["selection"]
        within = [c for c in controls if sel[c]["forgetting_high"] <= cfg.max_forgetting]
        best_within = min(within, key=lambda c: last.arm_result(c).heldout_loss) if within else None
    cross = predict_crossover(tokens, losses, weights, growth=growth, controls=controls, best_growth=last.statistics["best_growth"],
                              best_control=last.statistics["best_control"], controls_within=within,
                              best_control_within=best_within, fresh_tokens=fresh, **boot)
    out.update(crossover=cross, crossover_text=cross["on_gain"]["text"])
    if cross.get("within_forgetting"):
        out["within_text"] = f"within forgetting {cfg.max_forgetting:g} nats: {cross['within_forgetting']['text']}"
    return out
