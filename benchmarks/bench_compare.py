"""`compare_plans` against the naive loop a user would write: one arm and one learning rate at a time.

Naive loop (public API only): for every arm and every learning rate of the grid, train a fresh copy
with `hf_depthgrow.training.train` to the full budget, keep the rate with the lowest held-out loss,
then score the kept model against the original with `compare_models` on the test and retention sets
(which runs the original again each time). `compare_plans` does the same work with the original's
losses computed once and successive halving over the grid (the worse half of the rates stops at 1/4
of the steps). Both see the same arms, data, steps and grid; the script checks that they choose the
same learning rates and reports the wall time of each, the median of `--repeats` runs, and the ratio.

    python benchmarks/bench_compare.py                      # a small random Llama (CI-sized)
    python benchmarks/bench_compare.py --model smollm2 --repeats 1 --max-steps 8 --examples 96
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.comparison import build_arms, compare_plans
from hf_depthgrow.evaluation import compare_models
from hf_depthgrow.testing import tiny_inputs, tiny_model
from hf_depthgrow.training import TrainConfig, train

GROWTH = ["top:1", "bottom:1", "interleave:2", "random:1"]
CONTROLS = ["layers", "lora"]


def _data(model, args):
    if args.model == "smollm2":
        from hf_depthgrow.data import load_data, split_dataset
        from hf_depthgrow import load_model

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
             "lora": {"trainable": "lora", "lora_r": arm.lora_r, "lora_alpha": 2 * (arm.lora_r or 1)}}.get(arm.kind, {})  # fmt: skip
    return TrainConfig(learning_rate=lr, max_steps=args.max_steps, per_device_train_batch_size=8, warmup_ratio=0.1,
                       selection_max_examples=32, save_final_model=False, progress_bar=False, logging_steps=args.max_steps,
                       **extra)  # fmt: skip


def naive(model, data, args) -> dict:
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
                           learning_rates=args.learning_rates, max_steps=args.max_steps, batch_size=8,
                           selection_max_examples=32, progress=False)  # fmt: skip
    return {a.name: a.learning_rate for a in result.arms if a.kind != "original"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if args.model == "smollm2":
        from hf_depthgrow import load_model

        model = load_model("smollm2")[0].eval()
    else:
        model = tiny_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512).eval()  # fmt: skip
    data = _data(model, args)
    times = {"naive": [], "compare_plans": []}
    agree = []
    for _ in range(args.repeats):
        for name, fn in (("naive", naive), ("compare_plans", shared)):
            started = time.perf_counter()
            out = fn(model, data, args)
            times[name].append(time.perf_counter() - started)
            if name == "naive":
                naive_lr = out
            else:
                agree.append(sum(naive_lr[k] == out[k] for k in out) / len(out))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model}: {len(GROWTH)} growth + {len(CONTROLS)} control arms, grid {args.learning_rates}, "
          f"{args.max_steps} steps, {args.repeats} repeats")  # fmt: skip
    print(f"naive loop     median {med['naive']:.1f} s  ({', '.join(f'{t:.1f}' for t in times['naive'])})")
    print(f"compare_plans  median {med['compare_plans']:.1f} s  ({', '.join(f'{t:.1f}' for t in times['compare_plans'])})")
    print(f"speed-up {med['naive'] / med['compare_plans']:.2f}x; same learning rate chosen for {statistics.mean(agree):.0%} of the arms")


if __name__ == "__main__":
    main()
