"""The trainer reads every form of the data contract (`hf_depthgrow.data.batches`) the same way.

The same examples given as a `datasets.Dataset`, a list of rows, a DataLoader of batches, a list or
iterator of batch dicts, or one batch dict must give the same run, bit for bit: the trainer turns
each into the same indexable rows (`as_rows`) before its seeded order picks from them.
"""

from __future__ import annotations

import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.data.batches import DataFormError
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training import GrownTrainer, TrainConfig, train

N, BATCH = 16, 4  # the DataLoader's batch size divides the data, so its batches hold every row in order


def lm_rows(n: int, seed: int = 0) -> list[dict]:
    """Causal LM rows (`tiny_model("llama")` is a LlamaForCausalLM): labels are the inputs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (n, 12), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def cls_rows(n: int, seed: int = 0) -> list[dict]:
    """Sequence classification rows (`tiny_model("bert")`: BertForSequenceClassification, 3 labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (n, 10), generator=g)
    ys = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, ys)]


def image_rows(n: int, seed: int = 0) -> list[dict]:
    """Image classification rows (`tiny_model("vit")`: ViTForImageClassification, 16x16x3, 3 labels)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3, 16, 16, generator=g)
    ys = torch.randint(0, 3, (n,), generator=g)
    return [{"pixel_values": p, "labels": y} for p, y in zip(pixels, ys)]


MODELS = {
    "llama": (lm_rows, "native"),
    "bert": (cls_rows, "adapter"),  # post-norm encoder: the adapter block
    "vit": (image_rows, "native"),
}


def stack(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def as_form(rows: list[dict], form: str):
    if form == "rows":
        return rows
    if form == "dataset":
        import datasets

        return datasets.Dataset.from_dict({k: v.numpy() for k, v in stack(rows).items()}).with_format("torch")
    if form == "dataloader":
        return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    chunks = [stack(rows[i : i + BATCH]) for i in range(0, len(rows), BATCH)]
    if form == "batch_list":
        return chunks
    if form == "batch_iterator":
        return iter(chunks)  # one-shot: read once
    if form == "one_batch":
        return stack(rows)
    raise AssertionError(form)


FORMS = ["rows", "dataset", "dataloader", "batch_list", "batch_iterator", "one_batch"]


def run(model_type: str, form: str):
    make_rows, block = MODELS[model_type]
    model = grow_depth(tiny_model(model_type), [2], block=block)
    config = TrainConfig(max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                         progress_bar=False, fallback=True, eval_steps=1)
    result = train(model, as_form(make_rows(N), form), eval_data=as_form(make_rows(8, seed=1), form), config=config)
    weights = {n: p.detach().clone() for n, p in new_block_parameters(result.model)}
    return result, weights


@pytest.mark.parametrize("model_type", list(MODELS))
def test_every_form_gives_the_same_run(model_type):
    torch.set_num_threads(1)
    reference, ref_weights = run(model_type, "rows")
    assert reference.num_train_examples == N and len(reference.history) == 2
    for form in FORMS[1:]:
        result, weights = run(model_type, form)
        assert result.history[0]["loss"] == reference.history[0]["loss"], form  # the first step, exactly
        assert [h["loss"] for h in result.history] == [h["loss"] for h in reference.history], form
        assert weights.keys() == ref_weights.keys()
        for name, value in ref_weights.items():
            assert torch.equal(weights[name], value), (form, name)  # identical after 2 steps
        assert result.eval_history == reference.eval_history, form  # eval data in the same form
        assert result.train_losses == reference.train_losses, form  # the fallback rule's L_S too
        assert result.selected == reference.selected


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: [1, 2, 3], "must hold dicts"),
        (lambda: {"labels": torch.zeros(4, dtype=torch.long)}, "no model input"),
        (lambda: [{"text": "hello", "labels": 1}], "no model input"),
        (lambda: "some text", "cannot read data of type str"),
        (lambda: 42, "cannot read data of type int"),
        (lambda: iter([torch.zeros(4, 8)]), "batch dicts"),  # a fresh one-shot iterator per test
    ],
    ids=["list_of_ints", "dict_without_inputs", "rows_without_inputs", "string", "int", "iterator_of_tensors"],
)
@pytest.mark.parametrize("argument", ["train_data", "eval_data"])
def test_bad_forms_are_refused_before_any_work(bad, match, argument):
    model = grow_depth(tiny_model("llama"), [2])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = {"train_data": lm_rows(8), "eval_data": lm_rows(4), argument: bad()}
    with pytest.raises(DataFormError, match=match) as err:
        GrownTrainer(model, TrainConfig(max_steps=1, progress_bar=False), data["train_data"], data["eval_data"])
    message = str(err.value)
    assert message.startswith(argument) and "Accepted: a datasets.Dataset, a list of row dicts" in message
    assert all(p.requires_grad for p in model.parameters())  # nothing was set up (no trainable set chosen)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "bad, match",
    [([], "empty"), (None, "empty"), ([{"input_ids": torch.arange(4)}], "labels")],
    ids=["empty_list", "none", "no_labels"],
)
def test_empty_or_unlabelled_train_data_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        train(grow_depth(tiny_model("llama"), [2]), bad, max_steps=1, progress_bar=False)


def test_empty_dataset_is_refused():
    import datasets

    empty = datasets.Dataset.from_dict({"input_ids": [], "labels": []})
    with pytest.raises(ValueError, match="train_data is empty"):
        train(grow_depth(tiny_model("llama"), [2]), empty, max_steps=1, progress_bar=False)


def test_rows_of_different_lengths_train_uncached_and_are_refused_by_the_cache():
    rows = lm_rows(8)
    short = [{k: v[:8] for k, v in r.items()} for r in rows[:4]]
    mixed = short + rows[4:]
    # Without the cache `collate` pads (labels with -100, so padding is never supervised).
    result = train(grow_depth(tiny_model("llama"), [2]), mixed, max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                   prefix_cache="off", progress_bar=False, fallback=False)
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    with pytest.raises(ValueError, match="fixed-size rows"):
        train(grow_depth(tiny_model("llama"), [2]), mixed, max_steps=2, per_device_train_batch_size=4, logging_steps=1,
              prefix_cache="memory", progress_bar=False, fallback=False)
