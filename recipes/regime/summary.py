"""The regime study's summary: per seed the verdicts, the per-budget frontier, the crossover and its validation; per
budget and arm the seeds' gains and forgetting with their spread; the look-ahead's pick and the oracle sweep."""

from __future__ import annotations


def _interval(row: dict | None) -> str:
    return f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]" if row else ""


def summarize(results: dict, base: dict, figures: dict, lookahead: dict | None = None, oracle: dict | None = None) -> dict:
    """Per seed the verdicts, the per-budget frontier, the crossover and its validation; per budget and arm the seeds'
    gains and forgetting with their intervals and spread (max - min of the seeds' means)."""
    seeds = {s: r.sweep_dict()["budgets"] for s, r in results.items()}  # each budget's rows, JSON-ready
    per_seed = {}
    for s, r in results.items():
        curves = r.curves or {}
        per_seed[s] = {"verdict": r.verdict, "budgets": [{"steps": v["steps"], "tokens": v["tokens"], "frontier": v["frontier"],
                       "best_within": (v["frontier_detail"] or {}).get("best_within"), "verdict": v["verdict"]} for v in seeds[s]],
                       "crossover": curves.get("crossover_text"), "within_forgetting": curves.get("within_text"),
                       "validation": curves.get("validation_text"), "best_control": r.statistics.get("best_control"),
                       "best_growth": r.statistics.get("best_growth"), "half": half_check(r)}
    first = next(iter(seeds.values()))
    table = []
    for i, view in enumerate(first):
        for arm, row in view["arms"].items():
            if row["kind"] == "original":
                continue
            rows = {s: seeds[s][i]["arms"][arm] for s in seeds}
            gains = [r["gain"]["mean"] for r in rows.values()]
            forget = [r["forgetting"]["mean"] for r in rows.values() if r["forgetting"]]
            table.append({"steps": view["steps"], "arm": arm, "kind": row["kind"], "tokens_per_parameter": row["tokens_per_parameter"],
                          "gain": {s: r["gain"] for s, r in rows.items()}, "gain_spread": max(gains) - min(gains),
                          "forgetting": {s: r["forgetting"] for s, r in rows.items()},
                          "forgetting_spread": (max(forget) - min(forget)) if forget else None,
                          "on_frontier": [s for s in seeds if arm in (seeds[s][i]["frontier"] or [])]})
    return {"seeds": list(results), "base": {k: v for k, v in base.items() if k != "curve"}, "base_curve": base.get("curve"),
            "regime": figures, "per_seed": per_seed, "table": table, "lookahead": lookahead, "oracle": oracle}


def half_check(result, n_bootstrap: int = 500, seed: int = 0) -> dict | None:
    """The crossover predicted from the smaller half of the budgets, against what the larger half measured.

    The best growth arm and the best control are those the comparison chose on held-out at the largest budget of the
    smaller half; their curves are fitted there (`predict_crossover`), and at every budget of the larger half the
    measured test-loss lead of growth over that control (paired over test examples, percentile bootstrap) says
    whether the crossover happened where the fit said it would."""
    import numpy as np

    from hf_depthgrow.comparison import predict_crossover

    views = result.views
    if len(views) < 6:
        return None  # 3 budgets to fit, 3 to check
    small, large = views[: len(views) // 2], views[len(views) // 2 :]
    pick = small[-1].statistics
    g, c = pick.get("best_growth"), pick.get("best_control")
    if g is None or c is None:
        return None
    trained = [a for a in small[-1].arms if a.kind != "original"]
    growth, controls = [a.name for a in trained if a.kind == "growth"], [a.name for a in trained if a.kind != "growth"]
    losses = {a.name: [v.arm_result(a.name).test_per_example for v in small] for a in trained}
    last = small[-1]
    fresh = last.units_seen / last.epochs if last.epochs else None  # one pass over the training data, in tokens
    cross = predict_crossover([v.units_seen for v in small], losses, growth=growth, controls=controls, best_growth=g, best_control=c,
                              n_bootstrap=n_bootstrap, seed=seed, fresh_tokens=fresh)["on_gain"]
    rng, measured = np.random.default_rng(seed), []
    for v in large:
        lead = v.arm_result(c).test_per_example - v.arm_result(g).test_per_example  # > 0: growth's test loss is lower
        draws = [lead[rng.integers(0, len(lead), len(lead))].mean() for _ in range(n_bootstrap)]
        measured.append({"steps": v.steps, "tokens": v.units_seen, "lead": float(lead.mean()),
                         "interval": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]})
    ahead = [m["tokens"] for m in measured if m["interval"][0] > 0]
    return {"growth": g, "control": c, "fit_steps": [v.steps for v in small], "predicted": cross.get("text"),
            "predicted_tokens": cross.get("tokens"), "predicted_interval": cross.get("interval"), "measured": measured,
            "measured_crossover_tokens": ahead[0] if ahead else None}


def _half_lines(s, half: dict | None) -> list[str]:
    if not half:
        return []
    at = "; ".join(f"{m['steps']} steps {m['lead']:+.4f} [{m['interval'][0]:+.4f}, {m['interval'][1]:+.4f}]" for m in half["measured"])
    seen = (f"growth certainly ahead from {half['measured_crossover_tokens']:,} tokens on" if half["measured_crossover_tokens"]
            else "growth not certainly ahead at any of them")
    return [f"- seed {s}, fitted on {half['fit_steps']} steps only ({half['growth']} against {half['control']}, chosen on held-out at "
            f"{half['fit_steps'][-1]} steps): {half['predicted']}. Measured lead of growth (control's test loss minus growth's, "
            f"95% bootstrap) at the larger half: {at}: {seen}."]


def summary_markdown(summary: dict) -> str:
    base, fig, seeds = summary["base"], summary["regime"], summary["seeds"]
    lines = ["# Regime study: a plateaued base continued on Shakespeare", "",
             f"- Base: {base.get('steps')} steps, {base.get('tokens', 0):,} tokens, {base.get('seconds', 0):.0f} s wall"
             + (f", {base['cpu_seconds']:.0f} s CPU" if base.get("cpu_seconds") is not None else "") + ". "
             f"{base['plateau']['text']}.",
             f"- One-block growth arm: {fig['block_parameters']:,} trainable parameters; tokens per trainable parameter at the "
             f"budgets: {', '.join(f'{x:.1f}' for x in fig['tokens_per_parameter'])} (budgets span {fig['span']:g}x).",
             f"- Seeds (data order): {seeds}.", "", "## Verdicts", ""]
    lines += [f"- seed {s}: {p['verdict']}." for s, p in summary["per_seed"].items()]
    head = " | ".join(f"gain s{s}" for s in seeds) + " | gain spread | " + " | ".join(f"forgetting s{s}" for s in seeds)
    lines += ["", "## Per budget, every seed", "", "gain = paired test delta vs the original (nats, positive = better), forgetting = "
              "retention loss rise (positive = forgot), each with its corrected interval; spread = max - min of the seeds' means; "
              "F = on the gain x forgetting frontier in these seeds.", "",
              f"| steps | arm | tok/param | {head} | forgetting spread | F |", "|---" * (6 + 2 * len(seeds)) + "|"]
    for row in summary["table"]:
        gains = " | ".join(_interval(row["gain"][s]) for s in seeds)
        forget = " | ".join(_interval(row["forgetting"][s]) for s in seeds)
        spread = "" if row["forgetting_spread"] is None else f"{row['forgetting_spread']:.4f}"
        tpp = "" if row["tokens_per_parameter"] is None else f"{row['tokens_per_parameter']:.1f}"
        lines.append(f"| {row['steps']} | {row['arm']} | {tpp} | {gains} | {row['gain_spread']:.4f} | {forget} | {spread} | "
                     f"{','.join(str(s) for s in row['on_frontier'])} |")
    lines += ["", "## Frontier per budget", ""]
    for s, p in summary["per_seed"].items():
        lines += [f"- seed {s}, {b['steps']} steps: frontier {b['frontier']}; within the forgetting budget: {b['best_within']}."
                  for b in p["budgets"]]
    lines += ["", "## Crossover and its validation", ""]
    for s, p in summary["per_seed"].items():
        lines += [f"- seed {s}: {text}" for text in (p["crossover"], p["within_forgetting"], p["validation"]) if text]
    lines += ["", "### From the smaller half of the budgets to the larger", ""]
    for s, p in summary["per_seed"].items():
        lines += _half_lines(s, p.get("half"))
    lines += _lookahead_lines(summary.get("lookahead")) + _oracle_lines(summary.get("oracle"))
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return "" if x is None or x != x else f"{x:+.4f}"


def _lookahead_lines(pick: dict | None) -> list[str]:
    if not pick:
        return []
    from .study import lookahead_text

    return ["", "## The look-ahead's pick", "", f"- {lookahead_text(pick)}."]


def _oracle_lines(oracle: dict | None) -> list[str]:
    """Per oracle budget the positions' gains and forgetting, the predictors on gain and within the forgetting budget."""
    if not oracle:
        return []
    lines = ["", "## Oracle sweep over positions", "",
             f"One block at each of the positions {oracle['positions']}, seeds {oracle['seeds']}, learning rate {oracle['learning_rate']:g}; "
             f"gain = seed-averaged paired test delta (nats); forgetting = retention loss rise and its corrected upper bound; "
             f"within = the gain where that bound is <= {oracle['max_forgetting']} nats, else 0 (the original kept)."]
    for view in oracle["budgets"]:
        lines += ["", f"### {view['budget']} steps", "", "| k | gain | forgetting | its upper bound | within |", "|---|---|---|---|---|"]
        for i, k in enumerate(oracle["positions"]):
            forget = view["forgetting"] or [None] * len(oracle["positions"])
            high = view["forgetting_high"] or forget
            within = view["within"] or forget
            lines.append(f"| {k} | {_num(view['realized'][i])} | {_num(forget[i])} | {_num(high[i])} | {_num(within[i])} |")
        inside = {r["predictor"]: r for r in view["within_table"] or []}
        lines += ["", "| predictor | Spearman | regret | Spearman within | regret within |", "|---|---|---|---|---|"]
        for row in view["table"]:
            w = inside.get(row["predictor"], {})
            lines.append(f"| {row['predictor']} | {_num(row['spearman'])} | {_num(row['regret'])} | {_num(w.get('spearman'))} | "
                         f"{_num(w.get('regret'))} |")
    across = oracle.get("across_budgets")
    if across:
        held = across["smallest_ranks_largest"]
        lines += ["", f"The realized gains at {across['budgets'][0]} steps rank those at {across['budgets'][-1]} at Spearman "
                  f"{_num(held['spearman'])} (regret {_num(held['regret'])})."]
    return lines
