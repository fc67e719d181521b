"""Serve a grown model with vLLM and check that at init it generates what the original does.

Two halves, because vLLM lives in its own environment (its wheels pin their own torch):

    python recipes/serve_vllm_check.py prepare runs/serve             # this package's environment
    /path/to/vllm-env/bin/python recipes/serve_vllm_check.py check runs/serve

`prepare` writes four checkpoints with plain `save_pretrained` folders (native growth, so no hf_depthgrow code is
needed to load them): SmolLM2-135M as shipped and grown with `interleave:6` (30 -> 36 layers), and a random
Gemma-3 text model (6 layers, sliding window 8, the SmolLM2 tokenizer) as built and grown by one whole period
of six blocks at the top (6 -> 12 layers, every 6th layer full). `check` loads each pair in vLLM (float32,
greedy) and compares the generated token ids on prompts longer than the sliding window. Exit 0 when every
pair matches token for token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is a city on the Seine whose best-known tower was built for the fair of",
]
PAIRS = {"smollm2": ("smollm2-original", "smollm2-interleave6"), "gemma3": ("gemma3-original", "gemma3-period6")}
NEW_TOKENS = 24


def prepare(out: Path) -> None:
    import torch
    import transformers

    from hf_depthgrow import grow_depth, load_model, save_pretrained

    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model("smollm2")
    save_pretrained(model, out / "smollm2-original", tokenizer=tokenizer)
    grow_depth(model, "interleave:6")
    save_pretrained(model, out / "smollm2-interleave6", tokenizer=tokenizer)

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    gemma = transformers.Gemma3ForCausalLM(config).eval()
    save_pretrained(gemma, out / "gemma3-original", tokenizer=tokenizer)
    grow_depth(gemma, [{"at": 6, "copy_from": i} for i in range(6)])
    save_pretrained(gemma, out / "gemma3-period6", tokenizer=tokenizer)
    print(json.dumps({name: json.loads((out / name / "config.json").read_text())["num_hidden_layers"]
                      for pair in PAIRS.values() for name in pair}))


def check(out: Path) -> int:
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ids = {}
    for pair in PAIRS.values():
        for name in pair:
            llm = LLM(model=str(out / name), dtype="float32", gpu_memory_utilization=0.15, max_model_len=512,
                      enforce_eager=True, trust_remote_code=False)
            ids[name] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
            del llm
    report = {}
    for family, (original, grown) in PAIRS.items():
        same = [a == b for a, b in zip(ids[original], ids[grown])]
        report[family] = {"prompts": len(PROMPTS), "identical": sum(same), "new_tokens": NEW_TOKENS}
    print(json.dumps(report, indent=2))
    return 0 if all(r["identical"] == r["prompts"] for r in report.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("prepare", "check"):
        sys.exit("usage: serve_vllm_check.py prepare|check FOLDER")
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        sys.exit(check(Path(sys.argv[2])))
