"""Stepping-stone models (docs/theory.md §3): a first-order step of the new block that lowers the training loss."""

import copy
import importlib
import json
import math

import pytest
import torch

from hf_depthgrow.growth.engine import grow_depth
from hf_depthgrow.growth.record import growth_record
from hf_depthgrow.chunked_loss import batch_example_losses
from hf_depthgrow.probe.signal import probe
from hf_depthgrow.probe.stepping_stone import stepping_stone, stepping_stones
from hf_depthgrow.testing import model_output, tiny_inputs, tiny_model



def batches_for(model, n=4, seed=0):
    return [tiny_inputs(model, seed=seed + s) for s in range(n)]


def mean_loss(model, batches):
    with torch.no_grad():
        parts = [batch_example_losses(model, b) for b in batches]
    return float(sum(p.total.sum() for p in parts) / sum(p.weight.sum() for p in parts))


@pytest.mark.parametrize("model_type, position", [("llama", 2), ("bert", 4), ("vit", 0)])
def test_stepping_stone_lowers_training_loss(model_type, position):
    model = tiny_model(model_type)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = batches_for(model)
    stone, info = stepping_stone(model, position, batches)
    assert info.eta > 0 and info.loss_stone < info.loss_old
    assert abs(info.loss_old - mean_loss(model, batches)) < 1e-6
    assert abs(info.loss_stone - mean_loss(stone, batches)) < 1e-6
    assert info.slope == pytest.approx(-info.grad_norm, rel=1e-6)
    assert growth_record(stone).history[0].positions == (position,)
    # The original is untouched.
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    # Only the zero-initialised output parameters moved, by exactly eta.
    fresh = grow_depth(copy.deepcopy(model), [position], block="auto")
    moved = {k: v for k, v in stone.state_dict().items() if not torch.equal(v, fresh.state_dict()[k])}
    assert moved and all(float(fresh.state_dict()[k].abs().max()) == 0.0 for k in moved)
    assert torch.sqrt(sum(v.double().square().sum() for v in moved.values())) == pytest.approx(info.eta, rel=1e-5)


def test_first_order_drop_matches_eta_times_gradient_norm():
    model = tiny_model("llama").double()
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches_for(model)]
    errors = []
    for eta in (1e-1, 1e-2, 1e-3):
        _, info = stepping_stone(model, 2, batches, etas=[eta])
        assert info.eta == eta
        assert info.predicted_first_order == pytest.approx(info.loss_old - eta * info.grad_norm)
        errors.append(abs(info.loss_drop / (eta * info.grad_norm) - 1))
    assert errors[0] > errors[1] and errors[2] < 0.01  # ratio -> 1 as eta -> 0


def test_no_signal_means_no_step():
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    batches = batches_for(model, n=3)
    stone, info = stepping_stone(model, 1, batches)
    assert info.grad_norm == 0.0 and info.eta == 0.0 and info.loss_stone == info.loss_old
    assert torch.equal(model_output(stone, batches[0]), model_output(model, batches[0]))


def test_held_out_direction_gives_population_stone():
    model = tiny_model("llama")
    train, held_out = batches_for(model, n=3), batches_for(model, n=3, seed=10)
    _, info = stepping_stone(model, 3, train, direction_data=held_out, etas=[1e-2, 1e-1, 1.0])
    assert info.direction == "held-out"
    g_train = probe(model, train, positions=[3], progress=False).signal[0]
    assert abs(info.slope) <= g_train * (1 + 1e-5)  # |<G_S, v>| <= ||G_S|| for a unit v
    assert info.grad_norm == pytest.approx(probe(model, held_out, positions=[3], progress=False).signal[0], rel=1e-6)
    data = json.loads(json.dumps(info.to_dict()))
    assert data["direction"] == "held-out" and len(data["line_search"]) == 4  # eta = 0 and the three given


@pytest.mark.parametrize("model_type, position", [("llama", 3), ("bert", 1)])
@pytest.mark.parametrize("given_gradient", [False, True])
def test_both_stones_from_one_set_up_equal_two_calls_bit_for_bit(model_type, position, given_gradient):
    model = tiny_model(model_type)
    train, held_out = batches_for(model), batches_for(model, n=3, seed=10)
    gradient = None
    if given_gradient:
        kept = probe(model, train, positions=[position], keep_gradients=True, progress=False)
        gradient = kept.gradients[0]
    alone_s = stepping_stone(model, position, train, gradient=gradient)
    alone_pop = stepping_stone(model, position, train, direction_data=held_out, gradient=gradient)
    both = stepping_stones(model, position, train, held_out, gradient=gradient)
    inputs = tiny_inputs(model, seed=7)
    for (stone, info), (alone, alone_info) in ((both["train"], alone_s), (both["held_out"], alone_pop)):
        assert info.to_dict() == alone_info.to_dict()  # eta, losses, the whole line search
        assert all(torch.equal(a, b) for a, b in zip(stone.state_dict().values(), alone.state_dict().values()))
        assert torch.equal(model_output(stone, inputs), model_output(alone, inputs))
    assert both["train"][1].direction == "train" and both["held_out"][1].direction == "held-out"


def test_both_stones_compute_the_prefix_and_the_original_loss_once(monkeypatch):
    # Two separate calls run the layers below the block twice per line-search batch and score the
    # original twice; one set-up runs them once (and G_S once).
    # `hf_depthgrow.probe` is bound to the function: the modules come by their full names.
    line_search = importlib.import_module("hf_depthgrow.probe.line_search")
    module = importlib.import_module("hf_depthgrow.probe.stepping_stone")

    model = tiny_model("llama")
    train, held_out = batches_for(model), batches_for(model, n=3, seed=10)
    counts = {"prefix": 0, "eta0": 0, "probe": 0}
    real_prefix, real_mean, real_probe = line_search.prefix_hidden, line_search._mean_loss, module.probe

    def prefix(*args, **kwargs):
        counts["prefix"] += 1
        return real_prefix(*args, **kwargs)

    def mean(model, batches, prefixes, index):
        if all(not p.detach().abs().sum() for n, p in model.named_parameters() if n.endswith("o_proj.weight") and ".3." in n):
            counts["eta0"] += 1
        return real_mean(model, batches, prefixes, index)

    def counted_probe(*args, **kwargs):
        counts["probe"] += 1
        return real_probe(*args, **kwargs)

    monkeypatch.setattr(line_search, "prefix_hidden", prefix)
    monkeypatch.setattr(line_search, "_mean_loss", mean)
    monkeypatch.setattr(module, "probe", counted_probe)
    stepping_stones(model, 3, train, held_out)
    assert counts == {"prefix": len(train), "eta0": 1, "probe": 2}  # G_S once, G_pop once
    counts.update(prefix=0, eta0=0, probe=0)
    stepping_stone(model, 3, train)
    stepping_stone(model, 3, train, direction_data=held_out)
    assert counts == {"prefix": 2 * len(train), "eta0": 2, "probe": 3}


def test_both_stones_refuse_unknown_arguments():
    model = tiny_model("llama")
    train = batches_for(model, n=2)
    with pytest.raises(TypeError, match="held_out, not direction_data"):
        stepping_stones(model, 1, train, train, direction_data=train)
    with pytest.raises(TypeError, match="unexpected arguments"):
        stepping_stones(model, 1, train, train, learning_rate=1.0)


def test_stepping_stone_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    batches = batches_for(model, n=3)
    stone, info = stepping_stone(model, 4, batches)
    stone.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.num_hidden_layers == model.config.num_hidden_layers + 1
    assert torch.allclose(model_output(again, batches[0]), model_output(stone, batches[0]), atol=1e-6)
    assert abs(mean_loss(again, batches) - info.loss_stone) < 1e-5


def test_rejects_bad_etas():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="etas"):
        stepping_stone(model, 1, batches_for(model, n=2), etas=[0.0])


@pytest.mark.parametrize("model_type, position", [("llama", 3), ("bert", 1)])
def test_probe_gradient_reuse_gives_the_same_stone(model_type, position):
    # The pipeline hands the probe's G_S over instead of probing the training data again.
    model = tiny_model(model_type)
    batches = batches_for(model)
    kept = probe(model, batches, keep_gradients=True, progress=False)
    gradient = kept.gradients[kept.positions.index(position)]
    a, info_a = stepping_stone(model, position, batches)
    b, info_b = stepping_stone(model, position, batches, gradient=gradient)
    assert info_b.block == info_a.block and info_b.direction == "train"
    assert info_b.eta == pytest.approx(info_a.eta, rel=1e-6) and info_b.loss_stone == pytest.approx(info_a.loss_stone, rel=1e-6)
    inputs = tiny_inputs(model, seed=9)
    assert torch.allclose(model_output(a, inputs), model_output(b, inputs), atol=1e-6)


def test_gradient_of_another_block_is_refused():
    model = tiny_model("llama")
    batches = batches_for(model)
    kept = probe(model, batches, positions=[1], keep_gradients=True, block="adapter", progress=False)
    with pytest.raises(ValueError, match="does not belong to the block"):
        stepping_stone(model, 1, batches, gradient=kept.gradients[0], block="native")
    with pytest.raises(ValueError, match="non-empty dict"):
        stepping_stone(model, 1, batches, gradient={})


# ----------------------------------------------------------------------------- the line search itself


def _trace(fn, eta0, refine_steps=2):
    """Run `line_search` on a loss curve `fn(eta)`; returns `(best eta, its loss, evaluations)`."""
    from hf_depthgrow.probe.line_search import line_search

    seen = {}

    def loss_at(eta):
        if eta not in seen:
            seen[eta] = fn(eta)
        return seen[eta]

    line_search(loss_at, eta0=eta0, expand=4.0, max_expand=12, refine_steps=refine_steps)
    best = min(seen, key=lambda e: (seen[e], e))
    return best, seen[best], len(seen)


@pytest.mark.parametrize("minimum", [0.03, 1.0, 7.0, 40.0])
def test_line_search_lands_near_the_minimum_of_a_quadratic(minimum):
    # L(eta) = 4 - 2 m eta + eta^2: minimum 4 - m^2 at eta = m, first step where the linear gain is 1% of L(0)
    best, loss, evals = _trace(lambda e: 4 - 2 * minimum * e + e * e, eta0=0.01 * 4 / (2 * minimum))
    assert 4 - loss >= 0.94 * minimum**2  # the gain is within 6% of the best possible one
    assert abs(math.log(best / minimum)) < math.log(1.5)
    assert evals <= 13  # L(0), the bracket (geometric, by 4 from eta0) and two refinement steps


def test_line_search_on_a_curve_that_flattens_needs_few_passes():
    # The shape of SmolLM2's stepping stones: the gain keeps accruing long after the linear term fades,
    # then overshoots steeply (docs/examples/run_smollm2/stepping_stones.json: best near eta 5, loss 5.3 at 26).
    def curve(e):
        return 4.51 - 0.35 * math.log1p(e) + 0.004 * e * e

    grid = min(curve(e / 100) for e in range(1, 4000))
    best, loss, evals = _trace(curve, eta0=1e-2 * 4.51 / 0.35)
    assert 4.51 - loss >= 0.95 * (4.51 - grid)  # within 5% of the grid minimum's gain
    assert evals <= 8  # the search before (0.1% start, golden section) spent 10 on such a curve


def test_line_search_shrinks_under_strong_curvature_and_gives_up_when_nothing_helps():
    best, loss, _ = _trace(lambda e: 3 - 0.1 * e + 50 * e * e, eta0=1.0)  # minimum at 0.001: shrink from 1.0
    assert 0 < best < 0.004 and loss < 3
    best, loss, evals = _trace(lambda e: 3 + e, eta0=1.0)  # every step is worse
    assert best == 0.0 and loss == 3 and evals == 1 + 1 + 12
    best, loss, _ = _trace(lambda e: 3 - e if e < 2 else math.inf, eta0=0.5)  # an overflowing step is never taken
    assert 0 < best < 2 and math.isfinite(loss)
