"""Both stepping stones at one position: two `stepping_stone` calls (the baseline) vs one `stepping_stones` set-up.

    python benchmarks/bench_stepping_stones.py --write-results          # SmolLM2-135M, the default run's settings
    python benchmarks/bench_stepping_stones.py --model tiny --repeats 1 # CPU smoke run (what CI runs)

`hf-depthgrow run` makes `f~_S` (direction from the training data) and `f~_pop` (from the held-out split) at the
probe's position, each with a line search over the step size on the same training batches. A user of the public API
would call `stepping_stone` twice; `stepping_stones` computes the prefix below the block and `L_S(f_old)` once for
both. Both arms get the probe's `G_S` (`gradient=`), as the run hands it over. Timed interleaved (the order rotates
per repeat), medians over `--repeats`; every repeat checks that both arms give the same stones (results and weights),
bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md helpers next to this script
from results_file import command_line, machine, publish  # noqa: E402

SECTION = "## Stepping stones: one set-up for both"
ARMS = ("two stepping_stone calls", "stepping_stones")


def load(args):
    """`(model, train rows, held-out rows)`: disjoint slices of one corpus."""
    if args.model == "tiny":
        from hf_depthgrow.testing import tiny_model

        model = tiny_model("llama", vocab_size=4096)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, 4096, (2 * args.batches * args.batch, args.seq), generator=g)
        rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    else:
        from hf_depthgrow import load_model
        from hf_depthgrow.data import load_data

        model, tokenizer = load_model("smollm2")
        rows = load_data("shakespeare", model=model, tokenizer=tokenizer, block_size=args.seq, max_examples=2 * args.batches * args.batch)
        rows = [rows[i] for i in range(len(rows))]
    model.eval()
    half = args.batches * args.batch
    return model, rows[:half], rows[half:]


def run_arm(arm: str, model, position: int, train, held_out, common: dict):
    """`(seconds, {"train": (model, result), "held_out": (model, result)})` of one arm."""
    from hf_depthgrow.probe import stepping_stone, stepping_stones

    start = time.perf_counter()
    if arm == "stepping_stones":
        stones = stepping_stones(model, position, train, held_out, **common)
    else:
        stones = {"train": stepping_stone(model, position, train, **common),
                  "held_out": stepping_stone(model, position, train, direction_data=held_out, **common)}
    return time.perf_counter() - start, stones


def same_stones(a: dict, b: dict) -> bool:
    for side in ("train", "held_out"):
        (model_a, info_a), (model_b, info_b) = a[side], b[side]
        if info_a.to_dict() != info_b.to_dict():
            return False
        if not all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values())):
            return False
    return True


def measure(args) -> dict:
    from hf_depthgrow.probe import probe

    model, train, held_out = load(args)
    position = min(args.position, model.config.num_hidden_layers)
    kept = probe(model, train, positions=[position], batch_size=args.batch, keep_gradients=True, progress=False)
    common = dict(batch_size=args.batch, max_batches=args.batches, gradient=kept.gradients[0])
    runs = {arm: [] for arm in ARMS}
    info = None
    for r in range(args.repeats):
        made = {}
        for arm in ARMS[r % 2 :] + ARMS[: r % 2]:  # rotate, so drift in the machine's load hits both alike
            seconds, made[arm] = run_arm(arm, model, position, train, held_out, common)
            runs[arm].append(seconds)
        if not same_stones(*made.values()):
            raise RuntimeError("the two arms made different stepping stones")
        info = {side: made["stepping_stones"][side][1] for side in ("train", "held_out")}
    return {"runs": runs, "position": position, "evaluations": {s: len(i.line_search) for s, i in info.items()}}


def markdown(result: dict, args, command: str) -> str:
    runs = result["runs"]
    med = {arm: statistics.median(runs[arm]) for arm in ARMS}
    name = "SmolLM2-135M-Instruct (fp32), Shakespeare" if args.model == "smollm2" else "tiny random Llama"
    evals = result["evaluations"]
    lines = [
        SECTION, "",
        f"Command ({date.today().isoformat()}): `{command}`", "",
        f"{name}; the stones at k = {result['position']}, each line search on {args.batches} training batches of "
        f"{args.batch} x {args.seq} tokens, `f~_pop`'s direction from {args.batches} held-out batches, the probe's `G_S` "
        f"given to both arms; line-search evaluations: {evals['train']} (`f~_S`), {evals['held_out']} (`f~_pop`), "
        f"`eta = 0` included. {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        f"Median wall seconds of {args.repeats} interleaved repeats; both arms' stones are identical, bit for bit.", "",
        "| arm | median s | runs (s) | vs two calls |",
        "|---|---:|---|---:|",
    ]
    for arm in ARMS:
        cells = ", ".join(f"{t:.2f}" for t in runs[arm])
        lines.append(f"| {arm} | {med[arm]:.2f} | {cells} | {med[ARMS[0]] / med[arm]:.2f}x |")
    lines += ["", "'vs two calls' is the two calls' median time over this row's: above 1, this row is faster."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--position", type=int, default=9, help="Where the stones grow (the default run's probe chose 9).")
    p.add_argument("--batches", type=int, default=4, help="Line-search batches (the run's --stone-max-batches).")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if min(args.batches, args.batch, args.repeats) < 1 or args.seq < 2 or args.position < 0:
        p.error("--batches, --batch and --repeats must be at least 1, --seq at least 2, --position at least 0")
    result = measure(args)
    publish(args, SECTION, markdown(result, args, command_line("bench_stepping_stones.py", argv)))
    return result


if __name__ == "__main__":
    main()
