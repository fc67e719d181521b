"""`evaluate_delta` reads every form of the data contract (`hf_depthgrow.data.batches`) the same way.

The same examples as a `datasets.Dataset`, a list of rows, a DataLoader, a list of batch dicts and
one batch dict give the same per-example losses, deltas and intervals, for a grown decoder, a
post-norm encoder classifier with an adapter block and a ViT.
"""

import copy

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.data.batches import DataFormError, as_batches
from hf_depthgrow.evaluation import compare_models, evaluate_delta
from hf_depthgrow.testing import tiny_inputs, tiny_model

N, BATCH = 10, 4  # 3 batches, the last one short
SETTINGS = dict(batch_size=BATCH, loss_bound=10.0, n_bootstrap=200, seed=0, use_evaluate=False)


def _perturb_new_blocks(model, scale: float, seed: int = 0):
    # New blocks start with zero output weights (the grown model is exact); a small change makes the delta non-zero.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in new_block_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=g))


def _grown(model_type: str):
    """A grown tiny model and one batch of its test data (labels match its head)."""
    block, position, scale = {"llama": ("native", 2, 0.05), "bert": ("adapter", 1, 0.5), "vit": ("native", 2, 0.05)}[model_type]
    model = tiny_model(model_type)
    head = type(model).__name__
    assert head == {"llama": "LlamaForCausalLM", "bert": "BertForSequenceClassification", "vit": "ViTForImageClassification"}[model_type]
    # Both kinds start with zero output weights, so the grown model is exact until perturbed.
    grown = grow_depth(model, [position], block=block, **({"init": "random"} if block == "native" else {}))
    _perturb_new_blocks(grown, scale)
    batch = tiny_inputs(grown, batch=N, seq=9, seed=7)
    if model_type == "llama":
        batch["labels"][2, :5] = -100  # one example with fewer supervised tokens
    return grown, batch


def _rows(batch):
    return [{k: v[i] for k, v in batch.items()} for i in range(N)]


def _forms(batch) -> dict:
    rows = _rows(batch)
    dataset = datasets.Dataset.from_dict({k: v.numpy() for k, v in batch.items()}).with_format("torch")
    return {
        "dataset": dataset,
        "rows": rows,
        "dataloader": DataLoader(rows, batch_size=BATCH, shuffle=False),
        "batches": list(as_batches(rows, batch_size=BATCH)),
        "one batch": dict(batch),
    }


def _same(result, reference, *, exact: bool):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.per_example_old, reference.per_example_old, **tol)
    np.testing.assert_allclose(result.per_example_new, reference.per_example_new, **tol)
    np.testing.assert_allclose(result.mean_delta, reference.mean_delta, **tol)
    np.testing.assert_allclose(result.delta, reference.delta, **tol)
    for name, interval in reference.intervals.items():
        np.testing.assert_allclose(result.intervals[name], interval, **tol)
    assert result.example_ids == reference.example_ids == list(range(N))
    assert result.num_examples == N


@pytest.mark.parametrize("model_type", ["llama", "bert", "vit"])
def test_every_data_form_gives_the_same_result(model_type):
    grown, batch = _grown(model_type)
    results = {name: evaluate_delta(grown, data, **SETTINGS) for name, data in _forms(batch).items()}
    reference = results["rows"]
    assert abs(reference.mean_delta) > 1e-5  # the perturbed block changes the model
    for name, result in results.items():
        # Same batches (4 + 4 + 2) are bit-identical; one batch of 10 differs only by float summation order.
        _same(result, reference, exact=name != "one batch")
    expected_task = "causal_lm" if model_type == "llama" else "classification"
    assert {r.task for r in results.values()} == {expected_task}


def test_compare_models_reads_every_form_too():
    base = tiny_model("llama")
    grown = grow_depth(copy.deepcopy(base), [2], block="native", init="random")
    _perturb_new_blocks(grown, 0.05)
    batch = tiny_inputs(grown, batch=N, seq=9, seed=7)
    results = {name: compare_models(base, grown, data, **SETTINGS) for name, data in _forms(batch).items()}
    for name, result in results.items():
        _same(result, results["rows"], exact=name != "one batch")


def test_list_of_one_batch_is_a_batch_not_rows():
    """Regression: `[batch_dict]` was read as a list of rows and crashed inside BERT with a shape error."""
    grown, batch = _grown("bert")
    as_list = evaluate_delta(grown, [dict(batch)], **SETTINGS)
    as_dict = evaluate_delta(grown, dict(batch), **SETTINGS)
    _same(as_list, as_dict, exact=True)
    two = evaluate_delta(grown, [{k: v[:6] for k, v in batch.items()}, {k: v[6:] for k, v in batch.items()}], **SETTINGS)
    _same(two, as_dict, exact=False)


def test_forms_the_contract_cannot_read_are_refused():
    grown, batch = _grown("bert")
    rows = _rows(batch)
    with pytest.raises(DataFormError, match="cannot tell a row from a batch"):
        evaluate_delta(grown, [{"labels": r["labels"]} for r in rows], **SETTINGS)  # no model input
    with pytest.raises(DataFormError, match="mixes rows and batches"):
        evaluate_delta(grown, [rows[0], dict(batch)], **SETTINGS)
    with pytest.raises(DataFormError, match="must be a batch"):
        evaluate_delta(grown, rows[0], **SETTINGS)  # one row given as data
    with pytest.raises(DataFormError, match="batch dicts"):
        evaluate_delta(grown, iter(rows), **SETTINGS)  # an iterator is read as batches; these are rows
    with pytest.raises(DataFormError):
        evaluate_delta(grown, 42, **SETTINGS)


def test_hand_written_batch_of_lists_is_read():
    """A batch dict of nested Python lists (the contract counts their nesting) is evaluated like tensors."""
    grown, batch = _grown("bert")
    listed = evaluate_delta(grown, {k: v.tolist() for k, v in batch.items()}, **SETTINGS)
    _same(listed, evaluate_delta(grown, dict(batch), **SETTINGS), exact=True)
