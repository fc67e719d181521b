"""Baseline predictors of where a new block helps: exact against autograd and hidden states,
side-effect free, aligned with the positions asked for."""

import copy
import math

import pytest
import torch

from hf_depthgrow.data.batches import as_batches
from hf_depthgrow.growth.families import residual_output_modules
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.chunked_loss import batch_example_losses
from hf_depthgrow.probe import (
    PREDICTORS,
    block_influence,
    layer_gradient_norms,
    lookahead_scores,
    one_step_check,
    predictor_scores,
)
from hf_depthgrow.probe.signal import probe
from hf_depthgrow.testing import tiny_inputs, tiny_model


def batches_for(model, n=3):
    return [tiny_inputs(model, seed=s) for s in range(n)]


def manual_gradient_norm(model, batches, layer):
    """Reference: the mean loss over all batches, autograd on a copy with respect to one layer's parameters."""
    model = copy.deepcopy(model)
    params = list(resolve_family(model)[1][layer].parameters())
    total, weight = 0.0, 0.0
    for batch in batches:
        losses = batch_example_losses(model, batch)
        total, weight = total + losses.total.sum(), weight + losses.weight.sum()
    grads = torch.autograd.grad(total / weight, params)
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


@pytest.mark.parametrize("model_type", ["llama", "vit"])
def test_gradient_norm_equals_autograd(model_type):
    model = tiny_model(model_type)
    batches = batches_for(model)
    positions = [4, 0, 1, 3]  # any order: the scores follow it
    norms = layer_gradient_norms(model, batches, positions)
    for k, norm in zip(positions, norms):
        expected = manual_gradient_norm(model, batches, max(k - 1, 0))
        assert expected > 0
        assert norm == pytest.approx(expected, rel=1e-5), k
    assert norms[1] == norms[2]  # k = 0 and k = 1 both copy layer 0


def test_gradient_norm_reads_every_data_form():
    model = tiny_model("llama")
    batches = batches_for(model, n=2)
    rows = [{key: value[i] for key, value in b.items()} for b in batches for i in range(2)]
    expected = layer_gradient_norms(model, batches, [2])
    assert layer_gradient_norms(model, rows, [2], batch_size=2) == pytest.approx(expected, rel=1e-6)
    assert layer_gradient_norms(model, iter(batches), [2]) == pytest.approx(expected, rel=1e-6)
    # max_batches keeps the first batch only: the same as passing that batch alone
    assert layer_gradient_norms(model, batches, [2], max_batches=1) == pytest.approx(
        layer_gradient_norms(model, batches[0], [2]), rel=1e-6)


def test_block_influence_matches_hidden_states_with_padding():
    model = tiny_model("llama")
    lengths = [12, 7, 9, 5]
    rows = [{"input_ids": torch.arange(2, 2 + n), "attention_mask": torch.ones(n, dtype=torch.long)} for n in lengths]
    influence = block_influence(model, rows, [0, 1, 2, 3], batch_size=4)
    (batch,) = list(as_batches(rows, batch_size=4))
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].bool()
    for k, value in zip([0, 1, 2, 3], influence):
        j = max(k - 1, 0)  # j + 1 < L: hidden_states[j + 1] is layer j's output before any final norm
        cos = torch.nn.functional.cosine_similarity(hidden[j].double(), hidden[j + 1].double(), dim=-1)
        assert value == pytest.approx(float((1 - cos)[mask].mean()), rel=1e-6), k


@pytest.mark.parametrize("model_type", ["llama", "vit"])
def test_block_influence_is_zero_for_an_identity_layer(model_type):
    model = tiny_model(model_type)
    spec, stack, _ = resolve_family(model)
    with torch.no_grad():
        for module in residual_output_modules(spec, stack[1]):
            for p in module.parameters():
                p.zero_()
    influence = block_influence(model, batches_for(model, n=2), None)
    assert influence[2] == 0.0  # the block at k = 2 copies layer 1, which now adds nothing
    assert all(v > 0 for i, v in enumerate(influence) if i != 2)


def _state(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def _assert_state(model, state):
    weights, flags, grads, modes = state
    now = _state(model)
    assert all(torch.equal(weights[n], now[0][n]) for n in weights)
    assert flags == now[1] and modes == now[3]
    assert all((grads[n] is None) == (now[2][n] is None) for n in grads)
    assert all(torch.equal(grads[n], now[2][n]) for n in grads if grads[n] is not None)


def _odd_model():
    """A model in train mode with some flags off and some .grad set: all of it must survive."""
    model = tiny_model("llama").train()
    for i, p in enumerate(model.parameters()):
        p.requires_grad_(i % 3 != 0)
        if i % 5 == 0:
            p.grad = torch.full_like(p, 0.5)
    return model


@pytest.mark.parametrize("fn", [
    lambda m, d: layer_gradient_norms(m, d, None),
    lambda m, d: block_influence(m, d, None),
    lambda m, d: one_step_check(m, d, 2, learning_rate=1e-3, max_batches=2),
    lambda m, d: predictor_scores(m, d, [1, 4], which=("signal", "z", "gradient_norm", "block_influence", "depth")),
])
def test_model_left_unchanged(fn):
    model = _odd_model()
    state = _state(model)
    fn(model, batches_for(model, n=2))
    _assert_state(model, state)
    bad = {**tiny_inputs(model), "labels": torch.full((2, 12), 10_000)}  # out of vocabulary: refused mid-run
    with pytest.raises(ValueError, match="batch 1"):
        fn(model, [tiny_inputs(model), bad])
    _assert_state(model, state)


def test_one_step_check_is_first_order_at_a_small_step():
    model = tiny_model("llama")
    for k in (0, 2, 4):
        check = one_step_check(model, batches_for(model, n=2), k, learning_rate=1e-3, max_batches=2)
        assert check["position"] == k and check["predicted"] < 0
        assert abs(check["ratio"] - 1) < 0.05, check
        assert check["realized"] == pytest.approx(check["predicted"], rel=0.05)


def test_lookahead_is_finite_deterministic_and_leaves_the_model():
    model = tiny_model("llama")
    rows, held_out = batches_for(model, n=2), tiny_inputs(model, batch=4, seed=9)
    state = _state(model)
    torch.manual_seed(123)
    first = lookahead_scores(model, rows, [4, 2], eval_data=held_out, steps=2, batch_size=2, seed=3)
    after_first = torch.rand(1)  # train() seeds globally: the caller's random stream must be as it was
    torch.manual_seed(123)
    second = lookahead_scores(model, iter(rows), [4, 2], eval_data=held_out, steps=2, batch_size=2, seed=3)
    assert torch.equal(after_first, torch.rand(1))
    assert first == second
    assert len(first) == 2 and all(math.isfinite(s) for s in first) and any(s != 0 for s in first)
    _assert_state(model, state)


def test_predictor_scores_aligned_for_every_name():
    model = tiny_model("llama")
    data, held_out = batches_for(model, n=3), tiny_inputs(model, batch=4, seed=9)
    positions = [3, 0, 4]
    out = predictor_scores(model, data, positions, eval_data=held_out, steps=1, batch_size=2)
    assert out["positions"] == positions
    assert list(out["scores"]) == list(PREDICTORS) == list(out["seconds"])
    for name, scores in out["scores"].items():
        assert len(scores) == 3 and all(math.isfinite(s) for s in scores), name
        assert out["seconds"][name] >= 0
    assert out["scores"]["depth"] == [3.0, 0.0, 4.0]
    result = probe(model, data, positions=positions, progress=False, batch_size=2)
    assert out["scores"]["signal"] == pytest.approx([result.signal[result.positions.index(k)] for k in positions])
    assert out["scores"]["gradient_norm"] == layer_gradient_norms(model, data, positions, batch_size=2)
    assert out["scores"]["block_influence"] == block_influence(model, data, positions, batch_size=2)
    # a probe run handed in is re-ordered to the positions asked for; its cost is not ours to measure
    given = predictor_scores(model, data, [4, 3], probe_result=result, which=("z",))
    assert given["scores"]["z"] == [result.z[2], result.z[1]] and math.isnan(given["seconds"]["z"])


def test_predictor_scores_bad_input():
    model = tiny_model("llama")
    data = batches_for(model, n=3)
    with pytest.raises(ValueError, match="valid names: signal, z, gradient_norm"):
        predictor_scores(model, data, [1], which=("depth", "oracle"))
    result = probe(model, data, positions=[0, 2], progress=False)
    with pytest.raises(ValueError, match=r"no score for positions \[3\]"):
        predictor_scores(model, data, [2, 3], probe_result=result, which=("signal",))
    with pytest.raises(ValueError, match="pass eval_data"):
        predictor_scores(model, data, [1], which=("lookahead",))
    with pytest.raises(ValueError, match="unknown option"):
        predictor_scores(model, data, [1], which=("depth",), learning_rte=1e-3)
    with pytest.raises(ValueError, match="out of range"):
        layer_gradient_norms(model, data, [5])
    with pytest.raises(ValueError, match="steps must be"):
        lookahead_scores(model, data, [1], eval_data=data, steps=0)
    with pytest.raises(ValueError, match="learning_rate"):
        one_step_check(model, data, 1, learning_rate=-1.0)
