"""Token blocks for causal-LM training: documents joined with EOS and cut into fixed-length blocks.

Example:
    ```python
    >>> from hf_depthgrow.data.lm_blocks import causal_lm_blocks, train_test_split_blocks
    >>> blocks = causal_lm_blocks(tokenizer, ["a play", "a poem"], block_size=4)
    >>> train, test = train_test_split_blocks(blocks, 0.25, seed=0)
    >>> blocks, documents = sampled_document_blocks(tokenizer, pages, block_size=4, per_document=2, max_blocks=8)
    ```
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import numpy as np
import torch

__all__ = ["causal_lm_blocks", "sampled_document_blocks", "train_test_split_blocks"]

_BATCH_CHARS = 1 << 18  # characters per tokenizer call (about 60k tokens of English)


def _token_stream(tokenizer, texts, eos: int, batch_size: int, needed: int | None) -> tuple[list[int], list[int]]:
    """The documents' tokens, each document followed by `eos`, and the stream offset where each document begins;
    tokenizing stops once the stream holds `needed` tokens."""
    stream: list[int] = []
    starts: list[int] = []  # in document order
    document_open = False
    for batch in _batches(_pieces(texts), batch_size):
        # verbose=False: whole plays exceed model_max_length, which is fine here since we chop them ourselves.
        encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for ids, (_, ends) in zip(encoded, batch):
            if not document_open:
                starts.append(len(stream))
                document_open = True
            stream.extend(ids)
            if ends:
                stream.append(eos)
                document_open = False
        if needed is not None and len(stream) >= needed:
            break  # no more text is read: a lazily read file stops here
    return stream, starts


def causal_lm_blocks(
    tokenizer,
    texts: Iterable[str | Iterable[str]],
    block_size: int,
    *,
    max_blocks: int | None = None,
    eos_token_id: int | None = None,
    batch_size: int = 64,
    with_documents: bool = False,
):
    """Tokenize documents, join them with EOS and cut the stream into fixed-length blocks for causal LM training.

    Each document is tokenized without special tokens and followed by one EOS token; the concatenated stream is cut
    into consecutive blocks of `block_size` tokens and the incomplete tail is dropped. Deterministic: the same inputs
    always give the same tensor. Tokenizing stops as soon as `max_blocks` blocks are available, so a small
    `max_blocks` is cheap even on a large corpus.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): any Hugging Face tokenizer.
        texts (`Iterable[str]`): the documents, in order. A document may also be an iterable of pieces of text
            (e.g. a lazily read [`~data.text_files.TextFile`]): its pieces are tokenized one by one and only the
            pieces up to `max_blocks` blocks are read.
        block_size (`int`): tokens per block.
        max_blocks (`int`, *optional*): keep at most this many (the first) blocks.
        eos_token_id (`int`, *optional*): separator; defaults to `tokenizer.eos_token_id`
            (`<|im_end|>` = 2 for SmolLM2). Needed for tokenizers without EOS, e.g. BERT's (pass `sep_token_id`).
        batch_size (`int`, *optional*, defaults to 64): documents tokenized per call.
        with_documents (`bool`, *optional*, defaults to `False`): also return, per block, the position in `texts`
            of the document its first token belongs to (a block that runs over a document's end is counted to the
            document it starts in).

    Returns:
        `torch.LongTensor` of shape `[n_blocks, block_size]` (input ids; use them as labels too); with
        `with_documents`, `(blocks, documents)` with `documents` a `torch.LongTensor` of shape `[n_blocks]`.

    Raises:
        ValueError: if the texts give fewer than `block_size` tokens.

    Example:

    ```python
    >>> blocks = causal_lm_blocks(tokenizer, shakespeare_texts(max_chars=50_000), 128, max_blocks=64)
    >>> blocks.shape, blocks.dtype
    (torch.Size([64, 128]), torch.int64)
    ```
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of documents, not a single string")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= (e.g. tokenizer.sep_token_id).")
    stream, starts = _token_stream(tokenizer, texts, eos, batch_size, None if max_blocks is None else max_blocks * block_size)
    n_blocks = len(stream) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise ValueError(f"the texts give {len(stream)} tokens, fewer than one block of {block_size}")
    blocks = torch.tensor(stream[: n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)
    if not with_documents:
        return blocks
    # The last document that starts at or before a block's first token (empty documents start where the next does).
    offsets = np.arange(n_blocks) * block_size
    documents = np.searchsorted(np.asarray(starts), offsets, side="right") - 1
    return blocks, torch.from_numpy(documents.astype(np.int64))


def sampled_document_blocks(
    tokenizer,
    texts: Iterable[str],
    block_size: int,
    *,
    per_document: int,
    max_blocks: int | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    documents: Iterable | None = None,
) -> tuple[torch.LongTensor, list]:
    """Blocks sampled across documents: a few blocks from each of many documents, not consecutive blocks of a few.

    The documents are visited in a seeded random order. Each one is tokenized on its own (without special tokens,
    followed by one EOS token) and cut into whole blocks of `block_size` tokens (its tail dropped; a document
    shorter than one block gives none); `per_document` of them, chosen at seeded random positions and kept in
    their order, are taken. Visiting stops once `max_blocks` blocks are taken, so `max_blocks / per_document`
    documents are read (fewer where the texts run out). Deterministic for a given seed. A block never spans two
    documents, so blocks of different documents share no text.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): any Hugging Face tokenizer.
        texts (`Iterable[str]`): the documents: strings, or iterables of pieces of text (e.g. a lazily read
            [`~data.text_files.TextFile`], read whole when its document is visited).
        block_size (`int`): tokens per block.
        per_document (`int`): blocks taken from each document (at most; fewer from a short document).
        max_blocks (`int`, *optional*): stop after this many blocks; `None` visits every document.
        seed (`int`, *optional*, defaults to 0): seed of the document order and of the positions within each.
        eos_token_id (`int`, *optional*): separator; defaults to `tokenizer.eos_token_id`.
        documents (`Iterable`, *optional*): the id of each document (e.g. its file name); defaults to its position in
            `texts`.

    Returns:
        `(blocks, documents)`: a `torch.LongTensor` `[n_blocks, block_size]` and the id of each block's document
        (a list, blocks of one document adjacent).

    Raises:
        ValueError: if no document gives a whole block.

    Example:

    ```python
    >>> blocks, docs = sampled_document_blocks(tokenizer, python_docs_texts(), 64, per_document=2, max_blocks=128)
    >>> blocks.shape, len(set(docs))
    (torch.Size([128, 64]), 64)
    ```
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if per_document < 1:
        raise ValueError(f"per_document must be >= 1, got {per_document}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    texts = list(texts)
    names = list(range(len(texts))) if documents is None else list(documents)
    if len(names) != len(texts):
        raise ValueError(f"documents has {len(names)} ids for {len(texts)} texts")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= (e.g. tokenizer.sep_token_id).")
    rng = np.random.default_rng(seed)
    taken: list[list[int]] = []
    owners: list = []
    for i in rng.permutation(len(texts)):
        if max_blocks is not None and len(taken) >= max_blocks:
            break
        text = texts[i] if isinstance(texts[i], str) else "".join(texts[i])
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + [eos]
        n = len(ids) // block_size
        if n == 0:
            continue
        want = min(per_document, n, max_blocks - len(taken) if max_blocks is not None else n)
        for j in np.sort(rng.choice(n, size=want, replace=False)):
            taken.append(ids[j * block_size : (j + 1) * block_size])
            owners.append(names[i])
    if not taken:
        raise ValueError(f"no document gives a whole block of {block_size} tokens; use a smaller block_size")
    return torch.tensor(taken, dtype=torch.long), owners


def _pieces(texts: Iterable) -> Iterator[tuple[str, bool]]:
    """`(text, ends_document)`: a `str` is one document; any other item is one document given as pieces of text."""
    for doc in texts:
        if isinstance(doc, str):
            yield doc, True
            continue
        for piece in doc:
            yield piece, False
        yield "", True


def _batches(pieces: Iterator[tuple[str, bool]], batch_size: int, max_chars: int = _BATCH_CHARS) -> Iterator[list[tuple[str, bool]]]:
    """Up to `batch_size` pieces per tokenizer call, and about `max_chars` characters at most (so a call on
    a few huge documents does not tokenize far more than the blocks need)."""
    batch, chars = [], 0
    for text, ends in pieces:
        batch.append((text, ends))
        chars += len(text)
        if len(batch) >= batch_size or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def train_test_split_blocks(blocks, test_fraction: float, seed: int):
    """Split blocks into train and test sets with a seeded random permutation.

    Each side keeps the blocks in their original order. Note that neighbouring blocks of the same document can land
    on both sides; split the documents instead where that leak matters.

    Args:
        blocks (`torch.Tensor` or `np.ndarray`): `[n, ...]`, e.g. from [`causal_lm_blocks`].
        test_fraction (`float`): share of blocks for the test set, in `[0, 1)`; rounded, and at least one block
            when positive.
        seed (`int`): seed of the permutation; the same seed gives the same split.

    Returns:
        `(train, test)`: the two subsets, of the same type as `blocks`.

    Example:

    ```python
    >>> train, test = train_test_split_blocks(torch.arange(10).view(10, 1), 0.2, seed=0)
    >>> train.shape[0], test.shape[0]
    (8, 2)
    ```
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n = len(blocks)
    n_test = int(round(n * test_fraction))
    if test_fraction > 0:
        n_test = max(1, n_test)
    if n_test >= n:
        raise ValueError(f"test_fraction={test_fraction} leaves no training blocks out of {n}")
    # A private generator, so the split does not depend on (or disturb) the global RNG state.
    generator = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=generator)
    test_idx, _ = torch.sort(perm[:n_test])
    train_idx, _ = torch.sort(perm[n_test:])
    if isinstance(blocks, torch.Tensor):
        return blocks[train_idx], blocks[test_idx]
    return blocks[train_idx.numpy()], blocks[test_idx.numpy()]
