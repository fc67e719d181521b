"""The comparison engine gives the same numbers, bit for bit, as the golden results in tests/data/engine_golden.json.

Each case is a small comparison of a tiny Llama built from a config: a multi-budget sweep with a retention set,
matched controls, grid extensions and the forgetting rates below each grid (run on the serial engine with a trial
store, then rebuilt from that store by the `stored` engine, and from a copy of the folder alone by
`gather_comparison`); successive halving on one budget; and the
oracle sweep over positions x seeds. A result is compared as `to_dict()` without its timings, plus a digest of
every per-example loss array, so a change anywhere in set-up, trial, store or aggregation shows as the first
differing key. Regenerate the golden file only for an intended change of results:
`HF_DEPTHGROW_WRITE_GOLDEN=1 pytest tests/test_engine_identity.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hf_depthgrow.comparison import compare_plans
from hf_depthgrow.comparison.config import CompareConfig
from hf_depthgrow.comparison.gather import gather_comparison
from hf_depthgrow.comparison.validation import validate_probe
from hf_depthgrow.testing import tiny_model, tiny_rows

GOLDEN = Path(__file__).parent / "data" / "engine_golden.json"
WRITE = os.environ.get("HF_DEPTHGROW_WRITE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: tiny_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 12, 2), ("ret", 10, 3))}
    return model, rows


@pytest.fixture(scope="module")
def golden():
    found = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    yield found
    if WRITE:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


def _digest(values) -> str | None:
    return None if values is None else hashlib.sha256(np.ascontiguousarray(values, dtype=np.float64).tobytes()).hexdigest()[:16]


def _timeless(value):
    """`value` without its timings (every key naming seconds): the only fields that may differ from run to run."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _compare_summary(result) -> dict:
    arrays = {f"{view.steps}/{arm.name}/{name}": _digest(getattr(arm, f"{name}_per_example"))
              for view in result.views for arm in view.arms for name in ("test", "retention")}
    return json.loads(json.dumps({"result": _timeless(result.to_dict()), "per_example": arrays}))


def _validation_summary(validation) -> dict:
    # The realized side only: the predictors' scores and tables are the placement code's, not the engine's.
    keys = ("positions", "seeds", "learning_rate", "budget", "realized_by_seed", "realized", "intervals", "forgetting",
            "forgetting_high", "within")
    views = [*validation.at_smaller_budgets, validation]
    return json.loads(json.dumps([{k: v for k, v in view.to_dict().items() if k in keys} for view in views]))


def _first_difference(got, want, where="") -> str | None:
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if k not in got or k not in want:
                return f"{where}/{k}: only in {'the golden file' if k in want else 'this run'}"
            if (diff := _first_difference(got[k], want[k], f"{where}/{k}")) is not None:
                return diff
        return None
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return f"{where}: {len(got)} items, the golden file has {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            if (diff := _first_difference(a, b, f"{where}[{i}]")) is not None:
                return diff
        return None
    return None if got == want else f"{where}: {got!r}, the golden file has {want!r}"


def _check(golden: dict, case: str, got) -> None:
    if WRITE:
        golden[case] = got
        return
    assert case in golden, f"no golden result for {case}: generate it with HF_DEPTHGROW_WRITE_GOLDEN=1"
    diff = _first_difference(got, golden[case])
    assert diff is None, f"{case} differs from its golden result at {diff}"


SWEEP = dict(
    growth=["top:1"], controls=["layers", "lora"], budgets=[2, 4, 6], growth_learning_rates=[1e-5, 3e-5], layers_learning_rates=[1e-3],
    lora_learning_rates=[3e-3], lr_extensions=1, forgetting_rates=1, batch_size=4, progress=False, n_bootstrap=100, max_forgetting=0.5,
    allow_repeated_data=True,
)


def test_a_budget_sweep_with_retention_and_its_gather_match_the_golden_result(setting, golden, tmp_path):
    base, rows = setting
    trials = tmp_path / "trials"
    swept = compare_plans(base, rows["train"], rows["eval"], rows["test"], retention_data=rows["ret"], trials_dir=trials, **SWEEP)
    _check(golden, "budget_sweep", _compare_summary(swept))
    gathered = compare_plans(base, rows["train"], rows["eval"], rows["test"], retention_data=rows["ret"], trials_dir=trials,
                             engine="stored", **SWEEP)
    want = _compare_summary(swept)
    for rebuilt in (gathered, gather_comparison(shutil.copytree(trials, tmp_path / "elsewhere"))):  # the folder alone: no model, no data
        got = _compare_summary(rebuilt)
        assert got["result"]["config"]["engine"] == "stored"
        got["result"]["config"]["engine"] = "serial"
        assert _first_difference(got, want) is None  # the store gives back every trial, bit for bit


def test_gather_refuses_a_folder_without_a_recorded_comparison(tmp_path):
    (tmp_path / "trials").mkdir()
    with pytest.raises(ValueError, match=r"^gather: .* holds no comparison this version recorded"):
        gather_comparison(tmp_path)


def test_successive_halving_matches_the_golden_result(setting, golden):
    base, rows = setting
    halved = compare_plans(base, rows["train"], rows["eval"], rows["test"], growth=["at:2"], controls=["layers"], learning_rates=[1e-4, 5e-3],
                           max_steps=8, successive_halving=True, lr_extensions=0, batch_size=4, progress=False, n_bootstrap=100,
                           allow_repeated_data=True)
    _check(golden, "halving", _compare_summary(halved))


def test_the_oracle_sweep_matches_the_golden_result(setting, golden):
    base, rows = setting
    cfg = CompareConfig(budgets=[2, 4], warmup_steps=1, batch_size=4, selection_max_examples=8, n_bootstrap=100, progress=False,
                        growth_learning_rates=[1e-2], max_forgetting=1e9)
    validation = validate_probe(base, rows["train"], rows["eval"], rows["test"], positions=[0, 1, 3, 4], seeds=[0, 1], config=cfg,
                                retention_data=rows["ret"], predictors=("depth",), n_permutations=50)
    _check(golden, "oracle", _validation_summary(validation))
