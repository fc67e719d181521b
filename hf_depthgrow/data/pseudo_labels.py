"""Retention for classifiers: general-domain text labelled with the original model's own decisions.

A language model's retention set is plain text scored by its own loss. A classifier has no labelled
general-domain set (its pre-training was not classification), so what it can lose outside its task is
its *behaviour*: the decisions the original makes on text from elsewhere. Each paragraph of the Python
documentation gets the original's argmax class as its label; a fine-tuned arm's cross-entropy against
those labels, paired with the original's own, measures how far its decisions drifted. The original is
not at zero on this set (its loss is its own uncertainty), so an arm that keeps the decisions and grows
more confident can score below it: read a positive difference as drift, not a negative one as gain.
"""

from __future__ import annotations

import datasets
import numpy as np
import torch
from torch import nn

from .batches import as_batches, to_device


def paragraphs(texts, *, min_words: int = 12) -> list[str]:
    """Paragraphs (blocks separated by blank lines) with at least `min_words` words, in order.

    Example:
        ```python
        >>> paragraphs(["one two\\n\\n" + "word " * 12], min_words=12)
        ['word word word word word word word word word word word word']
        ```
    """
    out = []
    for text in texts:
        for block in text.split("\n\n"):
            words = block.split()
            if len(words) >= min_words:
                out.append(" ".join(words))
    return out


@torch.no_grad()
def pseudo_labelled(model: nn.Module, tokenizer, texts, *, block_size: int, max_examples: int | None = None,
                    seed: int = 0, batch_size: int = 32) -> datasets.Dataset:
    """A classification set from `texts` whose labels are `model`'s own predictions (see the module docstring).

    Args:
        model: The original classifier (run in eval mode; not changed).
        tokenizer: Its tokenizer.
        texts: Documents; their paragraphs become examples (a seeded sample of `max_examples`).
        block_size: Padded length of an example.

    Example:
        ```python
        >>> ds = pseudo_labelled(classifier, tok, python_docs_texts(), block_size=64, max_examples=128)
        >>> ds[0]["labels"]  # what the original predicts for this paragraph
        tensor(1)
        ```
    """
    items = paragraphs(texts)
    if not items:
        raise ValueError("no paragraph of at least 12 words in the retention texts")
    if max_examples is not None and max_examples < len(items):
        order = np.random.default_rng(seed).permutation(len(items))[:max_examples]
        items = [items[i] for i in sorted(order)]
    enc = tokenizer(items, padding="max_length", truncation=True, max_length=block_size)
    rows = [{"input_ids": torch.tensor(i), "attention_mask": torch.tensor(m)} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        labels = [model(**to_device(batch, device)).logits.argmax(dim=-1).cpu() for batch in as_batches(rows, batch_size=batch_size)]
    finally:
        model.train(was_training)
    return datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": torch.cat(labels).tolist()}
    ).with_format("torch")
