"""Budgets as an axis (WSD branches = standalone runs), per-arm grids with extension, halving replayed, the frontier."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.comparison import CompareConfig, build_arms, compare_plans
from hf_depthgrow.comparison import frontier as fr
from hf_depthgrow.comparison.engine import run_serial
from hf_depthgrow.comparison.grids import extension, halving_survivor
from hf_depthgrow.comparison.runner import example_losses
from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, run_trial
from hf_depthgrow.testing import tiny_model, tiny_rows
from hf_depthgrow.training import TrainConfig
from hf_depthgrow.training.branching import restore_branch_point, retarget, save_branch_point
from hf_depthgrow.training.schedules import stable_end
from hf_depthgrow.training.trainer import GrownTrainer


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: tiny_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 12, 2), ("ret", 10, 3))}
    return model, rows


# --------------------------------------------------------------------------- WSD branches


def _wsd(total: int, trainable: str = "new") -> TrainConfig:
    return TrainConfig(trainable=trainable, learning_rate=5e-3, max_steps=total, per_device_train_batch_size=4, lr_scheduler="wsd",
                       warmup_steps=2, progress_bar=False, save_final_model=False)


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in trainer.trainable_named]


@pytest.mark.parametrize("trainable", ["new", "full"])
def test_a_branched_decay_is_bit_identical_to_a_standalone_wsd_run(setting, trainable):
    base, rows = setting
    make = (lambda: grow_depth(copy.deepcopy(base), [2])) if trainable == "new" else (lambda: copy.deepcopy(base))
    standalone = {}
    for total in (8, 16):
        t = GrownTrainer(make(), _wsd(total, trainable), rows["train"], rows["eval"])
        t.begin()
        t.run_steps(total)
        standalone[total] = _weights(t)
    trunk = GrownTrainer(make(), _wsd(16, trainable), rows["train"], rows["eval"])
    trunk.begin()
    trunk.run_steps(stable_end(8, 0.2))
    point = save_branch_point(trunk)
    retarget(trunk, 8)
    trunk.run_steps(8)
    branch = _weights(trunk)
    assert trunk.scheduler.get_last_lr()[0] < 5e-3 * 0.2  # the branch decayed
    restore_branch_point(trunk, point)
    trunk.run_steps(16)
    for got, want in ((branch, standalone[8]), (_weights(trunk), standalone[16])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_branching_needs_a_wsd_run(setting):
    base, rows = setting
    cfg = TrainConfig(trainable="new", max_steps=4, per_device_train_batch_size=4, progress_bar=False, save_final_model=False)
    trainer = GrownTrainer(grow_depth(copy.deepcopy(base), [2]), cfg, rows["train"])
    trainer.begin()
    with pytest.raises(ValueError, match="warmup-stable-decay"):
        save_branch_point(trainer)
    trainer.close()


# --------------------------------------------------------------------------- the trial unit


def _inputs(base, rows, **kw) -> TrialInputs:
    original = {"test": example_losses(base, rows["test"], 4), "retention": example_losses(base, rows["ret"], 4)}
    per, weight = example_losses(base, rows["eval"], 4)
    original["heldout"] = float(np.average(per, weights=weight))
    return TrialInputs(base=base, train_rows=rows["train"], eval_rows=rows["eval"], test_rows=rows["test"], retention_rows=rows["ret"],
                       batch_size=4, selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original=original, **kw)


def test_a_trial_scored_at_several_budgets_equals_one_trial_per_budget(setting):
    base, rows = setting
    arm = build_arms(base, ["at:2"], [])[1]
    swept = run_trial(TrialSpec(arm, 5e-3, 0, (6, 12), warmup_steps=1, scheduler="wsd", rungs=(3,)), _inputs(base, rows))
    assert sorted(swept.scores) == [6, 12] and [s for s, _ in swept.heldout_curve] == [3, 6, 12]
    for budget in (6, 12):
        alone = run_trial(TrialSpec(arm, 5e-3, 0, (budget,), warmup_steps=1, scheduler="wsd"), _inputs(base, rows))
        a, b = swept.scores[budget], alone.scores[budget]
        assert a.units_seen == b.units_seen == budget * 4 * 12
        assert a.heldout_loss == b.heldout_loss and a.selected == b.selected
        np.testing.assert_array_equal(a.test, b.test)
        np.testing.assert_array_equal(a.retention, b.retention)


def test_a_trial_writes_nothing_into_its_inputs_and_hands_the_originals_losses_back(setting):
    """A trial is pure: the original's losses its trainer takes come back on the result, and a later trial given
    them reuses them (skipping their passes over the data) with the same numbers as one that takes its own."""
    from hf_depthgrow.training import OriginalLosses

    base, rows = setting
    arm = build_arms(base, ["at:2"], [])[1]
    inputs = _inputs(base, rows)
    before = dict(inputs.original)
    spec = TrialSpec(arm, 5e-3, 0, (4,))
    first = run_trial(spec, inputs)
    assert inputs.original.keys() == before.keys() and all(inputs.original[k] is before[k] for k in before)
    assert isinstance(first.original_losses, OriginalLosses) and first.original_losses.train is not None
    reused = run_trial(spec, inputs, original_losses=(first.original_losses,))
    assert reused.original_losses == first.original_losses
    assert reused.scores[4].train_losses == first.scores[4].train_losses
    np.testing.assert_array_equal(reused.scores[4].test, first.scores[4].test)
    elsewhere = dataclasses.replace(first.original_losses, train=123.0, key={**first.original_losses.key, "train": "other rows"})
    assert run_trial(spec, inputs, original_losses=(elsewhere,)).original_losses == first.original_losses  # not its rows: ignored


def test_serial_halving_keeps_what_the_full_grid_replayed_would_keep(setting):
    base, rows = setting
    arm = build_arms(base, ["at:2"], [])[1]
    specs = [TrialSpec(arm, lr, 0, (8,), rungs=(2, 4)) for lr in (1e-4, 3e-3, 3e-2)]
    full = run_serial(specs, _inputs(base, rows))
    halved = run_serial(specs, _inputs(base, rows), halving=True)
    assert [t.stopped_at for t in halved].count(None) == 1  # 3 -> 2 at step 2 -> 1 at step 4
    survivor = next(t for t in halved if t.stopped_at is None)
    replay = halving_survivor([{t.spec.learning_rate: t.heldout_at(r) for t in full} for r in (2, 4)],
                              {t.spec.learning_rate: t.scores[8].heldout_loss for t in full})
    assert survivor.spec.learning_rate == replay
    twin = next(t for t in full if t.spec.learning_rate == replay)
    np.testing.assert_array_equal(survivor.scores[8].test, twin.scores[8].test)  # the survivor is the run trained alone


def test_halving_survivor_and_grid_extension_rules():
    assert halving_survivor([{1: 3.0, 2: 2.9}], {1: 2.5, 2: 2.7}) == 2  # an early leader that loses in the end
    assert halving_survivor([], {1: 2.5, 2: 2.7}) == 1
    assert extension([1e-3, 3e-3, 1e-2], ["high", None], added=0, limit=2, cap=0.1) == (0.03, "")
    assert extension([1e-3, 3e-3, 1e-2], ["low"], added=0, limit=2, cap=0.1) == (0.000333333, "")
    assert extension([1e-3, 3e-3, 1e-2], ["high"], added=2, limit=2, cap=0.1) == (None, "limit")
    assert extension([1e-3, 3e-3, 3e-2], ["high"], added=0, limit=2, cap=0.05) == (None, "cap")
    assert extension([1e-3, 3e-3, 1e-2], [None, None], added=0, limit=2, cap=0.1) == (None, "interior")


# --------------------------------------------------------------------------- the frontier and the control curve


def test_pareto_best_within_and_the_envelope():
    points = {"lora": (0.8, 0.28), "layers": (0.43, 0.0), "probe:1": (0.36, 0.01), "original": (0.0, 0.0)}
    assert fr.pareto(points) == ["lora", "layers"]
    assert fr.best_within({"lora": 0.8, "probe:1": 0.36}, {"lora": 0.3, "probe:1": 0.02}, 0.05) == "probe:1"
    assert fr.best_within({"lora": 0.8}, {"lora": 0.3}, 0.05) == "original"
    gains, forgets = fr.envelope(np.array([[0.8, 0.3], [0.4, 0.1], [0.5, 0.4]]))  # (0.5, 0.4) is dominated
    np.testing.assert_allclose(gains, [0.0, 0.4, 0.8])
    np.testing.assert_allclose(forgets, [0.0, 0.1, 0.3])
    assert fr.curve_at(gains, forgets, 0.6) == pytest.approx(0.2)
    assert fr.curve_at(gains, forgets, 2.0) == pytest.approx(0.3)  # flat past the largest gain


def test_off_curve_detects_an_arm_that_forgets_less_at_matched_gain():
    rng = np.random.default_rng(0)
    n = 400
    gain = {"lora": 0.8 + 0.1 * rng.standard_normal(n), "lora:2": 0.4 + 0.1 * rng.standard_normal(n),
            "good": 0.6 + 0.1 * rng.standard_normal(n), "bad": 0.6 + 0.1 * rng.standard_normal(n)}
    forget = {"lora": 0.4 + 0.05 * rng.standard_normal(n), "lora:2": 0.2 + 0.05 * rng.standard_normal(n),
              "good": 0.0 + 0.05 * rng.standard_normal(n), "bad": 0.6 + 0.05 * rng.standard_normal(n)}
    out = fr.off_curve(gain, forget, ["lora", "lora:2"], ["good", "bad"], n_bootstrap=300)
    assert out["arms"]["good"]["status"] == "off the curve"
    assert out["arms"]["good"]["margin"]["mean"] == pytest.approx(0.3, abs=0.03)  # the curve is at 0.3 at gain 0.6
    assert out["arms"]["bad"]["status"] == "forgets more than the curve"
    assert fr.off_curve(gain, forget, [], ["good"]) is None


# --------------------------------------------------------------------------- compare_plans with budgets


@pytest.fixture(scope="module")
def swept(setting):
    base, rows = setting
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    result = compare_plans(
        base, rows["train"], rows["eval"], rows["test"], retention_data=rows["ret"], growth=["top:1"],
        controls=["layers", "lora", "lora:4"], budgets=[2, 4, 6, 8], growth_learning_rates=[1e-5, 3e-5], lr_extensions=1,
        batch_size=4, progress=False, n_bootstrap=200, max_forgetting=0.5, allow_repeated_data=True,  # 32 blocks of 24
        forgetting_rates=1,
    )
    return base, before, result


def test_compare_with_budgets_scores_every_arm_at_every_budget(swept):
    base, before, result = swept
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    assert [v.steps for v in result.views] == [2, 4, 6, 8] and [v.units_seen for v in result.views] == [b * 4 * 12 for b in (2, 4, 6, 8)]
    assert result.arms is result.views[-1].arms  # the top-level table is the largest budget
    names = [a.name for a in result.arms]
    assert names == ["original", "top:1", "layers", "lora", "lora:4"]
    for view in result.views:
        for arm in view.arms[1:]:
            losses = {lr: t["heldout_loss"] for lr, t in arm.tried.items()}
            assert arm.learning_rate == min(losses, key=losses.get)  # chosen on held-out, per budget
        # The frontier and the choice within the forgetting budget range over every trained point (arm x rate) at the budget.
        points = view.frontier["points"]
        assert len(points) == sum(len(a.tried) for a in view.arms[1:])
        assert set(view.frontier["frontier"]) <= set(points) | {"original"}
        assert view.frontier["best_within"] in set(points) | {"original"}
        assert set(view.frontier["frontier_arms"]) <= set(names)
    # Tiny rates for the growth arm: its choice sits at the top edge, so its grid gained one x3 step, then hit the limit;
    # with a retention set every grid also starts one x3 step below its lowest rate (forgetting_rates=1).
    assert result.grids["top:1"]["added"] == [9e-5] and result.grids["top:1"]["stopped"] == "limit"
    assert set(result.arm("top:1").tried) == {3.33333e-6, 1e-5, 3e-5, 9e-5}
    assert result.halving_agreement and all(v["of"] >= 1 for v in result.halving_agreement.values())


def test_the_report_states_the_budgets_every_arm_had(swept):
    """Before: "Every arm: 20 optimizer steps" (the unused max_steps default) for budgets 2 4 6 8."""
    *_, result = swept
    text = result.to_markdown()
    assert "Every arm: 2, 4, 6 and 8 optimizer steps (scored at each budget as if trained alone; the table: 8) of 4 examples" in text
    assert "20 optimizer steps" not in text


def test_budget_sweep_outputs_carry_the_frontier_and_per_budget_rows(swept, tmp_path):
    *_, result = swept
    result.save(tmp_path)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [b["steps"] for b in saved["budgets"]] == [2, 4, 6, 8]
    row = saved["budgets"][0]["arms"]["top:1"]
    assert row["tokens_per_parameter"] == pytest.approx(2 * 4 * 12 / result.arm("top:1").trainable_parameters)
    assert saved["budgets"][-1]["frontier_detail"]["control_curve"]["arms"]["top:1"]["status"]
    text = (tmp_path / "compare.md").read_text()
    assert "## Per budget" in text and "## Gain x forgetting" in text and "extended by" in text
    assert "the best within forgetting 0.5 nats is" in result.verdict
    # Four budgets: every arm's learning curve is fitted, the crossover predicted and the fit validated on the largest.
    curves = saved["curves"]
    assert set(curves["crossover"]["fits"]) == {"top:1", "layers", "lora", "lora:4"} and curves["crossover_text"]
    assert set(curves["validation"]["arms"]) == {"top:1", "layers", "lora", "lora:4"} and "## Learning curves" in text
    for name in ("compare_frontier.png", "compare_curves.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_retention_parts_never_overlap_and_choices_use_the_selection_part(swept):
    from hf_depthgrow.comparison.aggregate import retention_parts

    sel, test = retention_parts(10, 0.5, 0)
    assert len(sel) == 5 and len(test) == 5 and not set(sel) & set(test)
    *_, result = swept
    original = result.arm("original")
    assert len(original.retention_per_example) == 5 and len(original.retention_selection) == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budgets": [20, 10]}, "strictly increasing"),
        ({"budgets": [4, 8], "warmup_steps": 4}, "too small for its warm-up"),
        ({"max_forgetting": -0.1}, "max_forgetting"),
        ({"growth_learning_rates": []}, "growth_learning_rates must be a non-empty list"),
        ({"max_learning_rate": 1e-3}, "below the largest rate of the"),
        ({"budgets": [10, 20], "lr_scheduler": "cosine"}, "lr_scheduler='wsd'"),
        ({"budgets": [10, 20], "successive_halving": True}, "single budget"),
        ({"controls": ["lora:0"]}, "rank R >= 1"),
    ],
)
def test_bad_sweep_settings_are_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig(**kwargs)


def test_one_budget_keeps_its_schedule_and_defaults():
    cfg = CompareConfig()
    assert cfg.sweep == [20] and cfg.scheduler == "cosine" and cfg.warmup == 2 and cfg.budgets is None
    assert cfg.grid("growth") == [1e-3, 3e-3, 1e-2] and cfg.grid("full") == [3e-5, 1e-4, 3e-4]
    assert CompareConfig(learning_rates=[1e-3, 3e-4]).grid("lora") == [3e-4, 1e-3]  # one shared grid when given
    assert CompareConfig(budgets=[10, 20, 40]).scheduler == "wsd"


# --------------------------------------------------------------------------- stored trials: resume, verification


def test_stored_trials_resume_without_training_and_a_tampered_one_is_rerun(setting, tmp_path, monkeypatch):
    import hf_depthgrow.comparison.trial as engine  # run_trial drives trial_steps

    base, rows = setting
    kw = dict(retention_data=rows["ret"], growth=["top:1"], controls=["layers"], budgets=[4, 8], learning_rates=[1e-3, 3e-3],
              lr_extensions=0, forgetting_rates=0, batch_size=4, progress=False, n_bootstrap=100, trials_dir=tmp_path / "trials",
              allow_repeated_data=True)
    first = compare_plans(base, rows["train"], rows["eval"], rows["test"], **kw)
    entries = sorted((tmp_path / "trials" / "trials").iterdir())
    assert len(entries) == 4 and all((e / "digest.json").is_file() for e in entries)
    real = engine.trial_steps
    monkeypatch.setattr(engine, "trial_steps", lambda *a, **k: pytest.fail("a stored trial was trained again"))
    again = compare_plans(base, rows["train"], rows["eval"], rows["test"], **kw)
    assert again.to_dict()["budgets"] == first.to_dict()["budgets"]
    # An edited result is never reused: one warning, and only that trial runs again.
    from safetensors.torch import load_file, save_file

    victim = entries[0] / "tensors.safetensors"
    tensors = load_file(victim)
    save_file({k: v * 1.5 for k, v in tensors.items()}, victim)
    calls = []
    monkeypatch.setattr(engine, "trial_steps", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    with pytest.warns(UserWarning, match="does not match its sha256"):
        third = compare_plans(base, rows["train"], rows["eval"], rows["test"], **kw)
    assert len(calls) == 1 and third.to_dict()["budgets"] == first.to_dict()["budgets"]
    # Another model's trials are never taken for this one's.
    other = tiny_model("llama", seed=1)
    calls.clear()
    compare_plans(other, rows["train"], rows["eval"], rows["test"], **kw)
    assert len(calls) == 4


def test_cli_refuses_bad_budgets_and_a_trials_dir_inside_the_output(tmp_path, capsys):
    from hf_depthgrow.cli import main

    out = tmp_path / "out"
    for extra, message in ((["--budgets", "20", "10"], "strictly increasing"), (["--max-forgetting", "-1"], "--max-forgetting must be"),
                           (["--growth-learning-rates", "1e-3", "--max-learning-rate", "1e-4"], "below the largest rate of"),
                           (["--trials-dir", str(out / "trials")], "lies inside output_dir")):
        assert main(["compare", "--output-dir", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-depthgrow compare: ") and "\n" not in err and message in err
        assert not out.exists()


def test_a_trial_that_diverges_keeps_the_original_at_every_later_budget(setting, monkeypatch, tmp_path):
    """A NaN gradient from step 3 on the trunk: every budget falls back to the original, the budget's tokens still
    count, and the trial is stored (its budgets share the original's arrays, which safetensors refused to write:
    the committed SmolLM2 sweep lost its lora@1e-2 trial that way)."""
    import hf_depthgrow.comparison.trial as trial
    from hf_depthgrow import new_block_parameters

    base, rows = setting
    made = trial.fresh_model

    def diverging(*args):
        model, calls = made(*args), [0]
        _, weight = next(iter(new_block_parameters(model)))

        def hook(grad):
            calls[0] += 1
            return torch.full_like(grad, float("nan")) if calls[0] >= 3 else grad

        weight.register_hook(hook)
        return model

    monkeypatch.setattr(trial, "fresh_model", diverging)
    arm = build_arms(base, ["at:2"], [])[1]
    inputs = _inputs(base, rows)
    with pytest.warns(UserWarning, match="training diverged"):
        result = run_trial(TrialSpec(arm, 5e-3, 0, (6, 12), warmup_steps=1, scheduler="wsd"), inputs)
    for budget in (6, 12):
        score = result.scores[budget]
        assert score.selected == "old" and score.units_seen == budget * 4 * 12
        np.testing.assert_array_equal(score.test, inputs.original["test"][0])
    from hf_depthgrow.comparison.store import TrialStore

    store = TrialStore(tmp_path / "trials", inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a store that cannot write only warns: make that a failure here
        assert store.save(result) is not None
    back = store.load(result.spec)
    for budget in (6, 12):
        np.testing.assert_array_equal(back.scores[budget].test, result.scores[budget].test)
        assert back.scores[budget].selected == "old"
