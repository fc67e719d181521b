"""Gradient checkpointing: the new blocks get the same gradients as without it, above a frozen or cached prefix."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.growth.engine import new_block_modules
from hf_depthgrow.growth.prefix import lowest_new_index, prefix_hidden, start_at
from hf_depthgrow.testing import tiny_inputs, tiny_model
from hf_depthgrow.training.activation_checkpointing import activation_checkpointing, checkpointed_modules
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.trainable import setup_trainable
from hf_depthgrow.training.trainer import GrownTrainer

from test_trainer import lm_rows, quick


def _grown(family: str, block: str = "native"):
    """A grown tiny model with every weight but the new blocks' frozen (embeddings too), new blocks perturbed.

    A zero-initialised block has zero gradients in everything upstream of its output projections; random
    weights make every gradient of the block non-trivial, so an equality test cannot pass by accident.
    """
    model = grow_depth(tiny_model(family), [2], block=block)
    setup_trainable(model, TrainConfig())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    assert not any(p.requires_grad for p in model.get_input_embeddings().parameters())
    return model


def _count_recomputes(model) -> list[int]:
    # A submodule's hooks run in the forward and again in the recomputation (which calls `forward`, not `__call__`).
    calls = [0]
    first = next(m for m in new_block_modules(model)[0].children())
    first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _new_grads(model, batch, *, checkpointed: bool, cached: bool = False) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks in both runs (the recomputation replays the saved random state)
    index = lowest_new_index(model)
    cache = start_at(model, index, prefix_hidden(model, batch, index)) if cached else torch.enable_grad()
    with cache, activation_checkpointing(model, index, enabled=checkpointed):
        loss = model(**batch, use_cache=False).loss  # as the trainer runs it: a KV cache would grow in the recomputation
    loss.backward()  # after the context: the recomputation is bound at forward time
    grads = {n: p.grad.clone() for n, p in new_block_parameters(model) if p.grad is not None}
    assert len(grads) == len(list(new_block_parameters(model)))
    return grads


@pytest.mark.parametrize("family,block", [("llama", "native"), ("gpt2", "native"), ("gemma3_text", "native"), ("llama", "adapter")])
@pytest.mark.parametrize("cached", [False, True], ids=["frozen-prefix", "cached-prefix"])
def test_checkpointed_gradients_equal_plain(family, block, cached):
    model = _grown(family, block)
    model.train()
    batch = tiny_inputs(model, batch=2, seq=12)
    calls = _count_recomputes(model)
    plain = _new_grads(model, batch, checkpointed=False, cached=cached)
    assert calls[0] == 1
    ckpt = _new_grads(model, batch, checkpointed=True, cached=cached)
    assert calls[0] == 3  # forward + recomputation: the block really was checkpointed
    assert all(g.abs().max() > 0 for g in plain.values())
    for name, grad in plain.items():
        torch.testing.assert_close(ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert all("forward" not in m.__dict__ for m in checkpointed_modules(model, 0))  # the context restored the layers


def test_reentrant_checkpointing_loses_frozen_input_gradients():
    # Why the checkpointing is non-reentrant: with a frozen input, reentrant checkpointing cuts the new block
    # out of the graph without an error (the final norm trains here so that the loss still needs a gradient).
    model = _grown("llama")
    model.get_decoder().norm.weight.requires_grad_(True)
    batch = tiny_inputs(model)
    layer = new_block_modules(model)[0]
    layer.forward = lambda *a, _f=layer.forward, **k: checkpoint(functools.partial(_f, **k), *a, use_reentrant=True)
    model(**batch, use_cache=False).loss.backward()
    assert all(p.grad is None for _, p in new_block_parameters(model))
    del layer.forward
    model.zero_grad(set_to_none=True)
    with activation_checkpointing(model, lowest_new_index(model)):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    assert all(p.grad is not None for _, p in new_block_parameters(model))


@pytest.mark.parametrize("prefix_cache", ["memory", "off"])
def test_trainer_with_checkpointing_ends_at_the_same_weights(prefix_cache):
    rows = lm_rows(8)
    ends, recomputes = [], []
    for on in (False, True):
        model = grow_depth(tiny_model("llama"), [2])
        calls = _count_recomputes(model)
        cfg = quick(max_steps=3, prefix_cache=prefix_cache, gradient_checkpointing=on)
        GrownTrainer(model, cfg, rows).train()
        ends.append({n: p.detach().clone() for n, p in new_block_parameters(model)})
        recomputes.append(calls[0])
    assert recomputes[1] > recomputes[0]  # the trainer ran the checkpointed path
    for name, weight in ends[0].items():
        torch.testing.assert_close(ends[1][name], weight, rtol=1e-6, atol=1e-7, msg=name)


def test_gradient_checkpointing_flag():
    from hf_depthgrow.config import parse_args

    (cfg,) = parse_args(TrainConfig, argv=["--gradient-checkpointing"])
    assert cfg.gradient_checkpointing is True
    with pytest.raises(ValueError, match="gradient_checkpointing must be True or False"):
        TrainConfig(gradient_checkpointing="yes")


def test_run_and_compare_pass_the_flag_to_their_trainers():
    from hf_depthgrow.cli.compare import build_parser as compare_parser
    from hf_depthgrow.cli.run import build_parser as run_parser
    from hf_depthgrow.comparison.arms import Arm
    from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, train_config

    (run_cfg,) = run_parser().parse(["--gradient-checkpointing"])
    assert run_cfg.gradient_checkpointing is True
    parsed = compare_parser().parse(["--gradient-checkpointing"])
    compare_cfg = next(c for c in parsed if hasattr(c, "max_steps"))
    assert compare_cfg.gradient_checkpointing is True
    spec = TrialSpec(arm=Arm(name="top:1", kind="growth"), learning_rate=1e-3, seed=0, budgets=(2,))
    inputs = TrialInputs(base=None, train_rows=[], eval_rows=[], test_rows=[], retention_rows=None, batch_size=2,
                         selection_max_examples=None, lora_target_modules=None, grow_kwargs=None, original={},
                         gradient_checkpointing=compare_cfg.gradient_checkpointing)
    assert train_config(spec, inputs).gradient_checkpointing is True
