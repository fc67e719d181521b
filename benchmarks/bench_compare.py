"""`compare_plans` against the naive loop a user would write: one arm and one learning rate at a time.

    python benchmarks/bench_compare.py --write-results                 # a small random Llama, 3 repeats
    python benchmarks/bench_compare.py --model smollm2 --repeats 1 --max-steps 8 --examples 96 --write-results
    python benchmarks/bench_compare.py --quick --repeats 1              # CPU smoke run (what CI runs)

Naive loop (public API only): for every arm and every learning rate of the grid, train a fresh copy
with `hf_depthgrow.training.train` to the full budget, keep the rate with the lowest held-out loss,
then score the kept model against the original with `compare_models` on the test and retention sets
(which runs the original again each time). `compare_plans` does the same work with the original's
losses computed once and successive halving over the grid (the worse half of the rates stops at 1/4
of the steps). Both see the same arms, data, steps and grid; the script reports how often they chose
the same learning rate, the wall time of each per repeat (the two alternate within a repeat, so drift
of the machine's load hits both), the medians and the ratio naive / compare_plans.

`--write-results` replaces the section "## Compare: shared arms against the naive loop, <model>" of
`--results` (default benchmarks/RESULTS.md) with the table, the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import command_line, publish  # noqa: E402

from hf_depthgrow import grow_depth  # noqa: E402
from hf_depthgrow.comparison import build_arms, compare_plans  # noqa: E402
from hf_depthgrow.evaluation import compare_models  # noqa: E402
from hf_depthgrow.testing import tiny_inputs, tiny_model  # noqa: E402
from hf_depthgrow.training import TrainConfig, train  # noqa: E402

SECTION = "## Compare: shared arms against the naive loop"


def section_heading(model: str) -> str:
    """One section per model, so the tiny and the SmolLM2 runs keep their own tables."""
    return f"{SECTION}, {'SmolLM2' if model == 'smollm2' else 'tiny random Llama'}"
GROWTH = ["top:1", "bottom:1", "interleave:2", "random:1"]
CONTROLS = ["layers", "lora"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--examples", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rates", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    p.add_argument("--quick", action="store_true", help="CI smoke sizes: 4 steps, 32 examples, two rates")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.max_steps, args.examples, args.learning_rates = 4, 32, [1e-3, 3e-3]
    if args.repeats < 1 or args.max_steps < 4 or args.examples < 16:
        p.error("--repeats >= 1, --max-steps >= 4 and --examples >= 16 are needed")
    return args


def _data(model, args):
    if args.model == "smollm2":
        from hf_depthgrow import load_model
        from hf_depthgrow.data import load_data, split_dataset

        _, tok = load_model("smollm2")
        ds = load_data("shakespeare", model=model, tokenizer=tok, block_size=64, max_examples=args.examples, seed=0)
        splits = split_dataset(ds, {"train": 0.6, "held_out": 0.15, "test": 0.25}, seed=0)
        ret = load_data("python_docs", model=model, tokenizer=tok, block_size=64, max_examples=args.examples // 4, seed=0)
        return splits["train"], splits["held_out"], splits["test"], ret

    def rows(n, seed):
        batch = tiny_inputs(model, batch=n, seq=32, seed=seed)
        batch["labels"] = batch["input_ids"].clone()
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]

    n = args.examples
    return rows(n, 0), rows(n // 4, 1), rows(n // 2, 2), rows(n // 4, 3)


def _config(arm, lr, args) -> TrainConfig:
    extra = {"layers": {"trainable": "layers", "trainable_layers": arm.layers},
             "lora": {"trainable": "lora", "lora_r": arm.lora_r, "lora_alpha": 2 * (arm.lora_r or 1)}}.get(arm.kind, {})
    return TrainConfig(learning_rate=lr, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size, warmup_ratio=0.1,
                       selection_max_examples=32, save_final_model=False, progress_bar=False, logging_steps=args.max_steps,
                       **extra)


def naive(model, data, args) -> dict:
    """Every arm x every rate to the full budget, then each kept model scored against the original."""
    train_rows, heldout, test, retention = data
    chosen = {}
    for arm in build_arms(model, GROWTH, CONTROLS, seed=0)[1:]:
        best = None
        for lr in args.learning_rates:
            fresh = grow_depth(copy.deepcopy(model), arm.positions) if arm.kind == "growth" else copy.deepcopy(model)
            result = train(fresh, train_rows, eval_data=heldout, config=_config(arm, lr, args))
            if best is None or result.eval_loss_selected < best[1].eval_loss_selected:
                best = (lr, result)
        compare_models(model, best[1].model, test, n_bootstrap=2000, metrics=False)
        compare_models(model, best[1].model, retention, n_bootstrap=2000, metrics=False)
        chosen[arm.name] = best[0]
    return chosen


def shared(model, data, args) -> dict:
    train_rows, heldout, test, retention = data
    result = compare_plans(model, train_rows, heldout, test, retention_data=retention, growth=GROWTH, controls=CONTROLS,
                           learning_rates=args.learning_rates, max_steps=args.max_steps, batch_size=args.batch_size,
                           selection_max_examples=32, progress=False, successive_halving=True, lr_extensions=0,
                           allow_repeated_data=True)  # a timing, like the naive loop's: blocks may repeat
    return {a.name: a.learning_rate for a in result.arms if a.kind != "original"}


def _load_model(args):
    if args.model == "smollm2":
        from hf_depthgrow import load_model

        return load_model("smollm2")[0].eval()
    return tiny_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512).eval()


def measure(args) -> dict:
    """Both ways `--repeats` times, alternating; wall seconds per repeat and the rates each chose."""
    model = _load_model(args)
    data = _data(model, args)
    times = {"naive": [], "compare_plans": []}
    agree = []
    for r in range(args.repeats):
        order = (("naive", naive), ("compare_plans", shared))
        chosen = {}
        for name, fn in order if r % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            with warnings.catch_warnings():  # the naive loop's data-derived loss bound warns once per call
                warnings.simplefilter("ignore", UserWarning)
                chosen[name] = fn(model, data, args)
            times[name].append(time.perf_counter() - started)
            print(f"repeat {r + 1}/{args.repeats}: {name} {times[name][-1]:.1f} s", file=sys.stderr)
        agree.append(sum(chosen["naive"][k] == v for k, v in chosen["compare_plans"].items()) / len(chosen["compare_plans"]))
    ratios = [a / b for a, b in zip(times["naive"], times["compare_plans"])]
    return {"times": times, "ratios": ratios, "agree": agree, "arms": len(GROWTH) + len(CONTROLS),
            "sizes": [len(d) for d in data]}


def section_text(m: dict, args, command: str, load: tuple) -> str:
    med = {k: statistics.median(v) for k, v in m["times"].items()}
    n_train, n_held, n_test, n_ret = m["sizes"]
    what = ("SmolLM2-135M-Instruct (fp32), Shakespeare blocks of 64 tokens, retention on Python docs" if args.model == "smollm2"
            else "a random Llama (8 layers, d = 64, vocabulary 512), sequences of 32 random tokens")
    fmt = ", ".join
    return "\n".join([
        section_heading(args.model), "",
        f"Command: `{command}`", "",
        f"{what}; {len(GROWTH)} growth arms ({fmt(GROWTH)}) and {len(CONTROLS)} controls ({fmt(CONTROLS)}), "
        f"{args.max_steps} steps of {args.batch_size} examples per arm, learning-rate grid {args.learning_rates}; "
        f"{n_train} training, {n_held} held-out, {n_test} test and {n_ret} retention examples. "
        f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load[0]:.2f} before, {load[1]:.2f} after; {date.today().isoformat()}.", "",
        "| | naive loop (s) | `compare_plans` (s) | naive / compare_plans |",
        "|---|---:|---:|---:|",
        *[f"| repeat {i + 1} | {a:.1f} | {b:.1f} | {a / b:.2f}x |" for i, (a, b) in enumerate(zip(m["times"]["naive"], m["times"]["compare_plans"]))],
        f"| **median** | **{med['naive']:.1f}** | **{med['compare_plans']:.1f}** | **{statistics.median(m['ratios']):.2f}x** "
        f"(ratio of medians {med['naive'] / med['compare_plans']:.2f}x) |", "",
        f"Both chose the same learning rate for {statistics.mean(m['agree']):.0%} of the arms (successive halving can stop "
        "a rate that would have won at the full budget; where they differ, the naive loop's choice is the exact one).", "",
    ])


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    m = measure(args)
    command = command_line("bench_compare.py", argv)
    publish(args, section_heading(args.model), section_text(m, args, command, (load_before, os.getloadavg()[0])))
    return m


if __name__ == "__main__":
    main()
