"""Small helpers the commands share."""

from __future__ import annotations


def load_tokenizer_if_any(path: str):
    """The tokenizer saved beside a model, or `None` (vision models have none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
