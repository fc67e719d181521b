"""The comparison engine gives the same numbers, bit for bit, as the golden results in tests/data/engine_golden.json.

Each case is a small comparison of a tiny Llama built from a config: a multi-budget sweep with a retention set,
matched controls, grid extensions and the forgetting rates below each grid (run on the serial engine with a trial
store, then rebuilt from that store by the `stored` engine, and from a copy of the folder alone by
`gather_comparison`); successive halving on one budget; and the
oracle sweep over positions x seeds. A result is compared as `to_dict()` without its timings, plus a digest of
every per-example loss array, so a change anywhere in set-up, trial, store or aggregation shows as the first
differing key. Regenerate the golden file only for an intended change of results:
`HF_DEPTHGROW_WRITE_GOLDEN=1 pytest tests/test_engine_identity.py`.

Another CPU gives other last bits (its kernels sum in another order), so by default numbers match to within that:
1e-5 absolute (and 1e-6 relative), numbers printed inside text to their printed precision, and bootstrap p-values
to 0.025 (a delta near zero flips the sign of a few of the 100 replicates). A refactor is checked bit for bit on
one machine: write the golden file before it, then run with `HF_DEPTHGROW_GOLDEN_EXACT=1` after it.
"""

from __future__ import annotations

import json
import math
import os
import re
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
EXACT = os.environ.get("HF_DEPTHGROW_GOLDEN_EXACT") == "1"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")


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


def _values(values) -> list[float] | None:
    return None if values is None else np.asarray(values, dtype=np.float64).tolist()


def _timeless(value):
    """`value` without its timings (every key naming seconds): the only fields that may differ from run to run."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _compare_summary(result) -> dict:
    arrays = {f"{view.steps}/{arm.name}/{name}": _values(getattr(arm, f"{name}_per_example"))
              for view in result.views for arm in view.arms for name in ("test", "retention")}
    return json.loads(json.dumps({"result": _timeless(result.to_dict()), "per_example": arrays}))


def _validation_summary(validation) -> dict:
    # The realized side only: the predictors' scores and tables are the placement code's, not the engine's.
    keys = ("positions", "seeds", "learning_rate", "budget", "realized_by_seed", "realized", "intervals", "forgetting",
            "forgetting_high", "within")
    views = [*validation.at_smaller_budgets, validation]
    return json.loads(json.dumps([{k: v for k, v in view.to_dict().items() if k in keys} for view in views]))


def _close(got: float, want: float, where: str, *, exact: bool, printed: bool = False) -> bool:
    if exact or got == want:
        return got == want
    if where.endswith("/p_value"):
        return abs(got - want) <= 0.025
    return math.isclose(got, want, rel_tol=2e-3 if printed else 1e-6, abs_tol=1e-5)


def _same_text(got: str, want: str, where: str, *, exact: bool) -> bool:
    """Equal text, its numbers compared as printed numbers (`_close`)."""
    if exact or got == want:
        return got == want
    a, b = _NUMBER.findall(got), _NUMBER.findall(want)
    return (_NUMBER.split(got) == _NUMBER.split(want) and len(a) == len(b)
            and all(_close(float(x), float(y), where, exact=False, printed=True) for x, y in zip(a, b)))


def _first_difference(got, want, where="", *, exact: bool = EXACT) -> str | None:
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if k not in got or k not in want:
                return f"{where}/{k}: only in {'the golden file' if k in want else 'this run'}"
            if (diff := _first_difference(got[k], want[k], f"{where}/{k}", exact=exact)) is not None:
                return diff
        return None
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return f"{where}: {len(got)} items, the golden file has {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            if (diff := _first_difference(a, b, f"{where}[{i}]", exact=exact)) is not None:
                return diff
        return None
    if isinstance(got, float) and isinstance(want, float):
        same = _close(got, want, where, exact=exact)
    elif isinstance(got, str) and isinstance(want, str):
        same = _same_text(got, want, where, exact=exact)
    else:
        same = type(got) is type(want) and got == want
    return None if same else f"{where}: {got!r}, the golden file has {want!r}"


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
        assert _first_difference(got, want, exact=True) is None  # the store gives back every trial, bit for bit


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


def test_the_golden_comparison_allows_another_cpus_last_bits_and_nothing_more():
    golden = {"loss": 4.6091, "p_value": 0.0379, "lr": 0.003, "verdict": "gain 0.7640 [0.7072, 0.7817] at 80 steps", "steps": 80}
    bits = {"loss": 4.6091 + 2e-7, "p_value": 0.0359, "lr": 0.003, "verdict": "gain 0.7641 [0.7072, 0.7817] at 80 steps", "steps": 80}
    assert _first_difference(bits, golden, exact=False) is None
    assert _first_difference(bits, golden, exact=True) == f"/loss: {bits['loss']!r}, the golden file has 4.6091"
    for key, changed in (("loss", 4.6101), ("p_value", 0.09), ("lr", 0.001), ("verdict", "gain 0.7740 [0.7072, 0.7817] at 80 steps"),
                         ("verdict", "gain 0.7640 [0.7072, 0.7817] at 40 steps and more"), ("steps", 80.0)):
        assert _first_difference({**golden, key: changed}, golden, exact=False) == f"/{key}: {changed!r}, the golden file has {golden[key]!r}"
