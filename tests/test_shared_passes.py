"""Evaluations that share work: a stepping stone in the grown model's pass, and losses reused across comparisons.

What is shared must give exactly the numbers of the separate passes; a model whose losses are reused
must not run again; reused losses of other examples are refused.
"""

from __future__ import annotations

import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.evaluation import compare_models, evaluate_delta
from hf_depthgrow.evaluation.paired import paired_losses
from hf_depthgrow.evaluation.retention import evaluate_retention
from hf_depthgrow.testing import tiny_inputs, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:loss_bound not given")


def _rows(model, n=12, seed=0):
    batch = tiny_inputs(model, batch=n, seq=10, seed=seed)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _grown(model_type="llama", seed=0, scale=0.05):
    """A copy of one tiny original grown at 2 with small random new-block outputs (so it differs from the original)."""
    torch.manual_seed(0)
    model = grow_depth(tiny_model(model_type), [2], init="copy")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.model.layers[2].parameters():
            if not p.any():
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def _never_called(model):
    def fail(*args, **kwargs):
        raise AssertionError("this model's losses were reused: it must not run")

    return model.register_forward_pre_hook(fail)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_stone_in_the_grown_models_pass_gives_its_own_evaluation(model_type):
    grown, stone = _grown(model_type, seed=0), _grown(model_type, seed=1)
    data = _rows(grown)
    collect, index = paired_losses(grown, data, batch_size=4, extra={"stone": stone})
    alone = evaluate_delta(stone, data, batch_size=4, loss_bound=20.0)
    assert index == 2
    assert collect.cat("stone").per_example.tolist() == pytest.approx(alone.per_example_new, abs=1e-6)
    assert collect.cat("old").per_example.tolist() == pytest.approx(alone.per_example_old, abs=1e-6)
    shared = evaluate_delta(grown, data, batch_size=4, loss_bound=20.0, losses=collect)
    plain = evaluate_delta(grown, data, batch_size=4, loss_bound=20.0)
    assert shared.per_example_new == plain.per_example_new and shared.per_example_old == plain.per_example_old
    assert shared.intervals == plain.intervals


def test_compare_models_reuses_a_side_without_running_that_model():
    grown, control = _grown(seed=0), _grown(seed=2)
    data = _rows(grown)
    collect, _ = paired_losses(grown, data, batch_size=4)
    plain = compare_models(control, grown, data, batch_size=4, loss_bound=20.0)
    handle = _never_called(grown)
    try:
        shared = compare_models(control, grown, data, batch_size=4, loss_bound=20.0, reuse={"new": (collect, "new")})
    finally:
        handle.remove()
    assert shared.per_example_new == pytest.approx(plain.per_example_new, abs=1e-6)
    assert shared.per_example_old == plain.per_example_old and shared.delta == pytest.approx(plain.delta, abs=1e-6)


def test_retention_against_the_original_reuses_its_losses():
    from hf_depthgrow.growth.bypass import bypass_new_blocks

    grown, control = _grown(seed=0), _grown(seed=3)
    data = _rows(grown, seed=5)
    collect, _ = paired_losses(grown, data, batch_size=4)
    with bypass_new_blocks(grown):
        _, plain = evaluate_retention(control, data, base=grown, batch_size=4, loss_bound=20.0)
        handle = _never_called(grown)
        try:
            _, shared = evaluate_retention(control, data, base=grown, batch_size=4, loss_bound=20.0, reuse={"old": (collect, "old")})
        finally:
            handle.remove()
    assert shared["forgetting"] == pytest.approx(plain["forgetting"], abs=1e-6)


def test_reused_losses_of_other_examples_are_refused():
    grown, control = _grown(seed=0), _grown(seed=2)
    collect, _ = paired_losses(grown, _rows(grown, n=12), batch_size=4)
    with pytest.raises(ValueError, match="not of the same 8 examples"):
        compare_models(control, grown, _rows(grown, n=8), batch_size=4, loss_bound=20.0, reuse={"new": (collect, "new")})
    with pytest.raises(ValueError, match="takes the sides 'old' and 'new'"):
        compare_models(control, grown, _rows(grown, n=12), batch_size=4, reuse={"stone": (collect, "new")})
    with pytest.raises(ValueError, match="lowest new block at 2"):
        paired_losses(grown, _rows(grown), extra={"stone": grow_depth(tiny_model("llama"), [1])})


def _f_old_passes(monkeypatch):
    """Count the trainer's passes over the original (`which="old"` on the training rows, step-0 held-out)."""
    import hf_depthgrow.training.trainer as trainer_module

    calls, real = [], trainer_module.candidate_loss

    def counting(which, *args, **kwargs):
        if "f_old" in kwargs.get("desc", ""):
            calls.append(kwargs["desc"])
        return real(which, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "candidate_loss", counting)
    return calls


@pytest.mark.parametrize("control", ["lora", "layers"])
def test_a_control_reuses_the_growths_original_losses_and_trains_identically(monkeypatch, control):
    import copy

    from hf_depthgrow.training import OriginalLosses, train

    torch.manual_seed(0)
    original = tiny_model("llama")
    rows, held = _rows(original, n=16, seed=0), _rows(original, n=8, seed=1)
    extra = {"lora_r": 2} if control == "lora" else {"trainable_layers": [1]}
    settings = dict(max_steps=4, learning_rate=1e-2, per_device_train_batch_size=4, selection_max_examples=8, seed=0, progress_bar=False)
    growth = train(grow_depth(copy.deepcopy(original), [2]), rows, eval_data=held, **settings)
    taken = growth.original_losses
    assert isinstance(taken, OriginalLosses) and taken.held_out == growth.eval_loss_before and taken.train == growth.train_losses["old"]

    alone = train(copy.deepcopy(original), rows, eval_data=held, trainable=control, **extra, **settings)
    calls = _f_old_passes(monkeypatch)
    reused = train(copy.deepcopy(original), rows, eval_data=held, trainable=control, original_losses=taken, **extra, **settings)
    assert calls == []  # neither pass over the original ran
    # The same original function: what was recomputed equals what was reused, and the run is the same.
    assert alone.eval_loss_before == pytest.approx(taken.held_out, abs=1e-6)
    assert alone.train_losses["old"] == pytest.approx(taken.train, abs=1e-6)
    assert reused.selected == alone.selected and reused.train_losses["new"] == alone.train_losses["new"]
    assert [h["loss"] for h in reused.history] == [h["loss"] for h in alone.history]
    assert reused.to_dict()["original_losses"]["held_out"] == taken.held_out


def test_original_losses_of_other_rows_are_refused_before_any_work(monkeypatch):
    import copy

    from hf_depthgrow.training import train

    torch.manual_seed(0)
    original = tiny_model("llama")
    rows, held = _rows(original, n=16, seed=0), _rows(original, n=8, seed=1)
    settings = dict(max_steps=2, per_device_train_batch_size=4, selection_max_examples=8, progress_bar=False)
    taken = train(grow_depth(copy.deepcopy(original), [2]), rows, eval_data=held, **settings).original_losses
    other_held = _rows(original, n=8, seed=2)
    with pytest.raises(ValueError, match="other held-out data"):
        train(copy.deepcopy(original), rows, eval_data=other_held, trainable="lora", original_losses=taken, **settings)
    with pytest.raises(ValueError, match="other selection rows"):
        train(copy.deepcopy(original), rows, eval_data=held, trainable="lora", original_losses=taken, **{**settings, "selection_max_examples": 4})
    with pytest.raises(ValueError, match="must be an OriginalLosses"):
        train(copy.deepcopy(original), rows, eval_data=held, trainable="lora", original_losses={"held_out": 1.0}, **settings)
    no_eval = train(grow_depth(copy.deepcopy(original), [2]), rows, **settings).original_losses
    assert no_eval.held_out is None
    with pytest.raises(ValueError, match="other held-out data"):
        train(copy.deepcopy(original), rows, eval_data=held, trainable="lora", original_losses=no_eval, **settings)
