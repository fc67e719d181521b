"""Frozen-prefix caching: step time and peak memory on the real SmolLM2-135M (30 layers).

    python benchmarks/bench_prefix_cache.py                      # k = 15 and 25, seq 256, batch 2
    python benchmarks/bench_prefix_cache.py --positions 15 --steps 6 --write-results

One new block (native, copy init) is inserted at k; only it trains. Two step variants:

(a) uncached: the full forward + backward of the grown model (LLaMA-Pro style). Autograd already
    stops below the lowest trainable block, so the only saving left is the prefix *forward*.
(b) cached: this trainer's step with the frozen-prefix cache (`prefix_cache="memory"`): the prefix
    `z` of every training example was computed once up front, each step runs layers k.. + head.

Timing: one process per k, one `GrownTrainer`, the two variants alternate step by step (ab ba ...),
so drift from other load on the machine hits both alike; medians over the measured steps of the
process's CPU time per step (one thread), because on a shared machine the wall clock also measures
the other jobs. Wall medians are reported beside it.
Memory: one fresh process per (k, variant); after one warm-up step the kernel's peak-RSS counter is
reset (`echo 5 > /proc/self/clear_refs`), then `VmHWM` after the measured steps is the peak resident
memory of the training steps (model, optimizer, activations, and for (b) the cache itself).
`tracemalloc` would miss torch's allocations, hence the kernel counter.

Prediction: FLOPs from the config (see `flop_model`), forward = 1x; backward of the trainable block
= 2x (input and weight gradients); backward through the frozen layers above it and the tied head =
1x for linear layers (input gradients only), 2x for the attention core (Q, K and V are all
activations); nothing below k runs backward in either variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import write_section  # noqa: E402
REPO = HERE.parent
SECTION = "## Trainer: frozen-prefix caching"


# --------------------------------------------------------------------------- FLOP model


def flop_model(config, k: int, seq: int, num_layers: int | None = None) -> dict:
    """Forward/backward FLOPs per sequence (multiply-add = 2) of variants (a) and (b), and their ratio.

    `num_layers`: the original layer count L (default `config.num_hidden_layers`); one block is added at k.
    """
    d, f, V = config.hidden_size, config.intermediate_size, config.vocab_size
    L = num_layers or config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    T = seq
    linear = 2 * T * d * (heads * hd) * 2 + 2 * T * d * (kv * hd) * 2 + 3 * 2 * T * d * f  # q,o + k,v + gate/up/down
    core = 2 * 2 * T * T * heads * hd  # Q K^T and P V, dense (no causal skipping assumed)
    layer = linear + core
    head = 2 * T * d * V
    above = L - k  # original layers above the new block
    backward = (2 * linear + 2 * core) + above * (linear + 2 * core) + head
    fwd_a = (L + 1) * layer + head
    fwd_b = (above + 1) * layer + head
    a, b = fwd_a + backward, fwd_b + backward
    return {
        "layer_gflop": layer / 1e9,
        "linear_gflop": linear / 1e9,
        "attention_core_gflop": core / 1e9,
        "head_gflop": head / 1e9,
        "head_in_layers": head / layer,
        "forward_a_gflop": fwd_a / 1e9,
        "forward_b_gflop": fwd_b / 1e9,
        "backward_gflop": backward / 1e9,
        "step_a_gflop": a / 1e9,
        "step_b_gflop": b / 1e9,
        "predicted_speedup": a / b,
    }


# --------------------------------------------------------------------------- workers


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _trainer(args, mode: str):
    import torch

    from hf_depthgrow import grow_depth
    from hf_depthgrow.data import load_data, load_smollm2
    from hf_depthgrow.training import GrownTrainer, TrainConfig

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    grow_depth(model, [args.k], block="native", init="copy")
    ds = load_data("shakespeare", model=model, tokenizer=tokenizer, block_size=args.seq, max_examples=args.examples)
    cfg = TrainConfig(
        max_steps=10_000, per_device_train_batch_size=args.batch, learning_rate=1e-4, fallback=False,
        prefix_cache={"a": "off", "b": "memory", "c": "disk"}[mode], progress_bar=False, seed=0,
        prefix_cache_dir=tempfile.mkdtemp(prefix="bench-prefix-"),
    )
    trainer = GrownTrainer(model, cfg, ds)
    trainer.setup()
    return trainer


def worker_time(args) -> dict:
    from hf_depthgrow import growth_record

    trainer = _trainer(args, "b")
    cache = trainer.train_cache
    times = {"a": [], "b": []}  # CPU seconds of the process per step
    walls = {"a": [], "b": []}
    step = 0
    for i in range(args.warmup + args.steps):
        for mode in ("a", "b") if i % 2 == 0 else ("b", "a"):  # ab ba ab ...
            trainer.train_cache = cache if mode == "b" else None
            step += 1
            cpu0 = time.process_time()
            out = trainer.training_step(step)
            cpu = time.process_time() - cpu0
            if i >= args.warmup:
                times[mode].append(cpu)
                walls[mode].append(out["seconds"])
    # Cross-check of the analytic count: the FLOPs torch itself counts for one executed step of each variant.
    from torch.utils.flop_counter import FlopCounterMode

    counted = {}
    for mode in ("a", "b"):
        trainer.train_cache = cache if mode == "b" else None
        step += 1
        with FlopCounterMode(display=False) as counter:
            trainer.training_step(step)
        counted[mode] = counter.get_total_flops() / args.batch / 1e9
    return {
        "k": args.k,
        "loss_seconds": loss_cost(trainer, args),
        "counted_gflop_per_sequence": counted,
        "cpu_steps": {m: [round(t, 3) for t in ts] for m, ts in times.items()},
        "wall_steps": {m: [round(t, 3) for t in ts] for m, ts in walls.items()},
        "median_a": statistics.median(times["a"]),
        "median_b": statistics.median(times["b"]),
        "wall_median_a": statistics.median(walls["a"]),
        "wall_median_b": statistics.median(walls["b"]),
        "cache_build_seconds": trainer.cache_info["build_seconds"],
        "cache_bytes": trainer.cache_info["bytes"],
        "examples": len(trainer.train_dataset),
        "flops": flop_model(trainer.model.config, args.k, args.seq, growth_record(trainer.model).base_num_layers),
    }


def loss_cost(trainer, args, repeats: int = 5) -> float:
    """CPU seconds of the head loss alone (cross-entropy over the vocabulary, forward + backward) for one batch.

    Memory-bound and the same in both variants; a FLOP count does not see it.
    """
    import torch

    from hf_depthgrow.losses import example_losses

    vocab = trainer.model.config.vocab_size
    labels = torch.randint(0, vocab, (args.batch, args.seq))
    out = []
    for _ in range(repeats):
        logits = torch.randn(args.batch, args.seq, vocab, requires_grad=True)
        t0 = time.process_time()
        example_losses(logits, labels, causal=True).total.sum().backward()
        out.append(time.process_time() - t0)
    return statistics.median(out)


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc), so both variants start from their live memory."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def worker_memory(args) -> dict:
    import resource

    trainer = _trainer(args, args.mode)
    step = 1
    trainer.training_step(step)  # warm-up: allocator pools, lazy inits
    _trim_heap()
    rss_before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for _ in range(args.steps):
        step += 1
        trainer.training_step(step)
    return {
        "k": args.k,
        "mode": args.mode,
        "rss_before_steps_mb": rss_before / 1024,
        "peak_rss_during_steps_mb": _status_kb("VmHWM") / 1024,
        "ru_maxrss_whole_process_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cache_bytes": trainer.cache_info["bytes"] if trainer.cache_info else 0,
    }


# --------------------------------------------------------------------------- driver


HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "2000000000"}  # glibc: serve >32 MB buffers from the heap, reuse them


def _run_worker(kind: str, args, k: int, mode: str | None = None, allocator: str = "default") -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--k", str(k), "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps if kind == "time" else args.memory_steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--examples", str(args.examples)]
    if mode:
        cmd += ["--mode", mode]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(args.threads))
    if allocator == "heap":
        env.update(HEAP_ENV)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {kind} k={k} {mode or ''} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _refined(t: dict, batch: int) -> float:
    """Speed-up predicted by FLOPs plus the measured loss cost `c`: throughput r from (a), then t_b = F_b / r + c."""
    fl, c = t["flops"], t["loss_seconds"]
    rate = fl["step_a_gflop"] * batch / (t["median_a"] - c)
    return t["median_a"] / (fl["step_b_gflop"] * batch / rate + c)


def _markdown(results: list[dict], args, command: str) -> str:
    import platform

    import torch

    lines = [
        SECTION,
        "",
        f"Command: `{command}`",
        "",
        f"SmolLM2-135M-Instruct (30 layers, d=576, vocab 49152, tied head; float32 from the shipped GGUF), one native "
        f"block (copy init) at k, only it trains (AdamW). Sequence length {args.seq}, batch {args.batch}, "
        f"{args.examples} Shakespeare blocks; {platform.machine()} CPU ({os.cpu_count()} cores, shared with other jobs), "
        f"torch {torch.__version__}, {args.threads} thread(s). (a) = full forward + backward (LLaMA-Pro style: autograd "
        "stops below the new block by itself), (b) = this trainer's step on the frozen-prefix cache. The variants "
        f"alternate step by step in one process (a b b a ...); medians of {args.steps} measured steps each after "
        f"{args.warmup} warm-up round(s). Time is the process's CPU time per step (`time.process_time`, one thread): on "
        "this shared machine the wall clock measures the other jobs as much as the step; wall medians are listed too.",
        "",
        "| k | allocator | (a) CPU s/step | (b) CPU s/step | measured speed-up | predicted by FLOPs | measured / predicted | torch-counted FLOP ratio | loss CPU s/step | predicted, FLOPs + loss | measured / predicted | wall (a) s | wall (b) s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(r["k"], "default", r["time"]) for r in results] + [(r["k"], "heap", r["time_heap"]) for r in results if "time_heap" in r]
    for k, allocator, t in rows:
        measured = t["median_a"] / t["median_b"]
        pred = t["flops"]["predicted_speedup"]
        counted = t["counted_gflop_per_sequence"]
        refined = _refined(t, args.batch)
        lines.append(
            f"| {k} | {allocator} | {t['median_a']:.2f} | {t['median_b']:.2f} | **{measured:.3f}x** | {pred:.3f}x | {measured / pred:.3f} | "
            f"{counted['a'] / counted['b']:.3f}x | {t['loss_seconds']:.2f} | {refined:.3f}x | {measured / refined:.3f} | "
            f"{t['wall_median_a']:.2f} | {t['wall_median_b']:.2f} |"
        )
    lines += [
        "",
        "Allocator `default`: glibc as shipped, which serves every buffer above 32 MB with a fresh `mmap` and unmaps "
        "it when freed, so the 100 MB logits of each step, the log-softmax and their gradients are page-faulted in "
        "anew every step. `heap`: the same run with `MALLOC_MMAP_THRESHOLD_=2000000000`, so those buffers stay in the "
        "heap and are reused. 'loss CPU s/step' is the per-example cross-entropy over the 49k vocabulary alone "
        "(`hf_depthgrow.losses.example_losses`, forward + backward on a logits tensor of the step's shape), which both "
        "variants pay in full and a FLOP count does not see; 'predicted, FLOPs + loss' takes the matmul throughput "
        "from (a), `r = F_a / (t_a - c)`, and predicts `t_b = F_b / r + c`.",
        "",
        "Peak memory: a fresh process per variant; after one warm-up step freed heap memory is handed back "
        "(`malloc_trim`) and the kernel's peak-RSS counter reset (`/proc/self/clear_refs`); `VmHWM` after "
        f"{args.memory_steps} more steps is the peak resident memory of training: model, optimizer, activations and, "
        "for the in-memory cache, the cache itself. The disk cache is read with `pread`, so its pages stay in the "
        "kernel's page cache, outside the process. (`tracemalloc` would not see torch's allocations.)",
        "",
        "| k | peak RSS (a) MB | peak RSS (b), memory cache MB | peak RSS (b), disk cache MB | step increment (a) / (b mem) / (b disk) MB | cache MB | cache build s (wall) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, ma, mb, mc = r["time"], r["mem_a"], r["mem_b"], r["mem_c"]
        inc = [m["peak_rss_during_steps_mb"] - m["rss_before_steps_mb"] for m in (ma, mb, mc)]
        lines.append(
            f"| {r['k']} | {ma['peak_rss_during_steps_mb']:.0f} | {mb['peak_rss_during_steps_mb']:.0f} | "
            f"{mc['peak_rss_during_steps_mb']:.0f} | {inc[0]:.0f} / {inc[1]:.0f} / {inc[2]:.0f} | "
            f"{t['cache_bytes'] / 2**20:.1f} | {t['cache_build_seconds']:.1f} |"
        )
    f0 = results[0]["time"]["flops"]
    lines += [
        "",
        "FLOP count per sequence (multiply-add = 2 FLOPs), from the config: one layer "
        f"{f0['layer_gflop']:.3f} GFLOP ({f0['linear_gflop']:.3f} in the seven projections, {f0['attention_core_gflop']:.3f} "
        f"in QK^T and PV at T={args.seq}, dense); the LM head {f0['head_gflop']:.2f} GFLOP = {f0['head_in_layers']:.1f} layers. "
        "Forward 1x; backward of the new block 2x (input + weight gradients); backward through the frozen layers above "
        "it 1x for the projections and 2x for the attention core (Q, K, V are activations); frozen tied head 1x. "
        "(a) runs the forward of all 31 layers, (b) of the 31-k layers from the new block up; the backward is the same. "
        "Norms, softmax, SiLU, RoPE, the loss and the optimizer are not counted. torch's `FlopCounterMode` on one "
        "executed step of each variant gives the column 'torch-counted FLOP ratio' (torch has no FLOP formula for the CPU "
        "flash-attention kernel, so its totals below leave out QK^T and PV).",
        "",
    ]
    for r in results:
        fl, t = r["time"]["flops"], r["time"]
        c = t["counted_gflop_per_sequence"]
        lines.append(
            f"- k={r['k']}: (a) {fl['forward_a_gflop']:.1f} + {fl['backward_gflop']:.1f} = {fl['step_a_gflop']:.1f} GFLOP, "
            f"(b) {fl['forward_b_gflop']:.1f} + {fl['backward_gflop']:.1f} = {fl['step_b_gflop']:.1f} GFLOP per sequence "
            f"(torch counts {c['a']:.1f} and {c['b']:.1f}). CPU s per step (a) {t['cpu_steps']['a']}, (b) {t['cpu_steps']['b']}."
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[15, 25])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per variant (timing)")
    parser.add_argument("--memory-steps", type=int, default=2, help="measured steps per variant (memory)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="1: per-step CPU time is then the step's compute")
    parser.add_argument("--write-results", action="store_true", help=f"write the table into benchmarks/RESULTS.md ({SECTION})")
    parser.add_argument("--json", default=None, help="also write the raw measurements to this file")
    parser.add_argument("--allocators", nargs="+", default=["default", "heap"], choices=["default", "heap"],
                        help="time also with glibc keeping large buffers in the heap (MALLOC_MMAP_THRESHOLD_)")
    parser.add_argument("--worker", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["a", "b", "c"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        out = worker_time(args) if args.worker == "time" else worker_memory(args)
        print(json.dumps(out))
        return 0
    command = "python benchmarks/bench_prefix_cache.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for k in args.positions:
        t0 = time.time()
        r = {"k": k, "time": _run_worker("time", args, k)}
        if "heap" in args.allocators:
            r["time_heap"] = _run_worker("time", args, k, allocator="heap")
        r["mem_a"] = _run_worker("memory", args, k, "a")
        r["mem_b"] = _run_worker("memory", args, k, "b")
        r["mem_c"] = _run_worker("memory", args, k, "c")
        results.append(r)
        t = r["time"]
        print(f"k={k}: (a) {t['median_a']:.3f} CPU s (b) {t['median_b']:.3f} CPU s measured {t['median_a'] / t['median_b']:.3f}x "
              f"predicted {t['flops']['predicted_speedup']:.3f}x (with the loss cost {_refined(t, args.batch):.3f}x); peak RSS (a) {r['mem_a']['peak_rss_during_steps_mb']:.0f} MB "
              f"(b) {r['mem_b']['peak_rss_during_steps_mb']:.0f} MB (b, disk cache) {r['mem_c']['peak_rss_during_steps_mb']:.0f} MB "
              f"[{time.time() - t0:.0f}s]", flush=True)
    text = _markdown(results, args, command.strip())
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.write_results:
        write_section(HERE / "RESULTS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
