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
