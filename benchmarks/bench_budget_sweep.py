"""A budget sweep (`compare_plans(budgets=...)`) against what a user would otherwise run: one comparison per budget.

    python benchmarks/bench_budget_sweep.py --write-results                      # a small random Llama, 3 repeats
    python benchmarks/bench_budget_sweep.py --quick --repeats 1                   # CPU smoke run (what CI runs)

Separate runs: for every budget B of `--budgets` (four doubling budgets by default), `compare_plans` with
`budgets=[B]` on the warmup-stable-decay schedule of B (the same warm-up, the same per-arm grids). The
sweep: one `compare_plans` with every budget, which trains each arm and rate once on the largest budget's
schedule and branches a decay at each smaller one. The branches are the standalone runs, so the two must
give the same per-example test losses at every budget; the script checks that (and stops if not), then
reports the wall time of each per repeat (alternating within a repeat), the medians and the ratio
sweep / separate (goal <= 0.75x for four doubling budgets).

`--write-results` replaces the section "## Budget sweep against one comparison per budget, <model>" of
`--results` (default benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from bench_compare import _data, _load_model  # noqa: E402  the same models and data as the compare benchmark
from results_file import command_line, machine, publish  # noqa: E402

from hf_depthgrow.comparison import compare_plans  # noqa: E402

SECTION = "## Budget sweep against one comparison per budget"
GROWTH = ["top:1", "interleave:2"]
CONTROLS = ["layers", "lora"]


def section_heading(model: str) -> str:
    return f"{SECTION}, {'SmolLM2' if model == 'smollm2' else 'tiny random Llama'}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budgets", type=int, nargs="+", default=[10, 20, 40, 80])
    p.add_argument("--examples", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="CI smoke sizes: budgets 4 8, 32 examples, one rate per arm")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.budgets, args.examples = [4, 8], 32
    if args.repeats < 1 or len(args.budgets) < 2 or args.examples < 16:
        p.error("--repeats >= 1, at least 2 --budgets and --examples >= 16 are needed")
    return args


def _settings(args) -> dict:
    grids = {"growth_learning_rates": [3e-3], "layers_learning_rates": [1e-3], "lora_learning_rates": [3e-3]} if args.quick else {}
    # The warm-up is fixed in steps, so every separate run warms up exactly as the sweep does. A timing: a repeated
    # block costs what a new one does, so the sizes may repeat training blocks.
    return {"growth": GROWTH, "controls": CONTROLS, "batch_size": args.batch_size, "warmup_steps": 1, "lr_scheduler": "wsd",
            "progress": False, "n_bootstrap": 200, "lr_extensions": 0, "allow_repeated_data": True, **grids}


def sweep(model, data, args) -> dict:
    train, held, test, ret = data
    result = compare_plans(model, train, held, test, retention_data=ret, budgets=args.budgets, **_settings(args))
    return {v.steps: {a.name: a.test_per_example for a in v.arms} for v in result.views}


def separate(model, data, args) -> dict:
    train, held, test, ret = data
    out = {}
    for b in args.budgets:
        result = compare_plans(model, train, held, test, retention_data=ret, budgets=[b], **_settings(args))
        out[b] = {a.name: a.test_per_example for a in result.arms}
    return out


def measure(args) -> dict:
    """Both ways `--repeats` times, alternating; stops if the sweep's per-budget results differ from the separate runs'."""
    model = _load_model(args)
    data = _data(model, args)
    times = {"separate": [], "sweep": []}
    for r in range(args.repeats):
        order = (("separate", separate), ("sweep", sweep))
        got = {}
        for name, fn in order if r % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            got[name] = fn(model, data, args)
            times[name].append(time.perf_counter() - started)
            print(f"repeat {r + 1}/{args.repeats}: {name} {times[name][-1]:.1f} s", file=sys.stderr)
        for b in args.budgets:
            for arm, losses in got["separate"][b].items():
                if not np.array_equal(losses, got["sweep"][b][arm]):
                    raise SystemExit(f"the sweep's {arm} at {b} steps differs from its separate run: not the same work")
    ratios = [s / p for s, p in zip(times["sweep"], times["separate"])]
    return {"times": times, "ratios": ratios, "sizes": [len(d) for d in data]}


def section_text(m: dict, args, command: str, load: tuple) -> str:
    med = {k: statistics.median(v) for k, v in m["times"].items()}
    n_train, n_held, n_test, n_ret = m["sizes"]
    what = ("SmolLM2-135M-Instruct (fp32), Shakespeare blocks of 64 tokens, retention on Python docs" if args.model == "smollm2"
            else "a random Llama (8 layers, d = 64, vocabulary 512), sequences of 32 random tokens")
    steps_sep, steps_sweep = sum(args.budgets), max(args.budgets) + sum(-(-b // 5) for b in args.budgets[:-1])
    return "\n".join([
        section_heading(args.model), "",
        f"Command: `{command}`", "",
        f"{what}; arms {', '.join(GROWTH + CONTROLS)}, each kind's learning-rate grid, budgets {args.budgets} steps of "
        f"{args.batch_size} examples (WSD, decay over the last 20% of each); {n_train} training, {n_held} held-out, "
        f"{n_test} test and {n_ret} retention examples. Optimizer steps per arm and rate: {steps_sep} separately, "
        f"{steps_sweep} in the sweep. {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after; {date.today().isoformat()}. Every arm's per-example test losses at "
        "every budget were identical both ways (checked). The sweep's time also covers what only it computes: the learning-curve "
        "fits, the predicted crossover and its validation (3+ budgets).", "",
        "| | separate runs (s) | sweep (s) | sweep / separate |",
        "|---|---:|---:|---:|",
        *[f"| repeat {i + 1} | {a:.1f} | {b:.1f} | {b / a:.2f}x |" for i, (a, b) in enumerate(zip(m["times"]["separate"], m["times"]["sweep"]))],
        f"| **median** | **{med['separate']:.1f}** | **{med['sweep']:.1f}** | **{statistics.median(m['ratios']):.2f}x** |", "",
    ])


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    m = measure(args)
    command = command_line("bench_budget_sweep.py", argv)
    publish(args, section_heading(args.model), section_text(m, args, command, (load_before, os.getloadavg()[0])))
    return m


if __name__ == "__main__":
    main()
