"""Memory of a frozen base quantised by bitsandbytes (4-bit NF4, 8-bit) against float32: base bytes and peak RSS.

    python benchmarks/bench_quantized_base.py --model smollm2 --positions 15 --steps 4 --write-results

Each variant (float32, 4bit, 8bit) runs in a fresh process, one after the other in this run: load the base
(`load_model(..., quantize=)`), grow it at `--positions` (new blocks in float32), train only the new blocks for
`--steps` AdamW steps (sequences of `--seq` tokens, batch `--batch`), and report the base's weight bytes (every
tensor of its state dict: packed weights, quantisation scales, norms, embeddings) and the process's peak resident
memory (`VmHWM`). The held-out loss before and after is printed too, so the runs are seen to train.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md helpers next to this script
from results_file import command_line, machine, publish  # noqa: E402

SECTION = "## A quantised frozen base: memory"
VARIANTS = ("float32", "4bit", "8bit")


def _status_mib(key: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith(key + ":"))) / 1024


def _settle() -> None:
    """Garbage collected and freed heap handed back, then the kernel's peak-RSS counter reset to the current RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    Path("/proc/self/clear_refs").write_text("5")


def _state_bytes(model) -> int:
    # Each storage once: a tied head shares the embedding's.
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def variant(args) -> dict:
    """One variant in this process: load, grow, train; what it measured."""
    import torch

    from hf_depthgrow import grow_depth, load_model, train
    from hf_depthgrow.data import load_data
    from hf_depthgrow.testing import tiny_model

    torch.set_num_threads(args.threads)
    quantize = None if args.variant == "float32" else args.variant
    start = time.perf_counter()
    if args.model == "tiny":
        folder = Path(args.tmp) / "tiny"
        if not folder.exists():
            tiny_model("llama", hidden_size=64, intermediate_size=128).save_pretrained(folder)
        model, _ = load_model(folder, quantize=quantize)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, model.config.vocab_size, (args.examples, args.seq), generator=g)
        rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    else:
        model, tokenizer = load_model(args.model, quantize=quantize)
        rows = load_data("shakespeare", model=model, tokenizer=tokenizer, block_size=args.seq, max_examples=args.examples)
        rows = [rows[i] for i in range(len(rows))]
    base_bytes = _state_bytes(model)
    load_s, peak_load = time.perf_counter() - start, _status_mib("VmHWM")
    grow_depth(model, args.positions)
    _settle()
    rss_loaded, rss_file = _status_mib("VmRSS"), _status_mib("RssFile")
    held_out, train_rows = rows[: args.batch], rows[args.batch :]
    result = train(model, train_rows, eval_data=held_out, max_steps=args.steps, learning_rate=1e-3, fallback=False,
                   per_device_train_batch_size=args.batch, progress_bar=False, prefix_cache="off")
    return {
        "variant": args.variant, "base_bytes": base_bytes, "load_s": load_s, "peak_load_mib": peak_load,
        "rss_loaded_mib": rss_loaded, "rss_file_mib": rss_file, "peak_train_mib": _status_mib("VmHWM"), "trainable": result.num_trainable_parameters,
        "eval_before": result.eval_loss_before, "eval_after": result.eval_loss_after,
    }


def markdown(rows: list[dict], args, command: str) -> str:
    import torch

    base = {r["variant"]: r for r in rows}["float32"]
    name = "SmolLM2-135M-Instruct (30 layers, d = 576)" if args.model == "smollm2" else "a tiny random Llama (4 layers, d = 64)"
    import bitsandbytes

    lines = [
        SECTION, "",
        f"Command: `{command}`", "",
        f"{name}, grown at {args.positions} (new blocks in float32, copy init), only the new blocks trained: {args.steps} AdamW "
        f"steps of {args.batch} {'Shakespeare' if args.model == 'smollm2' else 'random'} sequences of {args.seq} tokens, {args.threads} torch thread(s), prefix cache off. Each "
        f"variant in a fresh process, one after the other in this run. {machine()}, torch {torch.__version__}, bitsandbytes "
        f"{bitsandbytes.__version__} (its CPU backend), Python {platform.python_version()}; {date.today().isoformat()}.", "",
        "| base | base weights MiB (ratio) | peak RSS while loading MiB (ratio) | RSS loaded and grown MiB (ratio) | of it file-backed MiB | peak RSS while training MiB (ratio) | trainable parameters | held-out loss before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]

    def cell(r, key, scale=1.0):
        return f"{r[key] * scale:.0f} ({r[key] / base[key]:.3f})"

    for r in rows:
        lines.append(
            f"| {r['variant']} | {cell(r, 'base_bytes', 2**-20)} | {cell(r, 'peak_load_mib')} | {cell(r, 'rss_loaded_mib')} | {r['rss_file_mib']:.0f} | "
            f"{cell(r, 'peak_train_mib')} | {r['trainable']:,} | {r['eval_before']:.3f} / {r['eval_after']:.3f} |"
        )
    for r in rows[1:]:
        lines += ["", (
            f"{r['variant']}: the base holds {r['base_bytes'] / base['base_bytes']:.0%} of the float32 base's weight bytes; the "
            f"process {r['rss_loaded_mib'] / base['rss_loaded_mib']:.0%} of its resident memory once loaded and "
            f"{r['peak_train_mib'] / base['peak_train_mib']:.0%} of its training peak (the libraries, the float embeddings and "
            f"head, activations and the new blocks' optimizer state are not quantised), but "
            f"{r['peak_load_mib'] / base['peak_load_mib']:.1f}x its loading peak: transformers reads the full-precision weights "
            "to quantise them, where the float32 load only maps the file."
        )]
    lines += [
        "",
        "Base weights: every storage of the loaded base's state dict before growth, each once (a tied head shares the "
        "embedding's). 4-bit holds two weights per byte plus one float32 scale per 64, 8-bit one byte per weight plus a scale "
        "per row; embeddings, head and norms stay in float32, as bitsandbytes leaves them. The RSS columns count the whole "
        "process (torch and the libraries too): its peak while `load_model` ran, its resident memory once loaded and grown "
        "(garbage collected, freed heap handed back; file-backed: pages of mapped files, the float32 base's weights among them, as transformers maps the safetensors file and uses its tensors in place), and its peak while training (the kernel's counter reset just before "
        "`train`: the weights, the new blocks' AdamW state, activations and the data).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--positions", type=int, nargs="+", default=[15])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--examples", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process: run this one variant
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(variant(args)))
        return []
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["float32", *[v for v in args.variants if v != "float32"]]:
            child = [sys.executable, __file__, "--variant", name, "--tmp", tmp, "--model", args.model, "--positions",
                     *map(str, args.positions), "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                     "--examples", str(args.examples), "--threads", str(args.threads)]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    publish(args, SECTION, markdown(rows, args, command_line("bench_quantized_base.py", argv)))
    return rows


if __name__ == "__main__":
    main()
