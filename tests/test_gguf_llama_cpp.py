"""Run exported GGUF files in llama.cpp itself (llama-cpp-python) and compare with transformers.

Opt-in: `pip install -e ".[llama_cpp]"` compiles llama.cpp from source (PyPI has only the sdist), so CI skips this.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from hf_depthgrow import grow_depth  # noqa: E402
from hf_depthgrow.hub.gguf_export import export_gguf  # noqa: E402
from hf_depthgrow.testing import byte_level_tokenizer, tiny_model  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
PROMPT = "To be, or not to be: the quick brown fox, whether nobler"
# An F32 file with an F32 KV cache leaves llama.cpp and torch differing only in float32 summation order (ggml's
# AVX2 / llamafile kernels against torch's): measured 1.6e-7 on these logits (within ±0.51), a few float32 ulps
# of the largest. 1e-5, the exporter tests' F32 tolerance, leaves 60x for other CPUs' kernels and is still 27x
# below the F16 rounding of the weights (2.7e-4, tests/test_gguf_export.py). A missing Q/K permutation, a doubled
# rope base or a wrong norm eps in the file each fail it (checked by patching the exporter).
ATOL_F32 = 1e-5


def run_llama_cpp(path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits (n_tokens x n_vocab) for `ids`, and its own token ids for `PROMPT`.

    The KV cache is F32: llama.cpp's default, F16, would round K and V, an error that is not the file's.
    """
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32), llm.tokenize(PROMPT.encode(), add_bos=False)
    finally:
        llm.close()


def test_llama_cpp_runs_the_grown_file_as_transformers_and_as_the_original_file(tmp_path):
    tokenizer = byte_level_tokenizer(TEXTS * 10)
    model = tiny_model("llama", vocab_size=len(tokenizer))
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    original = export_gguf(model, tokenizer, tmp_path / "original.gguf", dtype="f32")
    grow_depth(model, [1, 4])  # one block inside the stack, one on top
    grown = export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="f32")

    (ll_grown, ll_ids), (ll_original, _) = run_llama_cpp(grown, ids), run_llama_cpp(original, ids)
    assert ll_grown.shape == (len(ids), len(tokenizer))
    # llama.cpp computes the transformers model (the grown model equals the original exactly, tests/test_growth*) ...
    assert np.abs(ll_grown - expected).max() <= ATOL_F32
    assert (ll_grown.argmax(-1) == expected.argmax(-1)).all()
    # ... and the grown file what the original file computes: the new blocks add exact zeros to the residual stream
    # and the other layers run the same kernels on the same inputs, so the logits are identical, not merely close.
    np.testing.assert_array_equal(ll_grown, ll_original)
    # The vocabulary written from the Hugging Face tokenizer splits text in llama.cpp as the tokenizer does.
    assert ll_ids == ids
