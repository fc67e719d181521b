"""Bad input to `probe`, `stepping_stone` and `load_data`: one clear error naming the problem, never a verdict
computed from garbage, and the model left exactly as it was (weights, flags, modes, hooks, grads)."""

import math
import re

import pytest
import torch

from hf_depthgrow.data.checks import check_batch
from hf_depthgrow.probe.signal import probe
from hf_depthgrow.probe.stepping_stone import stepping_stone
from hf_depthgrow.testing import tiny_inputs, tiny_model

NO_SUPERVISION = "the probe data has no supervised token: every label is -100"
MISMATCH = r"token ids outside the vocabulary: max id 500, min id \d+, but the model embeds 128 in examples \[1\]: the tokenizer does not match the model"


def lm_batches(model, n=3):
    return [tiny_inputs(model, batch=2, seq=8, seed=s) for s in range(n)]


def snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        {n: m.training for n, m in model.named_modules()},
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()),
    )


def assert_unchanged(model, before):
    state, flags, modes, hooks = before
    now = model.state_dict()
    assert state.keys() == now.keys()
    for k, v in state.items():  # NaN weights must stay NaN, bit for bit
        assert torch.equal(v.isnan(), now[k].isnan()) and torch.equal(v.nan_to_num(), now[k].nan_to_num()), k
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()) == hooks
    assert all(p.grad is None for p in model.parameters())


def unsupervised(model, n=3):
    batches = lm_batches(model, n)
    for b in batches:
        b["labels"][:] = -100
    return batches


def nan_weights(model):
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    return model


def mismatched(model):
    batches = lm_batches(model)
    batches[1]["input_ids"][1, 3] = 500  # the model embeds 128 tokens
    return batches


def lm_labels_out_of_vocab(model):
    batches = lm_batches(model)
    batches[0]["labels"][0, 4] = 300
    return batches


def inf_pixels(model):
    batches = [tiny_inputs(model, batch=2, seed=s) for s in range(3)]
    batches[2]["pixel_values"][0, 0, 0, 0] = math.inf
    return batches


def bad_classes(model):
    batches = [tiny_inputs(model, batch=3, seq=8, seed=s) for s in range(3)]
    batches[0]["labels"][2] = 7  # 3 classes
    return batches


def no_labels(model):
    return [{k: v for k, v in b.items() if k != "labels"} for b in lm_batches(model)]


def rows_of(model):
    batch = tiny_inputs(model, batch=4, seq=8)
    return [{k: v[i] for k, v in batch.items()} for i in range(4)]


# (id, model type, model edit, data, probe kwargs, exact error class, message regex)
PROBE_CASES = [
    ("all labels -100", "llama", None, unsupervised, {}, ValueError, NO_SUPERVISION),
    ("all labels -100, no covariance", "llama", None, unsupervised, dict(covariance=False), ValueError, NO_SUPERVISION),
    ("NaN weights", "llama", nan_weights, lm_batches, {}, ValueError,
     r"the loss is nan on batch 0 \(counting from 0\): the model or data produce non-finite values"),
    ("inf pixels", "vit", None, inf_pixels, {}, ValueError, r"the loss is nan on batch 2 .*non-finite values"),
    ("empty data", "llama", None, lambda m: [], {}, ValueError, r"the data is empty: no example to read"),
    ("data without labels", "llama", None, no_labels, {}, ValueError, r"the probe data \(batch 0\) has no 'labels'"),
    ("tokenizer larger than the embedding", "llama", None, mismatched, {}, ValueError, r"the probe data \(batch 1\): " + MISMATCH),
    ("label ids beyond the output vocabulary", "llama", None, lm_labels_out_of_vocab, {}, ValueError,
     r"the probe data \(batch 0\): label ids outside the output vocabulary: max id 300, but the model predicts 128 in examples \[0\]"),
    ("class labels beyond num_labels", "bert", None, bad_classes, dict(block="adapter"), ValueError,
     r"the probe data \(batch 0\): labels outside 0..2 \(the model's classes\) in examples \[2\]"),
    ("position out of range", "llama", None, lm_batches, dict(positions=[9]), ValueError,
     r"position 9 is out of range: the model has 4 layers"),
    ("max_batches 0", "llama", None, lm_batches, dict(max_batches=0), ValueError, r"max_batches must be an integer >= 1 or None, got 0"),
    ("max_batches -1", "llama", None, lm_batches, dict(max_batches=-1), ValueError, r"max_batches must be an integer >= 1 or None, got -1"),
    ("batch_size 0", "llama", None, rows_of, dict(batch_size=0), ValueError, r"batch_size must be an integer >= 1, got 0"),
    ("z_threshold NaN", "llama", None, lm_batches, dict(z_threshold=math.nan), ValueError, r"z_threshold must be a finite number, got nan"),
]


@pytest.mark.parametrize("name,model_type,edit,data,kwargs,error,message", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_probe_refuses_bad_input(name, model_type, edit, data, kwargs, error, message):
    model = tiny_model(model_type)
    if edit is not None:
        edit(model)
    batches = data(model)
    before = snapshot(model)
    with pytest.raises(error, match=message) as info:
        probe(model, batches, progress=False, **kwargs)
    assert type(info.value) is error
    assert_unchanged(model, before)


STONE_CASES = [
    ("all labels -100", None, unsupervised, {}, r"train_data has no supervised token: every label is -100"),
    ("NaN weights", nan_weights, lm_batches, {}, r"the loss is nan on batch 0 \(counting from 0\)"),
    ("empty data", None, lambda m: [], {}, r"the data is empty: no example to read"),
    ("data without labels", None, no_labels, {}, r"train_data \(batch 0\) has no 'labels'"),
    ("tokenizer larger than the embedding", None, mismatched, {}, r"train_data \(batch 1\): " + MISMATCH),
    ("position out of range", None, lm_batches, {}, r"position 9 is out of range"),
    ("max_batches 0", None, lm_batches, dict(max_batches=0), r"max_batches must be an integer >= 1 or None, got 0"),
    ("batch_size 0", None, rows_of, dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("name,edit,data,kwargs,message", STONE_CASES, ids=[c[0] for c in STONE_CASES])
def test_stepping_stone_refuses_bad_input(name, edit, data, kwargs, message):
    model = tiny_model("llama")
    if edit is not None:
        edit(model)
    batches = data(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message) as info:
        stepping_stone(model, 9 if "position" in name else 2, batches, **kwargs)
    assert type(info.value) is ValueError
    assert_unchanged(model, before)


def test_stepping_stone_with_a_given_gradient_refuses_a_nan_model():
    # gradient= skips the probe pass, so nothing before the stone's own growth sees the NaN: grow_depth's exactness
    # check refuses a model whose output is not finite (before the line search, which refuses a NaN loss too).
    model = tiny_model("llama")
    batches = lm_batches(model)
    gradient = probe(model, batches, positions=[2], keep_gradients=True, covariance=False, progress=False).gradients[0]
    nan_weights(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"output on a probe input is not finite \(1 parameter\(s\) hold NaN or inf, e.g. model\.layers\.1\."):
        stepping_stone(model, 2, batches, gradient=gradient)
    assert_unchanged(model, before)
    bad = {name: torch.full_like(g, math.nan) for name, g in gradient.items()}
    with pytest.raises(ValueError, match=r"gradient has non-finite values in \["):
        stepping_stone(tiny_model("llama"), 2, batches, gradient=bad)


def test_a_batch_without_supervision_among_others_changes_nothing():
    # An unsupervised batch contributes an exactly-zero gradient: skipping its backward keeps the result.
    model = tiny_model("llama")
    batches = lm_batches(model, 4)
    batches[1]["labels"][:] = -100
    result = probe(model, batches, progress=False)
    assert result.total_weight == 3 * 2 * 7 and all(math.isfinite(s) for s in result.signal)


def test_check_batch_is_cheap_and_shared():
    model = tiny_model("llama")
    batch = tiny_inputs(model)
    check_batch(model, batch, where="x")
    batch["labels"][0, 1:] = -100
    check_batch(model, batch, where="x")  # a token-weighted loss does not need every example supervised
    with pytest.raises(ValueError, match=re.escape("x: examples ['a'] have no supervised token")):
        check_batch(model, batch, where="x", ids=["a", "b"], every_example_supervised=True)


# --------------------------------------------------------------------------- load_data


def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_load_data_refuses_a_tokenizer_larger_than_the_embedding(tmp_path, model_type):
    pytest.importorskip("datasets")
    from hf_depthgrow.data.sources import load_data

    words = [f"w{i}" for i in range(40)]  # ids up to 41; the model embeds 16
    model = tiny_model(model_type, vocab_size=16)
    before = snapshot(model)
    if model_type == "llama":
        (tmp_path / "a.txt").write_text(" ".join(words * 4), encoding="utf-8")
        path = tmp_path / "a.txt"
    else:
        (tmp_path / "a.csv").write_text("text,label\n" + "".join(f"{w} w1,{i % 3}\n" for i, w in enumerate(words)), encoding="utf-8")
        path = tmp_path / "a.csv"
    message = (rf"the data '{re.escape(str(path))}' tokenized by \w+: token ids outside the vocabulary: "
               r"max id 41, min id \d+, but the model embeds 16 in examples \[\d+(, \d+)*\]: the tokenizer does not match the model")
    with pytest.raises(ValueError, match=message):
        load_data(str(path), model=model, tokenizer=_tokenizer(words), block_size=8)
    assert_unchanged(model, before)
    ok = load_data(str(path), model=tiny_model(model_type), tokenizer=_tokenizer(words), block_size=8)
    assert len(ok) > 0
