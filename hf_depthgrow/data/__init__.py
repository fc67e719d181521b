"""Data: sources to model inputs, real corpora and models shipped in packages, and the batch contract.

Modules: `sources` (`load_data`, splits, loaders), `batches` (the one data contract every function that
takes data reads through), `models` (SmolLM2, MiniLM shipped in packages), `corpora` (Shakespeare,
the Python docs, tweets, Fashion-MNIST, digits), `lm_blocks` (causal-LM token blocks), `installed` (finding them),
`text_files` (which local paths may be read, and text read lazily in bounded pieces), `streaming` (training
blocks tokenized from a stream as training reaches them), `checks` (a batch checked against a model before a
forward pass), `pseudo_labels` (retention for classifiers: text labelled with the original's own decisions),
`retention` (the general-domain set forgetting is measured on, `"auto"` resolved for the model's task).
"""

from .batches import DOCUMENT_COLUMN, DataFormError, as_batches, as_rows, collate, data_form, documents_of
from .corpora import digits, fashion_mnist, python_docs_texts, shakespeare_texts, tweets_sentiment
from .lm_blocks import causal_lm_blocks, sampled_document_blocks, train_test_split_blocks
from .models import load_smollm2, minilm_path, smollm2_path
from .retention import load_retention
from .streaming import StreamedBlocks, StreamTooShortError, stream_data
from .sources import (
    EMBEDDED_SOURCES,
    SPLIT_PARTS,
    group_parts,
    images_to_pixels,
    infer_task,
    load_data,
    make_loader,
    split_dataset,
    split_fractions,
    split_parts,
)

__all__ = [
    "load_retention",
    "StreamTooShortError",
    "StreamedBlocks",
    "stream_data",
    "DOCUMENT_COLUMN",
    "EMBEDDED_SOURCES",
    "SPLIT_PARTS",
    "DataFormError",
    "as_batches",
    "as_rows",
    "causal_lm_blocks",
    "digits",
    "documents_of",
    "fashion_mnist",
    "group_parts",
    "load_smollm2",
    "minilm_path",
    "python_docs_texts",
    "sampled_document_blocks",
    "shakespeare_texts",
    "smollm2_path",
    "train_test_split_blocks",
    "tweets_sentiment",
    "collate",
    "data_form",
    "images_to_pixels",
    "infer_task",
    "load_data",
    "make_loader",
    "split_dataset",
    "split_fractions",
    "split_parts",
]
