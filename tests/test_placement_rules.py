"""The literature's placement rules as predictors: ADEPT's layer-removal score against a model
rebuilt without the layer, MIDAS's middle of the stack; side-effect free; known to `predictor_scores`."""

import copy
import math

import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.growth.families import residual_output_modules
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.chunked_loss import batch_example_losses
from hf_depthgrow.probe.baselines import predictor_scores
from hf_depthgrow.probe.placement_rules import adept_scores, midas_scores, skipped_layer_losses
from hf_depthgrow.testing import tiny_inputs, tiny_model


def rows_for(model, n=3):
    return [tiny_inputs(model, seed=10 + s) for s in range(n)]


def loss_without(model, rows, layer):
    """Reference: a deep copy with the layer deleted from its stack by hand, the token-weighted loss."""
    model = copy.deepcopy(model)
    if layer is not None:
        stack = resolve_family(model)[1]
        del stack[layer]
        model.config.num_hidden_layers -= 1
        for i, block in enumerate(stack):  # attention keeps its index for the cache and per-layer settings
            block.self_attn.layer_idx = i
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = [t for j, t in enumerate(model.config.layer_types) if j != layer]
    total = weight = 0.0
    with torch.no_grad():
        for batch in rows:
            losses = batch_example_losses(model, batch)
            total += float((losses.per_example.double() * losses.weight.double()).sum())
            weight += float(losses.weight.double().sum())
    return total / weight


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config.to_dict(), model.training


def test_adept_matches_a_model_rebuilt_without_the_layer():
    model = tiny_model("llama")
    rows = rows_for(model)
    before = state(model)
    positions = [0, 1, 3, 4]
    scores = adept_scores(model, positions, retention_data=rows, batch_size=2)
    full = loss_without(model, rows, layer=None)
    for k, score in zip(positions, scores):
        source = max(k - 1, 0)
        assert score == pytest.approx(-(loss_without(model, rows, source) - full), rel=1e-5, abs=1e-6), k
    # k = 0 and k = 1 both copy layer 0: the same score
    assert scores[0] == scores[1]
    after = state(model)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1] == after[1] and before[2] == after[2]


def test_adept_prefers_the_layer_that_does_nothing():
    model = tiny_model("llama")
    rows = rows_for(model)
    spec, stack = resolve_family(model)[:2]
    with torch.no_grad():  # layer 2 becomes the identity: its residual writes are zero
        for module in residual_output_modules(spec, stack[2]):
            module.weight.zero_()
    scores = adept_scores(model, None, retention_data=rows, batch_size=2)
    assert len(scores) == 5
    assert scores[3] == pytest.approx(0.0, abs=1e-6)  # k = 3 copies layer 2: removing it costs nothing
    others = [s for k, s in enumerate(scores) if k != 3]
    assert any(abs(s) > 1e-3 for s in others)  # the other layers do something (so the test can fail)


def test_skipped_losses_restore_training_mode_and_refuse_bad_input():
    model = tiny_model("llama").train()
    rows = rows_for(model, n=2)
    out = skipped_layer_losses(model, rows, [1], batch_size=2)
    assert model.training and set(out["skipped"]) == {1} and math.isfinite(out["full"])
    assert len(resolve_family(model)[1]) == model.config.num_hidden_layers == 4
    with pytest.raises(ValueError, match=r"layers \[4\] are outside the stack \(0..3\)"):
        skipped_layer_losses(model, rows, [4])
    with pytest.raises(ValueError, match="pass retention_data"):
        adept_scores(model, [1])
    with pytest.raises(ValueError, match="position 9 is out of range"):
        adept_scores(model, [9], retention_data=rows)
    bad = [{**rows[0], "input_ids": rows[0]["input_ids"] + 10_000, "labels": rows[0]["labels"] + 10_000}]
    with pytest.raises(ValueError, match="retention data"):
        skipped_layer_losses(model, bad, [0])
    grown = grow_depth(tiny_model("llama"), [2])
    with pytest.raises(ValueError, match="was grown"):
        adept_scores(grown, [1], retention_data=rows)


def test_midas_is_the_middle():
    model = tiny_model("llama")  # 4 layers
    assert midas_scores(model) == [-2.0, -1.0, 0.0, -1.0, -2.0]
    assert midas_scores(model, [4, 2]) == [-2.0, 0.0]
    odd = tiny_model("llama", num_hidden_layers=3)
    scores = midas_scores(odd)
    assert scores == [-1.5, -0.5, -0.5, -1.5]  # two middles tie
    with pytest.raises(ValueError, match="out of range"):
        midas_scores(model, [5])


def test_predictor_scores_knows_the_rules():
    model = tiny_model("llama")
    rows = rows_for(model)
    out = predictor_scores(model, rows, [3, 1], which=("midas", "adept", "depth"), retention_data=rows, batch_size=2)
    assert list(out["scores"]) == ["midas", "adept", "depth"]
    assert out["scores"]["midas"] == [-1.0, -1.0]
    assert out["scores"]["adept"] == adept_scores(model, [3, 1], retention_data=rows, batch_size=2)
    assert all(out["seconds"][n] >= 0 for n in out["seconds"])
    with pytest.raises(ValueError, match="pass retention_data"):
        predictor_scores(model, rows, [1], which=("adept",))
    with pytest.raises(ValueError, match="valid names: .*adept, midas"):
        predictor_scores(model, rows, [1], which=("ADEPT",))
