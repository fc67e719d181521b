"""Continued pretraining from a stream: causal-LM blocks tokenized as training reaches them, never held whole.

`stream_data` opens a source (a Hub dataset with `streaming=True`, a local JSON-lines or text file, or a folder of
such shards), packs its documents into blocks as `causal_lm_blocks` does (documents joined with EOS, cut every
`block_size` tokens) and returns the first blocks materialised as held-out data plus a `StreamedBlocks` training
set over the blocks after them. The trainer reads a `StreamedBlocks` in stream order (no shuffle: a shuffle
would need the whole corpus), so memory holds one window of blocks whatever the corpus size.

Before any training, `StreamedBlocks.check` reads the stream once to the last block training will use: it
refuses a stream that ends too soon, checks every token id against the model, and hashes every token (the
fingerprint a resumed run is checked against). That pass tokenizes what training will read, without a model
forward, so it costs a small fraction of the training.

A resumed run starts at a later block: the stream is opened again and read up to it. The same blocks come in
the same order, so a resumed run ends with the weights of an uninterrupted one.

Example:
    ```python
    >>> held_out, train_rows = stream_data("corpus/", tokenizer, block_size=128, train_blocks=8 * 1000, held_out_blocks=64)
    >>> result = train(model, train_rows, eval_data=held_out, max_steps=1000, per_device_train_batch_size=8)
    ```
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from .checks import check_batch
from .lm_blocks import _batches, _pieces
from .text_files import _cut

__all__ = ["StreamTooShortError", "StreamedBlocks", "stream_data"]

_WINDOW = 1024  # blocks kept behind the read position: at least one global batch, whose rows ranks read out of order
# Characters per tokenizer call. A fast tokenizer's call holds several times its text in token metadata, and the
# allocator keeps that peak: small calls keep a stream's memory flat (measured: benchmarks/bench_streaming.py).
_CALL_CHARS = 1 << 15


class StreamTooShortError(ValueError):
    """The stream ends before the blocks a run needs."""


def _split(texts: Iterable) -> Iterator:
    """Documents longer than one tokenizer call as pieces cut where byte-level BPE tokenizers split anyway."""
    for doc in texts:
        if isinstance(doc, str) and len(doc) > _CALL_CHARS:
            yield _cut_pieces(doc)
        else:
            yield doc


def _cut_pieces(text: str) -> Iterator[str]:
    while text:
        end = _cut(text, _CALL_CHARS) if len(text) > _CALL_CHARS else len(text)
        yield text[:end]
        text = text[end:]


def _blocks(texts: Iterable, tokenizer, block_size: int, eos: int) -> Iterator[torch.Tensor]:
    """Blocks of `block_size` token ids, packed as `causal_lm_blocks` packs them (long documents tokenized in pieces,
    as lazily read text files are: the same tokens for byte-level BPE tokenizers)."""
    stream: list[int] = []
    for batch in _batches(_pieces(_split(texts)), 64, _CALL_CHARS):
        encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for ids, (_, ends) in zip(encoded, batch):
            stream.extend(ids)
            if ends:
                stream.append(eos)
        full = len(stream) // block_size
        for i in range(full):
            yield torch.tensor(stream[i * block_size : (i + 1) * block_size], dtype=torch.long)
        del stream[: full * block_size]


class StreamedBlocks(torch.utils.data.Dataset):
    """`num_blocks` causal-LM training rows read from a stream of documents as they are needed.

    A map-style dataset for the data contract: `len()` is fixed, `rows[i]` returns `{"input_ids", "labels"}`.
    Reads are cheap in stream order; a row more than `window` blocks behind the read position (a resumed run,
    or the first rows again) opens the stream anew. `open_texts()` must give the same documents in the same
    order every time it is called.

    Args:
        open_texts (`Callable[[], Iterable[str]]`): a fresh iterable of the documents, from the start.
        tokenizer: the model's tokenizer.
        block_size (`int`): tokens per block.
        num_blocks (`int`): the rows this dataset holds (the stream must give `skip + num_blocks` blocks).
        skip (`int`, *optional*): blocks at the start of the stream that are not training rows (held-out).
        where (`str`, *optional*): names the source in errors.
    """

    streamed = True  # read in stream order (`training.data_order`), checked by `check` rather than row by row

    def __init__(self, open_texts: Callable[[], Iterable], tokenizer, block_size: int, num_blocks: int, *,
                 skip: int = 0, eos_token_id: int | None = None, where: str = "the stream", window: int = _WINDOW):
        if num_blocks < 1 or skip < 0 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 and skip >= 0, got {num_blocks}, {block_size}, {skip}")
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= (e.g. tokenizer.sep_token_id)")
        self.open_texts, self.tokenizer, self.block_size, self.eos = open_texts, tokenizer, block_size, eos
        self.num_blocks, self.skip, self.where, self.window = num_blocks, skip, where, window
        self._iter, self._next, self._recent = None, 0, OrderedDict()
        self._fingerprint, self.checked_against_model = None, False
        self.opened = 0  # how often the stream was opened (tests read it)

    def __len__(self) -> int:
        return self.num_blocks

    def _open(self) -> None:
        self.opened += 1
        self._iter = _blocks(self.open_texts(), self.tokenizer, self.block_size, self.eos)
        self._next, self._recent = 0, OrderedDict()
        for _ in range(self.skip):
            if next(self._iter, None) is None:
                raise StreamTooShortError(self._short_held_out())

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"row {index} of {self.num_blocks}")
        if index in self._recent:
            ids = self._recent[index]
        else:
            if self._iter is None or index < self._next:  # not started, or behind the window: from the start
                self._open()
            while self._next <= index:
                block = next(self._iter, None)
                if block is None:
                    raise StreamTooShortError(self._short(self._next))
                self._recent[self._next] = block
                self._next += 1
                if len(self._recent) > self.window:
                    self._recent.popitem(last=False)
            ids = self._recent[index]
        return {"input_ids": ids, "labels": ids}

    def _short_held_out(self) -> str:
        return f"{self.where} ends within its first {self.skip} blocks (the held-out part)"

    def _short(self, have: int) -> str:
        return (f"{self.where} gives {have} training blocks of {self.block_size} tokens after the {self.skip} held-out "
                f"blocks, fewer than the {self.num_blocks} the run needs: lower --max-steps or add data")

    def check(self, model=None) -> StreamedBlocks:
        """Read the stream once to its last needed block: refuse a short stream, check token ids, fingerprint it."""
        digest, blocks = hashlib.sha256(), _blocks(self.open_texts(), self.tokenizer, self.block_size, self.eos)
        chunk: list[torch.Tensor] = []
        for seen in range(self.skip + self.num_blocks):
            block = next(blocks, None)
            if block is None:
                if seen < self.skip:
                    raise StreamTooShortError(self._short_held_out())
                raise StreamTooShortError(self._short(seen - self.skip))
            if seen < self.skip:
                continue
            digest.update(block.numpy().tobytes())
            if model is None:
                continue
            chunk.append(block)
            if len(chunk) == 256 or seen == self.skip + self.num_blocks - 1:
                ids = torch.stack(chunk)
                start = seen - self.skip - len(chunk) + 1
                check_batch(model, {"input_ids": ids, "labels": ids}, where=self.where, ids=range(start, start + len(chunk)))
                chunk = []
        self._fingerprint = {"rows": self.num_blocks, "sha256": digest.hexdigest()[:16], "streamed": True}
        self.checked_against_model = self.checked_against_model or model is not None
        return self

    def fingerprint(self) -> dict:
        """Row count and a hash of every token of the training rows (from `check`)."""
        if self._fingerprint is None:
            self.check()
        return self._fingerprint


def _open_source(source: str, text_column: str | None, split: str) -> tuple[Callable[[], Iterable], str]:
    """`(open_texts, name)` for a local file/folder or a Hub dataset id, checked before anything is read."""
    from .sources import _read_local
    from .text_files import check_data_path

    from .corpora import python_docs_texts, shakespeare_texts

    embedded = {"shakespeare": shakespeare_texts, "python_docs": python_docs_texts}
    if source in embedded:  # corpora shipped in packages, small enough to read whole per pass
        return embedded[source], source
    path = Path(source)
    if path.exists():
        check_data_path(path)
        _read_local(path, text_column, None, lazy=True)  # refuses unsupported files now, not mid-training
        return (lambda: _read_local(path, text_column, None, lazy=True)[0]), path.name
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        raise ValueError(f"{source!r} is not a local path, and the Hub is switched off (HF_HUB_OFFLINE): stream a local "
                         "JSON-lines or text file, or a folder of them")

    def open_texts():
        import datasets

        rows = iter(datasets.load_dataset(source, split=split, streaming=True))
        from .sources import _streamed_texts

        return _streamed_texts(rows, text_column, source)

    try:
        open_texts()
    except Exception as err:  # the Hub raises several types when a dataset cannot be opened
        raise ValueError(f"could not stream dataset {source!r} from the Hugging Face Hub ({type(err).__name__}: {err})") from err
    return open_texts, source


def stream_data(source: str, tokenizer, *, block_size: int, train_blocks: int, held_out_blocks: int = 0,
                text_column: str | None = None, split: str = "train", model=None):
    """`(held_out, train_rows)`: the stream's first `held_out_blocks` blocks materialised, then `train_blocks` streamed.

    `source` is a local `.jsonl`/`.txt` file, a folder of such shards (read in name order), an embedded text corpus
    (`"shakespeare"`, `"python_docs"`), or a Hub dataset id
    (opened with `datasets.load_dataset(source, split=split, streaming=True)`). The training rows are checked
    (`StreamedBlocks.check`) before this returns, so a stream that ends too soon is refused before any training.

    Raises:
        StreamTooShortError: the stream gives fewer than `held_out_blocks + train_blocks` blocks.
        ValueError: an unreadable source, or token ids the model cannot score.

    Example:
        ```python
        >>> held_out, rows = stream_data("shards/", tokenizer, block_size=64, train_blocks=32, held_out_blocks=8)
        >>> len(held_out), len(rows)
        (8, 32)
        ```
    """
    open_texts, name = _open_source(source, text_column, split)
    held_out = None
    if held_out_blocks:
        blocks = _blocks(open_texts(), tokenizer, block_size, tokenizer.eos_token_id)
        first = [b for _, b in zip(range(held_out_blocks), blocks)]
        if len(first) < held_out_blocks:
            raise StreamTooShortError(f"{name} gives {len(first)} blocks, fewer than the {held_out_blocks} held-out blocks")
        ids = torch.stack(first)
        held_out = [{"input_ids": row, "labels": row} for row in ids]
    rows = StreamedBlocks(open_texts, tokenizer, block_size, train_blocks, skip=held_out_blocks, where=name)
    return held_out, rows.check(model)
