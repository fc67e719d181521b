"""Benchmark: the probe over all L+1 positions vs the naive way, and vs one training step, on SmolLM2-135M.

    python benchmarks/bench_probe.py --batch-size 4 --block-size 256 --repeats 3 --out bench_probe.json

Same batch (the first `batch-size` Shakespeare blocks) for every method. Each repeat runs every
unit (the train step, the probe, the naive way at each k) once in a fresh random order, so that a
change of machine load hits all of them alike; medians over repeats are reported, as wall-clock
and as CPU time of the process (`time.process_time`, robust to other processes on a shared
machine when run with `--threads 1`).
- train step: forward + backward of the base model with weight gradients of every parameter
  (no optimizer step).
- probe: `hf_depthgrow.probe.signal.probe` at all 31 positions (native blocks, copy init), covariance
  and norm statistics included.
- naive: for each position k, grow a copy at k (not timed) and time one forward + backward with
  gradients for the new block's parameters only (the cheapest honest naive way); summed over k.
The naive gradients are also compared with the probe's signal (relative error per position).
Not a timed test: run it by hand and copy the printed table into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--naive-positions", default="all", help="'all' or a comma list (then naive is extrapolated, and says so)")
    p.add_argument("--out", default=None, help="write the raw timings as JSON here")
    return p.parse_args(argv)


def _report(args, num_layers, positions, naive_positions, wall, cpu, rel_errors, load_before, load_after) -> dict:
    """Medians per unit (naive scaled to every position when only some were measured) and the ratios."""
    scale = len(positions) / len(naive_positions)

    def medians(table):
        med = {u: statistics.median(v) for u, v in table.items()}
        return {
            "train_step": med["train_step"],
            "probe": med["probe"],
            "naive": scale * sum(med[f"naive_{k}"] for k in naive_positions),
        }

    med_wall, med_cpu = medians(wall), medians(cpu)
    report = {
        "model": "SmolLM2-135M-Instruct (float32)",
        "layers": num_layers,
        "positions": len(positions),
        "naive_positions_measured": len(naive_positions),
        "naive_extrapolated": len(naive_positions) != len(positions),
        "batch": f"{args.batch_size} x {args.block_size} tokens (Shakespeare)",
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_before_after": [load_before[0], load_after[0]],
        "median_wall_s": med_wall,
        "median_cpu_s": med_cpu,
        "probe_over_train_step": {"wall": med_wall["probe"] / med_wall["train_step"], "cpu": med_cpu["probe"] / med_cpu["train_step"]},
        "naive_over_probe": {"wall": med_wall["naive"] / med_wall["probe"], "cpu": med_cpu["naive"] / med_cpu["probe"]},
        "max_rel_error_probe_vs_naive": max(rel_errors),
        "wall_s": wall,
        "cpu_s": cpu,
    }
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_depthgrow import grow_depth, new_block_parameters, probe
    from hf_depthgrow.data import causal_lm_blocks, load_smollm2, shakespeare_texts
    from hf_depthgrow.losses import example_losses

    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.eval()
    num_layers = model.config.num_hidden_layers
    ids = causal_lm_blocks(tokenizer, shakespeare_texts(), args.block_size, max_blocks=args.batch_size)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    inputs = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    positions = list(range(num_layers + 1))
    naive_positions = positions if args.naive_positions == "all" else [int(k) for k in args.naive_positions.split(",")]

    def loss_of(m):
        out = m(**inputs, use_cache=False)
        return example_losses(out.logits, batch["labels"], causal=True).mean()

    def timed(fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return time.perf_counter() - wall, time.process_time() - cpu, out

    def train_step():
        loss_of(model).backward()

    def naive(k: int):
        grown = grow_depth(copy.deepcopy(model), [k])  # not timed
        params = [p for _, p in new_block_parameters(grown)]
        ids_new = {id(p) for p in params}
        for p in grown.parameters():
            p.requires_grad_(id(p) in ids_new)
        wall, cpu, grads = timed(lambda: torch.autograd.grad(loss_of(grown), params, allow_unused=True))
        return wall, cpu, float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))

    with torch.no_grad():  # warm-up: allocator, kernels, lazy init
        loss_of(model)
    load_before = os.getloadavg()
    # Every unit (train step, probe, naive at each k) once per repeat, in a fresh random order, so
    # that a change of machine load in the middle of a run hits all of them alike.
    units = ["train_step", "probe"] + [f"naive_{k}" for k in naive_positions]
    wall = {u: [] for u in units}
    cpu = {u: [] for u in units}
    rel_errors = []
    probe_signal, naive_signal = {}, {}
    rng = random.Random(0)
    for r in range(args.repeats):
        order = units[:]
        rng.shuffle(order)
        for unit in order:
            if unit == "train_step":
                w, c, _ = timed(train_step)
                model.zero_grad(set_to_none=True)
            elif unit == "probe":
                w, c, result = timed(lambda: probe(model, [batch], positions=positions, progress=False))
                probe_signal = dict(zip(result.positions, result.signal))
            else:
                k = int(unit.split("_")[1])
                w, c, norm = naive(k)
                naive_signal[k] = norm
            wall[unit].append(w)
            cpu[unit].append(c)
        print(f"repeat {r}: train step {wall['train_step'][-1]:.2f}s, probe {wall['probe'][-1]:.2f}s, "
              f"naive {sum(wall[f'naive_{k}'][-1] for k in naive_positions):.2f}s (wall)", flush=True)
    for k in naive_positions:
        rel_errors.append(abs(naive_signal[k] - probe_signal[k]) / naive_signal[k])
    load_after = os.getloadavg()
    report = _report(args, num_layers, positions, naive_positions, wall, cpu, rel_errors, load_before, load_after)
    print(json.dumps({k: v for k, v in report.items() if k not in ("wall_s", "cpu_s")}, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
