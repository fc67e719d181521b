"""The oracle sweep (`validate_probe`): every position x seed trial in one engine call with the per-seed
`compare_plans` numbers unchanged; two budgets in one run; per-position forgetting and the predictors scored on
the gain within the forgetting budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_depthgrow.comparison import compare_plans
from hf_depthgrow.comparison import engine as engine_module
from hf_depthgrow.comparison.config import CompareConfig
from hf_depthgrow.comparison.validation import gain_within, validate_probe
from hf_depthgrow.testing import tiny_model, tiny_rows

POSITIONS = [0, 1, 3, 4]
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: tiny_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 12, 2), ("ret", 10, 3))}
    cfg = CompareConfig(budgets=[2, 6], warmup_steps=1, batch_size=4, selection_max_examples=8, n_bootstrap=100, progress=False,
                        growth_learning_rates=[1e-2], max_forgetting=1e9)
    return model, rows, cfg


@pytest.fixture(scope="module")
def validation(setting):
    model, rows, cfg = setting
    calls = []
    real = engine_module.run_serial

    def counting(specs, inputs, **kw):
        calls.append(sorted({(s.arm.name, s.seed) for s in specs}))
        return real(specs, inputs, **kw)

    engine_module.run_serial = counting
    try:
        out = validate_probe(model, rows["train"], rows["eval"], rows["test"], positions=POSITIONS, seeds=SEEDS, config=cfg,
                             retention_data=rows["ret"], predictors=("z", "depth", "adept", "midas"), n_permutations=200)
    finally:
        engine_module.run_serial = real
    return out, calls


def test_one_engine_call_and_the_per_seed_numbers_unchanged(setting, validation):
    model, rows, cfg = setting
    out, calls = validation
    assert calls == [sorted((f"at:{k}", s) for k in POSITIONS for s in SEEDS)]  # every trial in one call: Ray runs them at once
    names = [f"at:{k}" for k in POSITIONS]
    for seed in SEEDS[1:]:  # what the sweep was before: one compare_plans per seed (serial); not the first seed
        alone = compare_plans(model, rows["train"], rows["eval"], rows["test"], growth=names, controls=[], reference=None,
                              learning_rates=[1e-2], seed=seed, budgets=[2, 6], warmup_steps=1, batch_size=4,
                              selection_max_examples=8, n_bootstrap=100, progress=False)
        for i, view in enumerate(alone.views):
            got = (out.at_smaller_budgets + [out])[i].realized_by_seed[seed]
            assert got == [view.statistics["vs_original"]["arms"][n]["mean"] for n in names]


def test_two_budgets_forgetting_and_the_gain_within_the_budget(validation):
    out, _ = validation
    assert out.budget == 6 and [v.budget for v in out.at_smaller_budgets] == [2]
    for view in [*out.at_smaller_budgets, out]:
        assert len(view.forgetting) == len(POSITIONS) and all(h >= f for f, h in zip(view.forgetting, view.forgetting_high))
        assert view.within == view.realized  # a budget nothing exceeds: within = gain
        assert [r["spearman"] for r in view.within_table] == [r["spearman"] for r in view.table]
        predictors = [r["predictor"] for r in view.table]
        assert predictors == [r["predictor"] for r in view.within_table] and {"z", "depth", "adept", "midas"} <= set(predictors)
    across = out.across_budgets()
    assert across["budgets"] == [2, 6] and {r["predictor"] for r in across["predictors"]} >= {"adept", "midas"}
    midas = next(r for r in across["predictors"] if r["predictor"] == "midas")
    assert len(midas["gain"]["spearman"]) == 2 and len(midas["within"]["regret"]) == 2
    assert -1 <= across["smallest_ranks_largest"]["spearman"] <= 1
    text = out.to_markdown()
    assert "## At 2 steps" in text and "Does the ranking hold from 2 to 6 steps?" in text and "Within the forgetting budget" in text


def test_the_gain_within_the_budget_keeps_the_original_over_it():
    assert gain_within([0.3, 0.5, -0.1, 0.2], [0.01, 0.2, 0.0, 0.05], 0.05) == [0.3, 0.0, -0.1, 0.2]


def test_saved_json_and_bad_input(setting, validation, tmp_path):
    out, _ = validation
    out.save(tmp_path)
    saved = json.loads((tmp_path / "probe_validation.json").read_text())
    assert saved["budget"] == 6 and saved["at_smaller_budgets"][0]["budget"] == 2 and saved["across_budgets"]["budgets"] == [2, 6]
    assert np.allclose(saved["forgetting"], out.forgetting)
    model, rows, cfg = setting
    with pytest.raises(ValueError, match="pass retention_data"):
        validate_probe(model, rows["train"], rows["eval"], rows["test"], positions=POSITIONS, config=cfg, predictors=("adept",))
