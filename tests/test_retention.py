"""The retention set (the Python docs as text), `forgetting` / `evaluate_retention`, and `hf-depthgrow eval --retention-data`."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.data import corpora, load_data
from hf_depthgrow.data.corpora import python_docs_texts
from hf_depthgrow.evaluation import EvalResult, evaluate_retention, forgetting, paired_intervals
from hf_depthgrow.testing import tiny_inputs, tiny_model

PAGE = r""".. _json-module:

=====================
:mod:`json` --- JSON
=====================

.. module:: json
   :synopsis: Encode and decode the JSON format.

.. index::
   single: JSON; module

.. Internal note: this comment
   spans two lines.

The :func:`~json.dumps` function writes ``str`` objects, see
`the spec <https://json.org>`_ and :pep:`8` [#f1]_, as :ref:`the table
<py-to-json>` shows.

.. function:: dumps(obj, *, \
                    indent=None)
   :noindex:

   Serialize *obj*.

Example::

    >>> print(1)
    1

>>> for x in [1]:
...     pass
...

----------

.. note::
   Keep this note.

.. [#f1] A footnote.
"""

PAGE_TEXT = """json --- JSON

The json.dumps function writes str objects, see
the spec and PEP 8, as the table shows.

   Serialize *obj*.

Example:

    >>> print(1)
    1

>>> for x in [1]:
...     pass
...

   Keep this note.

.. [#f1] A footnote."""

DOCS = Path("/usr/share/doc/python3.11/html/_sources")


@pytest.fixture
def docs_root(tmp_path, monkeypatch):
    """A small docs tree (three pages); `python_docs` sources read it instead of the Debian package."""
    root = tmp_path / "sources"
    (root / "a").mkdir(parents=True)
    (root / "b.rst.txt").write_text("Second\n======\n\nText of b, plain prose about Python.\n" * 3)
    (root / "a" / "z.rst.txt").write_text("The z page.\n")
    (root / "a.rst.txt").write_text(PAGE)
    (root / "notes.txt").write_text("not a page")
    monkeypatch.setattr(corpora, "PYTHON_DOCS_DIR", root)
    return root


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}  # 102 ids < the tiny 128
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


# --------------------------------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------------------------------


def test_python_docs_texts_strips_markup_and_keeps_prose_in_path_order(docs_root):
    texts = python_docs_texts(root=docs_root)
    # sorted relative paths: "a.rst.txt" < "a/z.rst.txt" < "b.rst.txt"; notes.txt is not a page
    assert texts[0] == PAGE_TEXT
    assert texts[1] == "The z page."
    assert texts[2].startswith("Second\n\nText of b") and "======" not in texts[2]
    assert python_docs_texts() == texts  # the module default (patched to the same folder)
    budget = python_docs_texts(max_chars=len(PAGE_TEXT) + 5, root=docs_root)
    assert budget == [PAGE_TEXT, "The z"]
    with pytest.raises(ValueError, match="max_chars must be >= 0"):
        python_docs_texts(max_chars=-1, root=docs_root)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_python_docs_texts_names_the_apt_package_when_absent(tmp_path, make):
    root = tmp_path / "docs"
    if make == "empty":
        root.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        python_docs_texts(root=root)
    message = str(err.value)
    assert "\n" not in message and str(root) in message and "apt-get install -y python3.11-doc" in message


@pytest.mark.skipif(not DOCS.is_dir(), reason="apt-get install python3.11-doc")
def test_python_docs_texts_on_the_debian_package():
    texts = python_docs_texts(max_chars=200_000)
    assert texts[0].startswith("About these documents\n") and sum(map(len, texts)) == 200_000
    joined = "\n".join(texts)
    assert joined.count("Python") > 50
    lines = joined.splitlines()
    assert not [l for l in lines if l.lstrip().startswith((".. index::", ".. _", ".. function::"))]
    assert not [l for l in lines if len(l) >= 3 and set(l) in ({"="}, {"-"}, {"*"}, {"^"})]
    assert ":func:`" not in joined and "``" not in joined


# --------------------------------------------------------------------------------------------------------------------
# load_data("python_docs")
# --------------------------------------------------------------------------------------------------------------------


def test_load_data_python_docs_consecutive_blocks_when_asked(docs_root):
    # blocks_per_document=None: consecutive blocks of the pages joined in a seeded order (the former default).
    tokenizer = _char_tokenizer()
    ds = load_data("python_docs", model=tiny_model("llama"), tokenizer=tokenizer, block_size=16, max_examples=5,
                   blocks_per_document=None)
    rows = ds[:]
    assert len(ds) == 5 and tuple(rows["input_ids"].shape) == (5, 16)
    assert torch.equal(rows["labels"], rows["input_ids"]) and bool(rows["attention_mask"].all())
    pages = corpora.python_docs_texts()
    stream, owner = [], []
    for i in np.random.default_rng(0).permutation(len(pages)):
        ids = tokenizer(pages[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        stream += ids
        owner += [int(i)] * len(ids)
    assert rows["input_ids"].reshape(-1).tolist() == stream[:80] and 0 not in stream  # no <unk>: every char known
    # Each block names the page (its position in path order) its first token comes from.
    assert rows["document"].tolist() == [owner[16 * b] for b in range(5)]
    other = load_data("python_docs", model=tiny_model("llama"), tokenizer=tokenizer, block_size=16, max_examples=5, seed=1,
                      blocks_per_document=None)
    assert not torch.equal(other[:]["input_ids"], rows["input_ids"])  # another seed, another sample of pages


def test_load_data_python_docs_samples_a_few_blocks_from_each_page_by_default(docs_root):
    tokenizer = _char_tokenizer()
    ds = load_data("python_docs", model=tiny_model("llama"), tokenizer=tokenizer, block_size=16, max_examples=5)
    rows = ds[:]
    pages = corpora.python_docs_texts()
    own = [tokenizer(p, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in pages]
    docs = rows["document"].tolist()
    # Two blocks from each page that holds a whole block: a (page 0) and b (page 2); the z page (13 tokens) has none.
    assert len(ds) == 4 and sorted(docs) == [0, 0, 2, 2]
    for block, doc in zip(rows["input_ids"].tolist(), docs):
        ids = own[doc]
        starts = [16 * j for j in range(len(ids) // 16)]
        assert any(ids[s : s + 16] == block for s in starts)  # a whole block of its own page, aligned to the page
    assert torch.equal(load_data("python_docs", model=tiny_model("llama"), tokenizer=tokenizer, block_size=16, max_examples=5)[:]["input_ids"],
                       rows["input_ids"])  # deterministic
    one = load_data("python_docs", model=tiny_model("llama"), tokenizer=tokenizer, block_size=16, max_examples=3, blocks_per_document=1)
    assert sorted(one[:]["document"].tolist()) == [0, 2]  # one block per page, as many pages as hold one


def test_load_data_refuses_a_bad_blocks_per_document(docs_root):
    with pytest.raises(ValueError, match="blocks_per_document must be an integer >= 1, None or 'auto', got 0"):
        load_data("python_docs", model=tiny_model("llama"), tokenizer=_char_tokenizer(), block_size=16, blocks_per_document=0)


def test_load_data_python_docs_refuses_a_classifier(docs_root):
    with pytest.raises(ValueError) as err:
        load_data("python_docs", model=tiny_model("bert"), tokenizer=_char_tokenizer(), block_size=16)
    assert str(err.value) == "'python_docs' is a causal-LM text source (unlabelled prose and code); BertForSequenceClassification is a text_classification model"


# --------------------------------------------------------------------------------------------------------------------
# forgetting / evaluate_retention
# --------------------------------------------------------------------------------------------------------------------


def _result(old, new, task="causal_lm", bound=2.0) -> EvalResult:
    old, new = np.asarray(old, dtype=float), np.asarray(new, dtype=float)
    details = paired_intervals(old, new, delta=0.05, bound=bound, n_bootstrap=500, seed=0)
    d = old - new
    return EvalResult(
        task=task, mode="shared_prefix", num_examples=len(d), num_tokens=16 * len(d), loss_old=float(old.mean()),
        loss_new=float(new.mean()), delta=float(d.mean()), mean_delta=float(d.mean()), per_example_old=old.tolist(),
        per_example_new=new.tolist(), example_ids=list(range(len(d))), example_weights=[16.0] * len(d), level=0.05,
        loss_bound=bound, loss_bound_source="given", intervals={k: (v["low"], v["high"]) for k, v in details.items()},
        interval_details=details, certified={k: v["certified"] for k, v in details.items()},
    )


def test_forgetting_of_a_worse_new_model_is_positive_with_flipped_intervals():
    rng = np.random.default_rng(0)
    old = 1.0 + 0.1 * rng.standard_normal(400)
    result = _result(old, old + 0.5 + 0.05 * rng.standard_normal(400))  # the new model is worse everywhere
    report = forgetting(result)
    assert report["forgetting"] == pytest.approx(0.5, abs=0.01) and report["forgetting"] == -result.mean_delta
    for kind, (low, high) in result.intervals.items():
        assert report["intervals"][kind] == [-high, -low]
    assert report["intervals"]["hoeffding"][0] > 0 and report["certified_forgetting"]["hoeffding"] is True
    assert (report["loss_old"], report["loss_new"], report["num_examples"]) == (result.loss_old, result.loss_new, 400)
    low, high = report["intervals"]["hoeffding"]
    assert report["verdict"] == f"forgetting certified: +{report['forgetting']:.3g} nats/token [{low:.2g}, {high:.2g}] (hoeffding, 95%)"
    json.dumps(report, allow_nan=False)  # JSON-ready as it is
    assert forgetting(result.to_dict()) == report  # a report.json result reads the same


def test_forgetting_verdicts_for_an_improvement_and_for_no_difference():
    rng = np.random.default_rng(1)
    old = 1.0 + 0.1 * rng.standard_normal(300)
    better = forgetting(_result(old, old - 0.5, task="classification"))
    assert better["forgetting"] < 0 and not any(better["certified_forgetting"].values())
    assert better["verdict"].startswith("improved on the retention set: -0.5 nats/example")
    noise = forgetting(_result(old, old + 0.02 * rng.standard_normal(300)))
    low, high = noise["intervals"]["bootstrap"]
    assert low < 0 < high and noise["verdict"].startswith("no certified forgetting: ") and "(bootstrap, 95%)" in noise["verdict"]


def _rows(model, n=6, seq=12):
    batch = tiny_inputs(model, batch=n, seq=seq, seed=3)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def test_evaluate_retention_of_a_model_at_init_is_exactly_zero():
    grown = grow_depth(tiny_model("llama"), [2])
    result, report = evaluate_retention(grown, _rows(grown), loss_bound=10.0, n_bootstrap=100, use_evaluate=False)
    assert result.num_examples == 6 and result.per_example_old == result.per_example_new
    assert report["forgetting"] == 0.0 and report["intervals"]["bootstrap"] == [0.0, 0.0]
    assert report["verdict"].startswith("no certified forgetting: 0 nats/token")


def test_evaluate_retention_against_a_separate_base_matches_the_paired_result():
    base = tiny_model("llama")
    other = tiny_model("llama", seed=1)
    result, report = evaluate_retention(other, _rows(base), base=base, loss_bound=10.0, n_bootstrap=100, use_evaluate=False)
    assert result.mode != "shared_prefix"
    diffs = np.asarray(result.per_example_new) - np.asarray(result.per_example_old)
    assert report["forgetting"] == pytest.approx(float(diffs.mean()), abs=1e-9) and report["forgetting"] != 0


# --------------------------------------------------------------------------------------------------------------------
# hf-depthgrow eval --retention-data
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def eval_inputs(tmp_path):
    """A perturbed grown tiny Llama with a character tokenizer, and a training-domain corpus."""
    from hf_depthgrow import save_pretrained

    grown = grow_depth(tiny_model("llama"), [2])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in new_block_parameters(grown):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_pretrained(grown, tmp_path / "grown")
    _char_tokenizer().save_pretrained(tmp_path / "grown")
    (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question. " * 20)
    return tmp_path


def _argv(root: Path, *extra: str) -> list[str]:
    return [str(root / "grown"), "--data", str(root / "corpus.txt"), "--block-size", "16", "--max-examples", "6",
            "--loss-bound", "10", "--n-bootstrap", "100", "--no-evaluate", "--no-progress", "--out", str(root / "out"), *extra]


def test_eval_writes_the_retention_result(eval_inputs, docs_root, capsys):
    from hf_depthgrow.cli.eval import main

    assert main(_argv(eval_inputs, "--retention-data", "python_docs", "--retention-max-examples", "4")) == 0
    out = capsys.readouterr().out.splitlines()
    saved = json.loads((eval_inputs / "out" / "retention.json").read_text())
    paired = saved["paired"]
    assert saved["data"] == "python_docs" and saved["num_examples"] == paired["num_examples"] == 4
    # two blocks from each of the two pages that hold one; the bootstrap resampled those pages
    assert paired["num_documents"] == 2 and paired["cluster_key"] == "document" and "2 documents" in paired["interval_details"]["bootstrap"]["formula"]
    diffs = np.asarray(paired["per_example_new"]) - np.asarray(paired["per_example_old"])
    assert saved["forgetting"] == pytest.approx(float(diffs.mean()), abs=1e-12) and saved["forgetting"] != 0
    assert saved["intervals"]["bootstrap"] == [-paired["intervals"]["bootstrap"][1], -paired["intervals"]["bootstrap"][0]]
    assert f"retention (python_docs): {saved['verdict']}" in out
    report = json.loads((eval_inputs / "out" / "report.json").read_text())
    assert report["num_examples"] == 6 and saved["verdict"] in report["extra"]["retention"]
    assert saved["verdict"] in (eval_inputs / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--retention-data", "missing.txt"], "no such data file or folder: missing.txt"),
        (["--retention-data", "python_docs"], "apt-get install -y python3.11-doc"),
        (["--retention-data", "CORPUS"], "is the evaluation data itself"),
        (["--retention-data", "CORPUS_AGAIN"], "is the evaluation data itself"),  # the same file, named differently
        (["--retention-data", "python_docs", "--retention-max-examples", "0"], "--retention-max-examples must be >= 1, got 0"),
        (["--retention-data", "TINY"], "fewer than one block of 16"),  # found only after the model loads
    ],
)
def test_eval_refuses_a_bad_retention_set_before_evaluating(eval_inputs, monkeypatch, capsys, extra, message):
    from hf_depthgrow.cli.eval import main
    from hf_depthgrow.evaluation import paired

    monkeypatch.setattr(corpora, "PYTHON_DOCS_DIR", eval_inputs / "no-docs")
    monkeypatch.setattr(paired, "evaluate_delta", lambda *a, **k: pytest.fail("the evaluation ran before the retention set was checked"))
    (eval_inputs / "tiny.txt").write_text("too short")
    names = {"CORPUS": str(eval_inputs / "corpus.txt"), "CORPUS_AGAIN": str(eval_inputs / "grown" / ".." / "corpus.txt"),
             "TINY": str(eval_inputs / "tiny.txt")}
    assert main(_argv(eval_inputs, *[names.get(x, x) for x in extra])) == 2
    # (loading a model draws transformers' progress bars on stderr too; the error itself is one line)
    errors = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "hf-depthgrow" in line]
    assert len(errors) == 1 and errors[0].startswith("hf-depthgrow eval: ") and message in errors[0]
    assert not (eval_inputs / "out").exists()
