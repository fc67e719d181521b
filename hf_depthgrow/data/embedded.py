"""Deprecated shim: the embedded models and corpora now live in `models`, `corpora` and `lm_blocks`.

Kept only so that importers not yet updated keep working during the reorganisation; import from
`hf_depthgrow.data.models` (SmolLM2, MiniLM), `hf_depthgrow.data.corpora` (Shakespeare, tweets,
Fashion-MNIST, digits) or `hf_depthgrow.data.lm_blocks` (causal-LM blocks) instead.

Example:
    ```python
    >>> from hf_depthgrow.data.models import load_smollm2  # not: from hf_depthgrow.data.embedded import ...
    ```
"""

from .corpora import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    TWEET_LABELS,
    digits,
    fashion_mnist,
    shakespeare_corpus_files,
    shakespeare_texts,
    tweets_sentiment,
)
from .lm_blocks import causal_lm_blocks, train_test_split_blocks
from .models import (
    CACHE_ENV,
    SMOLLM2_CACHE_NAME,
    SMOLLM2_GGUF_NAME,
    clean_float_copy,
    default_cache_root,
    load_smollm2,
    load_smollm2_gguf,
    minilm_path,
    smollm2_gguf_path,
    smollm2_path,
)

__all__ = [
    "CACHE_ENV",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "SMOLLM2_CACHE_NAME",
    "SMOLLM2_GGUF_NAME",
    "TWEET_LABELS",
    "causal_lm_blocks",
    "clean_float_copy",
    "default_cache_root",
    "digits",
    "fashion_mnist",
    "load_smollm2",
    "load_smollm2_gguf",
    "minilm_path",
    "shakespeare_corpus_files",
    "shakespeare_texts",
    "smollm2_gguf_path",
    "smollm2_path",
    "train_test_split_blocks",
    "tweets_sentiment",
]
