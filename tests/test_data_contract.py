"""The one data contract (`hf_depthgrow.data.batches`): every accepted form is read the same way, and `probe`
gives the same signals and z-scores whichever form the same examples come in."""

import itertools
import math

import pytest
import torch

from hf_depthgrow.data.batches import (
    ACCEPTED_FORMS,
    DataFormError,
    as_batches,
    as_rows,
    batch_size_of,
    collate,
    data_form,
    to_device,
)
from hf_depthgrow.probe.signal import probe
from hf_depthgrow.testing import tiny_inputs, tiny_model

datasets = pytest.importorskip("datasets")


def token_rows(n=5, seq=6):
    return [{"input_ids": torch.arange(seq) + i, "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": torch.arange(seq) + i} for i in range(n)]


def image_rows(n=5):
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(3, 4, 4, generator=g), "labels": torch.tensor(i % 3)} for i in range(n)]


def same_batches(a, b):
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# --------------------------------------------------------------------------- forms


def test_each_form_is_read_as_documented():
    rows = token_rows()
    batch = collate(rows[:2])
    assert data_form(datasets.Dataset.from_dict({"input_ids": [[1, 2]]})) == "rows"
    assert data_form(torch.utils.data.TensorDataset(torch.ones(2, 3))) == "rows"  # map-style torch Dataset
    assert data_form(rows) == "rows" and data_form(tuple(rows)) == "rows"
    assert data_form([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]) == "rows"  # Python lists count their nesting
    assert data_form(torch.utils.data.DataLoader(rows, batch_size=2)) == "batches"
    assert data_form([batch, batch]) == "batches"
    assert data_form(iter([batch])) == "batches"
    assert data_form(batch) == "batch"
    assert data_form({"pixel_values": torch.zeros(2, 3, 4, 4), "labels": torch.zeros(2)}) == "batch"


def test_rows_are_batched_in_order_and_re_iterable():
    rows = token_rows(5)
    batches = as_batches(rows, batch_size=2)
    assert len(batches) == 3
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2, 1]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), torch.stack([r["input_ids"] for r in rows]))
    assert same_batches(batches, batches)  # a second pass gives the same batches
    assert len(as_batches(rows, batch_size=2, max_batches=2)) == 2


def test_a_dataset_gives_the_same_batches_as_its_rows():
    rows = token_rows(5)
    ds = datasets.Dataset.from_dict({k: torch.stack([r[k] for r in rows]).tolist() for k in rows[0]}).with_format("torch")
    assert same_batches(as_batches(ds, batch_size=2), as_batches(rows, batch_size=2))


def test_batches_pass_through_and_one_shot_iterators_are_kept():
    rows = token_rows(4)
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    assert as_batches(loader) is loader
    listed = [collate(rows[:2]), collate(rows[2:])]
    assert as_batches(listed) is listed
    once = as_batches(iter(listed))
    assert same_batches(once, listed) and same_batches(once, listed)  # read once, kept for a second pass
    one = as_batches(listed[0])
    assert len(one) == 1 and same_batches(one, listed[:1])


def test_custom_collate_fn_is_used_for_rows():
    seen = []
    as_batches(token_rows(3), batch_size=2, collate_fn=lambda chunk: seen.append(len(chunk)) or collate(chunk))
    assert seen == []  # lazily, on iteration
    list(as_batches(token_rows(3), batch_size=2, collate_fn=lambda chunk: seen.append(len(chunk)) or collate(chunk)))
    assert seen == [2, 1]


# --------------------------------------------------------------------------- the rule on bad input


@pytest.mark.parametrize(
    "data, message",
    [
        ({"labels": torch.zeros(2)}, "no model input"),
        ({"input_ids": torch.zeros(3), "attention_mask": torch.zeros(2, 3)}, "cannot tell a row from a batch"),
        ({"input_ids": torch.zeros(2, 3, 4, 5)}, "cannot tell a row from a batch"),
        ({"input_ids": torch.zeros(3)}, "single row"),
        ([{"input_ids": torch.zeros(3)}, {"input_ids": torch.zeros(2, 3)}], "mixes rows and batches"),
        ([torch.zeros(3)], "must hold dicts"),
        (5, "cannot read data of type int"),
        ("text", "cannot read data of type str"),
    ],
)
def test_ambiguous_or_mixed_input_is_refused_with_the_accepted_forms(data, message):
    with pytest.raises(DataFormError, match=message) as info:
        as_batches(data)
    assert ACCEPTED_FORMS in str(info.value)


@pytest.mark.parametrize("data", [[], (), datasets.Dataset.from_dict({"input_ids": []})])
def test_empty_input_says_so(data):
    with pytest.raises(ValueError, match="empty"):
        as_batches(data)


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True])
def test_bad_batch_size(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        as_batches(token_rows(), batch_size=batch_size)


def test_an_iterable_of_rows_is_refused_by_as_rows():
    with pytest.raises(DataFormError, match="batch dicts"):
        as_rows(iter([{"input_ids": torch.zeros(3)}]))


# --------------------------------------------------------------------------- collate


def test_ragged_token_rows_are_right_padded_and_padding_is_not_supervised():
    rows = [
        {"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.ones(3, dtype=torch.long),
         "token_type_ids": torch.ones(3, dtype=torch.long), "labels": torch.tensor([5, 6, 7]), "text": "abc"},
        {"input_ids": torch.tensor([8]), "attention_mask": torch.ones(1, dtype=torch.long),
         "token_type_ids": torch.ones(1, dtype=torch.long), "labels": torch.tensor([8]), "text": "d"},
    ]
    batch = collate(rows)
    assert "text" not in batch  # raw text is no model input
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["token_type_ids"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]


def test_python_list_rows_are_collated_like_tensors():
    batch = collate([{"input_ids": [1, 2], "labels": 0}, {"input_ids": [3], "labels": 1}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 0]] and batch["input_ids"].dtype == torch.long
    assert batch["labels"].tolist() == [0, 1]


def test_image_rows_are_stacked():
    rows = image_rows(3)
    batch = collate(rows)
    assert batch["pixel_values"].shape == (3, 3, 4, 4)
    assert torch.equal(batch["pixel_values"][1], rows[1]["pixel_values"]) and batch["labels"].tolist() == [0, 1, 2]


def test_python_float_rows_keep_the_default_float_dtype():
    ds = datasets.Dataset.from_dict({"pixel_values": torch.randn(2, 3, 4, 4).tolist(), "labels": [0, 1]})
    assert next(iter(as_batches(ds)))["pixel_values"].dtype == torch.float32


def test_max_batches_reads_only_that_many_from_an_iterator():
    count = itertools.count()

    def stream():
        for _ in range(100):
            next(count)
            yield {"input_ids": torch.zeros(2, 3, dtype=torch.long)}

    as_batches(stream(), max_batches=2)
    assert next(count) <= 3


def test_as_rows_batch_size_of_and_to_device():
    batches = as_batches(token_rows(5), batch_size=2)
    rows = as_rows(batches)
    assert len(rows) == 5 and torch.equal(rows[3]["input_ids"], token_rows(5)[3]["input_ids"])
    assert as_rows(token_rows(2))[0].keys() == token_rows(1)[0].keys()
    assert batch_size_of(next(iter(batches))) == 2
    moved = to_device({"input_ids": torch.zeros(2, 3), "id": ["a", "b"]}, "cpu")
    assert moved["id"] == ["a", "b"] and moved["input_ids"].device.type == "cpu"
    with pytest.raises(DataFormError, match="model input"):
        batch_size_of({"id": [1]})


# --------------------------------------------------------------------------- probe reads every form alike

N, B = 8, 2


def rows_for(model):
    batch = tiny_inputs(model, batch=N, seq=10, seed=3)
    return [{k: v[i] for k, v in batch.items()} for i in range(N)]


def forms(rows, batch_size):
    columns = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    ds = datasets.Dataset.from_dict({k: v.tolist() for k, v in columns.items()}).with_format("torch")
    batches = [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    return {
        "dataset": ds,
        "rows": rows,
        "loader": torch.utils.data.DataLoader(rows, batch_size=batch_size, collate_fn=collate),
        "batches": batches,
    }


def same_numbers(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("model_type, task", [("llama", "causal_lm"), ("bert", "classifier"), ("vit", "classifier")])
def test_probe_gives_the_same_signals_and_z_for_every_form(model_type, task):
    model = tiny_model(model_type)
    assert type(model).__name__.endswith({"causal_lm": "ForCausalLM", "classifier": "Classification"}[task])
    rows = rows_for(model)
    assert rows[0]["labels"].dim() == (1 if task == "causal_lm" else 0)  # token labels vs one class per example
    results = {name: probe(model, data, batch_size=B, progress=False) for name, data in forms(rows, B).items()}
    reference = results.pop("batches")
    assert reference.num_batches == N // B and reference.num_examples == N
    assert any(math.isfinite(z) for z in reference.z)
    for name, result in results.items():
        assert result.num_batches == N // B, name
        for key in ("signal", "population", "population_se", "z", "trace", "mean_var"):
            assert same_numbers(getattr(result, key), getattr(reference, key)), (name, key)
        assert result.loss == reference.loss and result.verdict == reference.verdict, name


@pytest.mark.parametrize("model_type", ["llama", "bert", "vit"])
def test_one_batch_dict_is_one_batch(model_type):
    model = tiny_model(model_type)
    rows = rows_for(model)
    one = probe(model, collate(rows), progress=False)
    as_one = probe(model, rows, batch_size=N, progress=False)
    split = probe(model, rows, batch_size=B, progress=False)
    assert one.num_batches == 1 and same_numbers(one.signal, as_one.signal) and same_numbers(one.z, as_one.z)
    # G_S is the gradient of the loss over all the data, however it is batched.
    assert torch.allclose(torch.tensor(one.signal), torch.tensor(split.signal), rtol=1e-4)


def test_a_label_column_is_read_as_labels():
    from hf_depthgrow.data.batches import collate

    batch = collate([{"input_ids": [1, 2], "label": 0}, {"input_ids": [3, 4], "label": 1}])
    assert "label" not in batch and batch["labels"].tolist() == [0, 1]


def test_max_batches_is_validated_and_streams_a_dataset():
    from hf_depthgrow.data.batches import as_batches

    rows = [{"input_ids": torch.arange(4), "labels": torch.arange(4)} for _ in range(10)]
    first = as_batches(rows, batch_size=3, max_batches=2)
    assert len(first) == 2 and [b["input_ids"].shape[0] for b in first] == [3, 3]
    assert [b["input_ids"].shape[0] for b in first] == [3, 3]  # re-iterable
    with pytest.raises(ValueError, match="max_batches must be an integer >= 1"):
        as_batches(rows, max_batches=0)


# --------------------------------------------------------------------------------------------------------------------
# The document column: carried with the data, never given to a model
# --------------------------------------------------------------------------------------------------------------------


def _rows_with_documents(model, documents):
    return [{**row, "document": torch.tensor(doc) if isinstance(doc, int) else doc} for row, doc in zip(rows_for(model), documents)]


@pytest.mark.parametrize("labels", [[0, 0, 1, 1, 2, 2, 3, 3], ["a", "a", "b", "b", "c", "c", "d", "d"]])
def test_the_document_column_survives_every_form_and_never_reaches_the_model(labels):
    from hf_depthgrow import evaluate_delta, grow_depth
    from hf_depthgrow.data.batches import documents_of
    from hf_depthgrow.evaluation.bounds import bootstrap_interval
    from hf_depthgrow.losses import model_inputs

    grown = grow_depth(tiny_model("llama"), [2], block="native")
    rows = _rows_with_documents(grown, labels)
    batch = collate(rows)
    assert "document" in batch and "document" not in model_inputs(batch)
    if isinstance(labels[0], int):
        for name, data in forms(rows, B).items():
            assert documents_of(data) == labels, name
    assert documents_of(rows) == labels and documents_of(rows_for(grown)) is None
    result = evaluate_delta(grown, rows, loss_bound=20.0, batch_size=B, n_bootstrap=300, metrics=False)
    assert result.example_documents == labels and result.num_documents == 4 and result.cluster_key == "document"
    diffs = [o - n for o, n in zip(result.per_example_old, result.per_example_new)]
    assert result.intervals["bootstrap"] == bootstrap_interval(diffs, 0.05, n_bootstrap=300, seed=0, clusters=labels)
    plain = evaluate_delta(grown, rows, loss_bound=20.0, batch_size=B, n_bootstrap=300, metrics=False, cluster_key=None)
    assert plain.cluster_key is None and plain.per_example_new == result.per_example_new  # the same losses
    assert plain.intervals["bootstrap"] == bootstrap_interval(diffs, 0.05, n_bootstrap=300, seed=0)


def test_a_cluster_key_the_data_lacks_is_one_line_before_any_forward(monkeypatch):
    from hf_depthgrow import evaluate_delta, grow_depth
    from hf_depthgrow.evaluation import paired

    grown = grow_depth(tiny_model("llama"), [2], block="native")
    monkeypatch.setattr(paired, "_run_paired", lambda *a, **k: pytest.fail("a model ran before the cluster key was checked"))
    with pytest.raises(ValueError) as err:
        evaluate_delta(grown, _rows_with_documents(grown, range(N)), loss_bound=20.0, cluster_key="page")
    assert str(err.value) == "cluster key 'page' is not a column of the data: no example names a 'page' to resample by"


def test_split_dataset_by_document_keeps_documents_on_one_side():
    from hf_depthgrow.data import split_dataset

    docs = [d for d in range(10) for _ in range(d % 3 + 2)]  # 10 documents of 2-4 blocks
    ds = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(len(docs))], "document": docs})
    parts = split_dataset(ds, {"train": 0.6, "held_out": 0.15, "test": 0.25}, seed=0, by="document")
    seen = [set(p["document"]) for p in parts.values()]
    assert all(seen) and not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert sum(len(p) for p in parts.values()) == len(docs) and len(parts["train"]) >= 0.5 * len(docs)
    assert split_dataset(ds, {"train": 0.6, "test": 0.4}, seed=0, by="document")["test"]["document"] == \
        split_dataset(ds, {"train": 0.6, "test": 0.4}, seed=0, by="document")["test"]["document"]  # seeded
    with pytest.raises(ValueError, match=r"cannot split by 'page': the data has no such column \(columns: input_ids, document\)"):
        split_dataset(ds, {"train": 0.5, "test": 0.5}, by="page")
    two = ds.select(range(5))  # documents 0 and 1 only
    with pytest.raises(ValueError, match="split 'test' would be empty: 2 distinct 'document' values cannot fill 3 splits"):
        split_dataset(two, {"train": 0.4, "held_out": 0.3, "test": 0.3}, by="document")


def test_causal_lm_blocks_name_the_document_each_block_starts_in():
    from hf_depthgrow.data import causal_lm_blocks, sampled_document_blocks

    class Chars:  # one id per character; EOS = 0
        eos_token_id = 0

        def __call__(self, texts, add_special_tokens=False, verbose=False):
            one = isinstance(texts, str)
            ids = [[ord(c) for c in t] for t in ([texts] if one else texts)]
            return {"input_ids": ids[0] if one else ids}

    texts = ["aaaaaaa", "bb", "cccccccccc"]  # with EOS: 8, 3 and 11 tokens
    blocks, docs = causal_lm_blocks(Chars(), texts, 4, with_documents=True)
    assert torch.equal(blocks, causal_lm_blocks(Chars(), texts, 4)) and docs.tolist() == [0, 0, 1, 2, 2]
    blocks, owners = sampled_document_blocks(Chars(), texts, 4, per_document=1, seed=0, documents=["A", "B", "C"])
    assert sorted(owners) == ["A", "C"]  # "bb" + EOS is shorter than a block
    for block, owner in zip(blocks.tolist(), owners):
        assert set(block) <= {ord(owner.lower()), 0}  # a block never mixes two documents
