"""Data: sources to model inputs, real corpora and models shipped in packages, and the batch contract.

Modules: `sources` (`load_data`, splits, loaders), `batches` (the one data contract every function that
takes data reads through), `models` (SmolLM2, MiniLM shipped in packages), `corpora` (Shakespeare,
tweets, Fashion-MNIST, digits), `lm_blocks` (causal-LM token blocks), `installed` (finding them).
"""

from .batches import DataFormError, as_batches, as_rows, collate, data_form
from .sources import (
    EMBEDDED_SOURCES,
    images_to_pixels,
    infer_task,
    load_data,
    make_loader,
    split_dataset,
)

__all__ = [
    "EMBEDDED_SOURCES",
    "DataFormError",
    "as_batches",
    "as_rows",
    "collate",
    "data_form",
    "images_to_pixels",
    "infer_task",
    "load_data",
    "make_loader",
    "split_dataset",
]
