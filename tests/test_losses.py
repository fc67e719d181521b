"""The per-example loss definition that probe, trainer and evaluator share."""

import pytest
import torch

from hf_depthgrow.chunked_loss import batch_example_losses
from hf_depthgrow.losses import IGNORE_INDEX, example_losses
from hf_depthgrow.testing import tiny_inputs, tiny_model


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
def test_causal_losses_match_the_models_own_loss(model_type):
    model = tiny_model(model_type)
    batch = tiny_inputs(model, batch=3, seq=10)
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][0, :4] = IGNORE_INDEX  # masked prompt
    batch["labels"][2, 7:] = IGNORE_INDEX
    own = model(**batch).loss
    parts = batch_example_losses(model, batch)
    assert float(parts.total.sum() / parts.weight.sum()) == pytest.approx(float(own), rel=1e-6)
    assert parts.weight.tolist() == [6.0, 9.0, 6.0]  # supervised next tokens: labels 1..9 minus the masked ones


def test_label_shift_equals_logit_shift_with_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[1, 2] = IGNORE_INDEX
    ours = example_losses(logits, labels, causal=True)
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(2, 5)
    assert torch.allclose(ours.total, ref.sum(1), atol=1e-6)
    (g1,) = torch.autograd.grad(ours.total.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-7) and float(g1[:, -1].abs().max()) == 0.0
