"""Budgets in fresh data: a sweep draws new training blocks at every step up to its largest budget, refuses (or, when
allowed, says up front) that data runs short, reports epochs per budget, and its crossover says where it lies
against the fresh data that exists; a fit whose floor sits at its bound is said to be one."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from hf_depthgrow.comparison import CompareConfig, compare_plans
from hf_depthgrow.comparison.crossover import predict_crossover
from hf_depthgrow.comparison.fresh_data import DataPlan, data_plan
from hf_depthgrow.testing import tiny_model, tiny_rows

BATCH = 4


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: tiny_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 12, 2), ("ret", 10, 3))}
    return model, rows


@pytest.fixture
def fetched(monkeypatch):
    """`(step, rows)` of every batch the trainer fetches to train on, in order (branches included)."""
    import hf_depthgrow.training.trainer as trainer

    seen, current = [], [None]
    step, fetch = trainer.GrownTrainer.training_step, trainer.fetch

    def training_step(self, n):
        current[0] = n
        try:
            return step(self, n)
        finally:
            current[0] = None

    def spy(rows, indices, **kw):
        if current[0] is not None:
            seen.append((current[0], tuple(int(i) for i in indices)))
        return fetch(rows, indices, **kw)

    monkeypatch.setattr(trainer.GrownTrainer, "training_step", training_step)
    monkeypatch.setattr(trainer, "fetch", spy)
    return seen


def _sweep(setting, train, **kw):
    model, rows = setting
    settings = dict(growth=["top:1"], controls=[], learning_rates=[1e-3], lr_extensions=0, warmup_steps=1, batch_size=BATCH,
                    selection_max_examples=None, n_bootstrap=50, progress=False)
    return compare_plans(model, train, rows["eval"], rows["test"], **{**settings, **kw})


def test_a_sweep_trains_on_new_blocks_at_every_step_and_refuses_data_shorter_than_its_largest_budget(setting, fetched, tmp_path):
    _, rows = setting
    _sweep(setting, rows["train"], budgets=[3, 6])  # 6 steps x 4 = 24 blocks: exactly the training set
    by_step = {}
    for step, chosen in fetched:  # a branch re-runs the trunk's steps with the trunk's blocks: the standalone budget's run
        assert by_step.setdefault(step, chosen) == chosen
    assert sorted(by_step) == list(range(1, 7))
    blocks = [i for step in sorted(by_step) for i in by_step[step]]
    assert sorted(blocks) == list(range(24))  # every block once: none repeats before the largest budget is consumed

    fetched.clear()
    trials = tmp_path / "trials"
    with pytest.raises(ValueError) as err:
        _sweep(setting, rows["train"][:20], budgets=[3, 6], trials_dir=trials)
    message = str(err.value)
    assert "\n" not in message and "need 24 training blocks, but there are 20" in message and "--allow-repeated-data" in message
    assert "blocks would repeat from step 6 on" in message
    assert fetched == [] and not trials.exists()  # refused before anything trained or was written


def test_with_the_opt_in_short_data_warns_up_front_and_reports_epochs(setting, monkeypatch):
    import hf_depthgrow.training.trainer as trainer

    _, rows = setting
    fetch, out_when_fetched = trainer.fetch, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def counting(rows_, indices, **kw):  # the warnings already out when the trainer fetches a batch
            out_when_fetched.append(sum("training blocks repeat" in str(w.message) for w in caught))
            return fetch(rows_, indices, **kw)

        monkeypatch.setattr(trainer, "fetch", counting)
        result = _sweep(setting, rows["train"][:20], budgets=[2, 4, 6], controls=["layers"], allow_repeated_data=True)
    repeats = [str(w.message) for w in caught if "training blocks repeat" in str(w.message)]
    assert len(repeats) == 1 and out_when_fetched and out_when_fetched[0] == 1  # said once, before the first step
    assert repeats[0] == ("training blocks repeat (allow_repeated_data): the largest budget needs 24 blocks, there are 20, so blocks "
                          "repeat from step 6 on; epochs per budget: 2 steps 0.40, 4 steps 0.80, 6 steps 1.20")
    saved = result.to_dict()
    assert [b["epochs"] for b in saved["budgets"]] == pytest.approx([0.4, 0.8, 1.2])
    markdown = result.to_markdown()
    assert "epochs per budget: 2 steps 0.40, 4 steps 0.80, 6 steps 1.20. Blocks repeat from step 6 on" in markdown
    assert "Every arm: 2, 4 and 6 optimizer steps (scored at each budget as if trained alone; the table: 6) of 4 examples" in markdown and "20 optimizer steps" not in markdown
    assert "| 6 | 1.20 | top:1 |" in markdown
    cross = result.curves["crossover"]["on_gain"]
    assert cross["epochs_at_largest"] == pytest.approx(1.2) and cross["beyond_fresh_data"]
    assert "epochs of the training data" in cross["text"]
    json.dumps(saved, allow_nan=False)


def test_a_single_budget_reports_its_epochs_and_fresh_data(setting):
    _, rows = setting
    result = _sweep(setting, rows["train"], max_steps=3)
    assert result.to_dict()["budgets"][0]["epochs"] == pytest.approx(0.5)
    markdown = result.to_markdown()
    assert "Every arm: 3 optimizer steps of 4 examples" in markdown
    assert "24 training blocks, 4 per step; epochs per budget: 3 steps 0.50. Every step draws new blocks" in markdown


def test_data_plan_and_the_flag():
    plan = DataPlan(blocks=192, batch_size=8, budgets=(5, 10, 20, 40, 80), allowed=True)
    assert (plan.needed, plan.fresh_steps, plan.repeats) == (640, 24, True)
    assert plan.to_dict()["epochs"]["80"] == pytest.approx(640 / 192)
    cfg = CompareConfig(budgets=[5, 10, 20, 40, 80])
    with pytest.raises(ValueError, match=r"need 640 training blocks, but there are 192 \(3.33 epochs"):
        data_plan(cfg, 192)
    assert not data_plan(cfg, 640).repeats
    from hf_depthgrow.cli.compare import build_parser

    _, parsed = build_parser().parse(["--allow-repeated-data"])
    assert parsed.allow_repeated_data is True
    with pytest.raises(ValueError, match="allow_repeated_data must be True or False"):
        CompareConfig(allow_repeated_data="yes")


def test_cli_refuses_budgets_beyond_the_training_data_before_writing(tmp_path, capsys):
    from tiny_lm import make_tiny_lm

    from hf_depthgrow.cli import main

    lm = make_tiny_lm(tmp_path / "lm", max_chars=20_000)
    capsys.readouterr()  # the shards' progress bar
    out = tmp_path / "out"
    argv = ["compare", "--model", str(lm / "tiny"), "--data", str(lm / "sample.txt"), "--output-dir", str(out), "--block-size", "16",
            "--max-examples", "40", "--budgets", "2", "4", "8", "--learning-rates", "3e-3", "--no-progress"]
    assert main(argv) == 2  # 8 steps x 8 examples = 64 blocks; the training split holds 24
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("hf-depthgrow compare: ")]  # after the loading bars
    assert len(lines) == 1 and "Traceback" not in stderr
    err = lines[0]
    assert err.startswith("hf-depthgrow compare: the training data is shorter than the largest budget: 8 steps x 8 examples need 64")
    assert "there are 24" in err and "--allow-repeated-data" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["lm"]


# --------------------------------------------------------------------------- the crossover against the fresh data

TOKENS = 10240 * 2.0 ** np.arange(5)
CROSS = 5 * TOKENS[-1]


def _per_example(curve, n=200, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for D in TOKENS:
        noise = rng.normal(0.0, 0.5, n)
        out.append(curve(D) + noise - noise.mean())
    return out


def _control(D):
    return 3.5 + 50 * np.asarray(D, dtype=float) ** -0.3


def _growth(D):
    return 3.0 + (50 + 0.5 * CROSS**0.3) * np.asarray(D, dtype=float) ** -0.3


def _predict(losses, **kw):
    return predict_crossover(TOKENS, losses, growth=["probe:1"], controls=["lora"], best_growth="probe:1", best_control="lora",
                             n_bootstrap=kw.pop("n_bootstrap", 20), **kw)["on_gain"]


def test_a_crossover_beyond_the_fresh_data_says_so_in_words():
    losses = {"probe:1": _per_example(_growth, seed=1), "lora": _per_example(_control, seed=2)}
    beyond = _predict(losses, fresh_tokens=1.5 * TOKENS[-1])  # the data ends at 1.5x the largest budget; the crossing is at 5x
    assert beyond["status"] == "crossover" and beyond["epochs"] == pytest.approx(5 / 1.5, rel=1e-4) and beyond["beyond_fresh_data"]
    assert beyond["text"].startswith("probe:1 is predicted to overtake lora at 819,200 tokens (5x the largest budget), which is 3.33 "
                                     "epochs of the training data: beyond the fresh data, which ends at 1.5x the largest budget;")
    within = _predict(losses, fresh_tokens=10 * TOKENS[-1])
    assert "(5x the largest budget), which is 0.50 epochs of the training data: within the fresh data;" in within["text"]
    assert not within["beyond_fresh_data"]
    assert "epochs" not in _predict(losses)["text"]  # without fresh_tokens nothing is claimed about it


def test_no_crossover_on_repeated_data_says_how_far_the_search_extrapolates():
    better = lambda D: _control(D) - 0.2  # noqa: E731
    losses = {"probe:1": _per_example(_control, seed=1), "lora": _per_example(better, seed=2)}
    out = _predict(losses, fresh_tokens=TOKENS[-1] * 192 / 640)  # the SmolLM2 sweep: 80 steps x 8 on 192 blocks
    assert out["status"] == "none"
    assert ("no crossover predicted within 100x the largest budget (probe:1 vs lora); 100x is 333 epochs of the training data: the "
            "search runs beyond the fresh data, which ends at 0.3x the largest budget (the largest budget is already 3.33 epochs)") in out["text"]


def test_a_floor_at_its_bound_is_reported_as_such_not_as_no_crossover():
    # The control flattens onto its smallest measured loss: the fit's floor E sits at that bound, and the fitted curve
    # can never fall below it, which by itself decides where (or whether) growth would cross.
    flattened = dict(zip(TOKENS, [4.0, 3.0, 2.9, 2.85, 2.84]))
    losses = {"probe:1": _per_example(lambda D: 2.9 + 60 * np.asarray(D, dtype=float) ** -0.35, seed=1),
              "lora": _per_example(lambda D: flattened[float(D)], seed=2)}
    out = _predict(losses, fresh_tokens=TOKENS[-1] / 2)
    assert out["status"] == "floor_at_bound" and out["fitted_status"] in ("none", "crossover") and out["tokens"] is None
    assert out["floor_at_bound"] == {"lora": {"side": "upper", "E": pytest.approx(2.84)}}
    assert out["text"] == ("the fit's floor is at its bound: no crossover can be read from it (probe:1 vs lora; lora: E at its upper "
                           "bound 2.84, its lowest measured test loss); the largest budget is already 2.00 epochs of the training "
                           "data: beyond the fresh data")
    assert "no crossover predicted" not in out["text"]
