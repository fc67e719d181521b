"""Data: sources to model inputs, real corpora and models shipped in packages, and the batch contract."""

from .sources import (
    EMBEDDED_SOURCES,
    images_to_pixels,
    infer_task,
    load_data,
    make_loader,
    split_dataset,
)
