"""Chunked head + cross-entropy: peak memory and step time of one training step, plain vs chunked.

    python benchmarks/bench_chunked_ce.py                       # SmolLM2 (new blocks / all) + tiny 256k Llama
    python benchmarks/bench_chunked_ce.py --reps 3 --steps 4 --write-results

A step is one forward + backward (no optimizer) of `hf_depthgrow.chunked_loss.model_example_losses`,
token-weighted mean loss, on one random sequence of `--seq` tokens (batch 1):

- `plain`: `chunk_size=None`, the model's full `[1, seq, vocab]` logits and `losses.example_losses`;
- `chunked`: `chunk_size="auto"` (`resolve_chunk_size`: 170 tokens per chunk at vocabulary 49152, 64 at 262144,
  evened out over the 511 supervised tokens: 4 chunks of 128, 8 of 64);
- `body`: the decoder alone with a loss that needs no head (`hidden @ v`, summed): what the step costs
  without any head, so that `plain - body` and `chunked - body` are the head's share of the step.

Models: SmolLM2-135M (float32, `load_model("smollm2")`, tied head, vocabulary 49152) grown at k = 15,
(a) new block trainable only, (b) everything trainable; and a tiny random Llama (2 layers, d = 64, vocabulary
262144, untied head), everything trainable.

Memory: one fresh subprocess per (model, variant, repeat). After one warm-up step (which also runs the
chunked path's one-off self-check), freed heap is handed back (`malloc_trim`) and the kernel's peak-RSS
counter reset (`/proc/self/clear_refs`); the peak of the measured steps is then
`resource.getrusage(RUSAGE_SELF).ru_maxrss` and the step's increment is that peak minus the resident
size just before the steps. (`tracemalloc` would not see torch's allocations.)
Time: the process's CPU time per step (`time.process_time`, one torch thread) and the wall clock, over
the measured steps after the first (which page-faults back in the heap that `malloc_trim` handed back:
it cost the chunked path's reused chunk buffers ~1 s more in a trial run); the variants are interleaved
(their order rotates every repeat) so that load from other jobs hits all alike; medians over repeats of
each subprocess's median step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import write_section  # noqa: E402
REPO = HERE.parent
SECTION = "## Chunked cross-entropy: head memory in training"
CONFIGS = ("smollm2-new", "smollm2-all", "llama256k-all")
VARIANTS = ("plain", "chunked", "body")


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def build(config: str, seq: int):
    """The model (trainable set applied), its inputs and labels for `config`."""
    import torch

    from hf_depthgrow import grow_depth, new_block_parameters

    if config.startswith("smollm2"):
        from hf_depthgrow import load_model

        model, _ = load_model("smollm2")
        grow_depth(model, [15])
        new = {id(p) for _, p in new_block_parameters(model)}
        for p in model.parameters():
            p.requires_grad_(config.endswith("all") or id(p) in new)
    else:
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.LlamaConfig(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    model.float().train()
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}, ids.clone()


def worker(config: str, variant: str, seq: int, steps: int, threads: int) -> dict:
    import torch

    from hf_depthgrow.chunked_loss import model_example_losses, resolve_chunk_size

    torch.set_num_threads(threads)
    model, inputs, labels = build(config, seq)
    probe_vec = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def step() -> float:
        if variant == "body":
            hidden = model.get_decoder()(**inputs).last_hidden_state
            loss = (hidden @ probe_vec).sum()
        else:
            el = model_example_losses(model, inputs, labels, causal=True, chunk_size=None if variant == "plain" else "auto")
            loss = el.total.sum() / el.weight.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = step()  # warm-up (and the chunked path's self-check)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kb()
    cpu, wall = [], []
    for _ in range(steps):
        t0, w0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokens = int((labels[:, 1:] >= 0).sum())
    chunk = resolve_chunk_size("auto", tokens, model.config.vocab_size)
    chunk = -(-tokens // -(-tokens // chunk)) if chunk else None  # what model_example_losses runs: equal chunks
    timed = slice(1, None) if steps > 1 else slice(None)  # the first step after the trim re-faults the heap
    return {"config": config, "variant": variant, "loss": loss, "base_mb": base / 1024, "peak_mb": peak / 1024,
            "step_mb": (peak - base) / 1024, "cpu_s": statistics.median(cpu[timed]), "wall_s": statistics.median(wall[timed]),
            "cpu_steps": [round(t, 3) for t in cpu],
            "chunk": chunk if variant == "chunked" else None, "vocab": model.config.vocab_size}


def run_all(args) -> list[dict]:
    rows = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for rep in range(args.reps):
        for config in args.configs:
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]  # interleaved, rotated each repeat
            for variant in order:
                cmd = [sys.executable, __file__, "--worker", config, variant, "--seq", str(args.seq),
                       "--steps", str(args.steps), "--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append({**row, "rep": rep})
                print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        med = {}
        for v in VARIANTS:
            rs = [r for r in rows if r["config"] == config and r["variant"] == v]
            med[v] = {k: statistics.median(r[k] for r in rs) for k in ("peak_mb", "step_mb", "cpu_s", "wall_s", "loss")}
            med[v]["runs"] = len(rs)
            med[v]["cpu_all"] = [round(r["cpu_s"], 2) for r in rs]
        chunk = next(r["chunk"] for r in rows if r["config"] == config and r["variant"] == "chunked")
        head_plain = med["plain"]["step_mb"] - med["body"]["step_mb"]
        head_chunked = med["chunked"]["step_mb"] - med["body"]["step_mb"]
        out.append({"config": config, "chunk": chunk, **{f"{v}": med[v] for v in VARIANTS},
                    "head_plain_mb": head_plain, "head_chunked_mb": head_chunked,
                    "head_ratio": head_chunked / head_plain if head_plain > 0 else float("nan"),
                    "peak_ratio": med["chunked"]["peak_mb"] / med["plain"]["peak_mb"],
                    "cpu_ratio": med["chunked"]["cpu_s"] / med["plain"]["cpu_s"],
                    "wall_ratio": med["chunked"]["wall_s"] / med["plain"]["wall_s"]})
    return out


LABELS = {
    "smollm2-new": "SmolLM2-135M, k=15, new block trains",
    "smollm2-all": "SmolLM2-135M, k=15, everything trains",
    "llama256k-all": "tiny Llama, vocab 262144, everything trains",
}


def markdown(summary: list[dict], args) -> str:
    import torch

    cmd = "python benchmarks/bench_chunked_ce.py " + " ".join(f"--{k} {v}" for k, v in (("reps", args.reps), ("steps", args.steps), ("seq", args.seq))) + " --write-results"
    lines = [SECTION, "", f"Command: `{cmd}`", "",
             f"One training step (forward + backward, no optimizer) at sequence {args.seq}, batch 1, float32, "
             f"{args.threads} torch thread(s), x86_64 CPU ({os.cpu_count()} cores, **shared with other jobs while this ran**), "
             f"torch {torch.__version__}, Python {platform.python_version()}. Fresh subprocess per (model, variant, repeat); "
             f"{args.reps} repeats, interleaved (order rotated every repeat); {args.steps} measured steps after one warm-up each, "
             "all for memory, all but the first for time (it re-faults the heap handed back before it); medians. Peak memory: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of the measured steps, the kernel's "
             "counter reset after the warm-up (`/proc/self/clear_refs`); 'step MB' is that peak minus the resident "
             "size before the steps. 'head MB' = step MB minus that of `body` (the decoder alone with a head-free loss): "
             "the head's share. Time: process CPU s per step (wall s beside it).", "",
             "| model | chunk (tokens) | peak RSS plain / chunked MB | step MB plain / chunked / body | head MB plain / chunked | head ratio | CPU s plain / chunked | CPU ratio | wall ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        p, c, b = s["plain"], s["chunked"], s["body"]
        lines.append(
            f"| {LABELS.get(s['config'], s['config'])} | {s['chunk']} | {p['peak_mb']:.0f} / {c['peak_mb']:.0f} | "
            f"{p['step_mb']:.0f} / {c['step_mb']:.0f} / {b['step_mb']:.0f} | {s['head_plain_mb']:.0f} / {s['head_chunked_mb']:.0f} | "
            f"**{s['head_ratio']:.2f}** | {p['cpu_s']:.2f} / {c['cpu_s']:.2f} | **{s['cpu_ratio']:.3f}** | {s['wall_ratio']:.3f} |"
        )
    lines.append("")
    lines.append(verdict(summary))
    lines.append("")
    for s in summary:
        lines.append(f"- {s['config']}: loss plain {s['plain']['loss']:.6f}, chunked {s['chunked']['loss']:.6f}; CPU s per run "
                     f"plain {s['plain']['cpu_all']}, chunked {s['chunked']['cpu_all']}, body {s['body']['cpu_all']}.")
    return "\n".join(lines) + "\n"


# MB of the head weight's fp32 gradient where it trains: SmolLM2's tied 49152 x 576 embedding, the tiny
# Llama's 262144 x 64 head. Any method holds it when the head's backward runs, at the peak of activations.
HEAD_GRAD_MB = {"smollm2-all": 49152 * 576 * 4 / 2**20, "llama256k-all": 262144 * 64 * 4 / 2**20}


def verdict(summary: list[dict]) -> str:
    """Target: the head's share of the step's peak memory at least halved, CPU time within 5%."""
    parts = []
    for s in summary:
        grad = HEAD_GRAD_MB.get(s["config"], 0.0)
        extra = f"; both include the head weight's fp32 gradient, {grad:.0f} MB" if grad else ""
        halved = "halved or better" if s["head_ratio"] <= 0.5 else "NOT halved"
        speed = "at most 5% slower" if s["cpu_ratio"] <= 1.05 else "more than 5% slower"
        parts.append(f"{s['config']}: head memory {s['head_plain_mb']:.0f} -> {s['head_chunked_mb']:.0f} MB, "
                     f"x{s['head_ratio']:.3f} ({halved}{extra}); CPU time x{s['cpu_ratio']:.3f} ({speed})")
    return "Verdict (target: head share at least halved, speed within 5%): " + "; ".join(parts) + "."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "VARIANT"))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the runs and the summary here")
    ap.add_argument("--from-json", help="re-render the table from a --json file of an earlier run (no new runs)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.seq, args.steps, args.threads)))
        return
    rows = json.loads(Path(args.from_json).read_text())["rows"] if args.from_json else run_all(args)
    summary = summarize(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    text = markdown(summary, args)
    print(text)
    if args.write_results:
        write_section(HERE / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
