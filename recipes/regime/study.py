"""The regime study's continued training: Shakespeare in the base's vocabulary, the regime's figures (tokens per
trainable parameter), the look-ahead's pick as a growth arm, and the oracle sweep over positions at two budgets."""

from __future__ import annotations

import time
from pathlib import Path


def shakespeare_rows(cfg, tokenizer) -> tuple[list[dict], list[dict], list[dict]]:
    """`(train, held-out, test)` blocks of Shakespeare in the base's vocabulary (a seeded split of blocks)."""
    import numpy as np

    from hf_depthgrow.data import shakespeare_texts

    from .base import block_rows

    rows = block_rows(tokenizer, shakespeare_texts(max_chars=cfg.shakespeare_chars), cfg.block_size, None)
    need = cfg.heldout_blocks + cfg.test_blocks + cfg.batch_size
    if len(rows) < need:
        raise ValueError(f"Shakespeare gives {len(rows)} blocks of {cfg.block_size}; held-out + test + one batch need {need}")
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    held, test = order[:cfg.heldout_blocks], order[cfg.heldout_blocks:cfg.heldout_blocks + cfg.test_blocks]
    train = np.sort(order[cfg.heldout_blocks + cfg.test_blocks:])
    return [rows[i] for i in train], [rows[i] for i in held], [rows[i] for i in test]


def regime_figures(cfg, model) -> dict:
    """The one-block arm's trainable parameters (a copy of one layer) and tokens per parameter at each budget (and the oracle's)."""
    layer = model.model.layers[0]
    block = sum(p.numel() for p in layer.parameters())
    per = lambda budgets: [b * cfg.batch_size * cfg.block_size / block for b in budgets]  # noqa: E731
    tokens = [b * cfg.batch_size * cfg.block_size for b in cfg.budgets]
    return {"block_parameters": block, "tokens": tokens, "tokens_per_parameter": per(cfg.budgets), "span": cfg.budgets[-1] / cfg.budgets[0],
            "oracle_budgets": cfg.oracle_budgets, "oracle_tokens_per_parameter": per(cfg.oracle_budgets or [])}


def figures_text(cfg, figures: dict) -> str:
    """The printed line: tokens per trainable parameter of the one-block arm at every budget."""
    largest = figures["tokens_per_parameter"][-1]
    text = (f"tokens per trainable parameter of the one-block growth arm ({figures['block_parameters']:,} parameters): "
            + ", ".join(f"{b} steps: {x:.1f}" for b, x in zip(cfg.budgets, figures["tokens_per_parameter"]))
            + f"; the largest {'>=' if largest >= 100 else 'BELOW'} 100; budgets span {figures['span']:g}x")
    if cfg.oracle_budgets:
        text += "; oracle sweep at " + ", ".join(f"{b} steps ({x:.1f})" for b, x in zip(cfg.oracle_budgets, figures["oracle_tokens_per_parameter"]))
    return text


def base_probe(cfg, model, train_rows):
    """The probe of every position, run once and shared by `probe:N`, every seed's comparison and the oracle's z and signal
    (as `compare_plans` runs it: its batch size, 16 batches)."""
    from hf_depthgrow.probe import probe

    return probe(model, train_rows, batch_size=cfg.batch_size, max_batches=16, progress=False)


def lookahead_pick(cfg, model, train_rows, heldout_rows, probe_result) -> dict:
    """The look-ahead's scores at every position 0..L and its pick as the growth arm `at:k`; `same_as` names a growth arm
    of the config with the same placement (then it is not trained twice). The look-ahead is the oracle's: same steps,
    batch size, seed (the first of `seeds`) and data."""
    import numpy as np

    from hf_depthgrow.comparison import resolve_growth
    from hf_depthgrow.probe import lookahead_scores

    positions = list(range(cfg.num_layers + 1))
    cpu = time.process_time()
    scores = lookahead_scores(model, train_rows, positions, eval_data=heldout_rows, steps=cfg.lookahead_steps, batch_size=cfg.batch_size,
                              seed=cfg.seeds[0])
    pick = positions[int(np.argmax(scores))]
    key = lambda spec: [(e.at, e.source, e.init) for e in resolve_growth(spec, cfg.num_layers, probe_result=probe_result, seed=cfg.seed)]  # noqa: E731
    same = next((g for g in cfg.growth if key(g) == key(f"at:{pick}")), None)
    return {"positions": positions, "scores": [float(s) for s in scores], "pick": pick, "arm": f"at:{pick}", "same_as": same,
            "cpu_seconds": time.process_time() - cpu}


def lookahead_text(pick: dict) -> str:
    scores = ", ".join(f"k={k}: {s:+.4f}" for k, s in zip(pick["positions"], pick["scores"]))
    where = f"the same placement as {pick['same_as']}, not trained twice" if pick["same_as"] else f"growth arm {pick['arm']}"
    return f"look-ahead (held-out loss drop after a few steps of one new block): {scores}; pick k = {pick['pick']} ({where})"


def oracle_rate(cfg, result) -> float:
    """One rate for every oracle position: the one the grid chose (on held-out, never test) for the one-block arm
    (`reference`, else the best growth arm) at the largest budget, in the first seed's comparison."""
    arm = cfg.reference or result.statistics["best_growth"]
    return float(result.arm(arm).learning_rate)


def run_oracle(cfg, model, data: dict, probe_result, learning_rate: float, trials_dir: Path):
    """The oracle sweep (`validate_probe`): one block at each position, every seed, one run scored at both oracle budgets;
    the predictors ranked on gain and on gain within the forgetting budget. Its trials go to `trials_dir` (resume)."""
    from hf_depthgrow.comparison import validate_probe

    positions = cfg.oracle_positions if cfg.oracle_positions is not None else list(range(cfg.num_layers + 1))
    return validate_probe(model, data["train"], data["held"], data["test"], positions=positions, seeds=cfg.oracle_seeds or cfg.seeds, learning_rate=learning_rate,
                          config=cfg.oracle_config(), probe_result=probe_result, predictors=tuple(cfg.oracle_predictors),
                          lookahead_steps=cfg.lookahead_steps, retention_data=data["retention"], trials_dir=trials_dir)


def oracle_summary(validation) -> dict:
    """What the study reports of the oracle: per budget the realized gains, forgetting, within-budget gains and both
    predictor tables; and whether the rankings hold from the smaller budget to the larger."""
    views = [*validation.at_smaller_budgets, validation]
    keep = ("budget", "realized", "forgetting", "forgetting_high", "within", "table", "within_table")
    out = {"positions": validation.positions, "seeds": validation.seeds, "learning_rate": validation.learning_rate,
           "max_forgetting": validation.max_forgetting, "budgets": [{k: getattr(v, k) for k in keep} for v in views],
           "across_budgets": validation.across_budgets()}
    return out
