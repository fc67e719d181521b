"""The general-domain set forgetting is measured on, chosen for the model's task (`"auto"`), for Python and the CLI alike.

`"auto"` is the Python docs for a text model and none for an image classifier (no general-domain image set ships).
A text classifier is scored on the Python docs labelled with its own predictions (`pseudo_labels`): forgetting is
then how far a trained model moves away from the original's decisions outside the training domain.

Example:
    ```python
    >>> from hf_depthgrow.data.retention import load_retention
    >>> retention = load_retention("auto", model, tokenizer, block_size=64, max_examples=128)
    >>> result = compare_plans(model, train, held_out, test, retention_data=retention)
    ```
"""

from __future__ import annotations

AUTO = "auto"


def retention_source(source: str | None, task: str) -> str | None:
    """`source` with `"auto"` resolved for `task` (an `infer_task` name): `python_docs`, or `None` for image classification."""
    if source == AUTO:
        return None if task == "image_classification" else "python_docs"
    return source


def load_retention(source: str | None, model, tokenizer, *, block_size: int, max_examples: int | None, split: str = "test",
                   seed: int = 0, blocks_per_document="auto"):
    """The retention rows for `model`: from `source` (a `load_data` source, `"auto"` or `None`), or `None` for none.

    Args:
        source: `"auto"` (see `retention_source`), any source `load_data` reads, or `None`.
        model: The original model (a text classifier's predictions label the Python docs).
        tokenizer: Its tokenizer.
        block_size: Tokens per example (padded length for classifiers).
        max_examples: At most this many examples.
        split: The split of a source that has several (`fashion_mnist`).
        seed: Seeds the sample of examples.
        blocks_per_document: As `load_data` takes it (`"auto"`: the source's default).
    """
    from .sources import infer_task, load_data

    task = infer_task(model)
    source = retention_source(source, task)
    if source is None:
        return None
    if source == "python_docs" and task == "text_classification":
        from .corpora import python_docs_texts
        from .pseudo_labels import pseudo_labelled

        return pseudo_labelled(model, tokenizer, python_docs_texts(), block_size=block_size, max_examples=max_examples, seed=seed)
    return load_data(source, model=model, tokenizer=tokenizer, block_size=block_size, max_examples=max_examples, split=split,
                     seed=seed, blocks_per_document=blocks_per_document)
