"""Sequential stopping of the probe (`probe(..., stop_patience=N)`): where it would stop, what it saves, what it changes.

    python benchmarks/bench_probe_stop.py --write-results        # SmolLM2 on the default run's training split
    python benchmarks/bench_probe_stop.py --quick                # a tiny random Llama (CPU smoke run, what CI runs)

One full probe (every batch the default run reads: `probe_max_batches`) records, after each batch, the
recommendation (grow or not, and the positions ranked by z) that `stop_patience` watches, and the
z-scores' standard errors. Stopping with patience N is a pure function of that trace (the first batch,
from 4 on, after which the recommendation was unchanged N times), so one run gives every N. For each
N the table shows the batch it stops at, the share of the probe's time it saves (the probe's cost is
linear in batches: one forward and backward each), whether the top position and the grow verdict agree
with the full probe, and how much wider the standard errors are at the stop (median over positions).

`--write-results` replaces the section "## Probe: sequential stopping" of `--results`
(default benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_file import command_line, publish  # noqa: E402

from hf_depthgrow import load_model, probe  # noqa: E402

# The probe's documented rule: stop from this many batches on (tests/test_bench_probe_stop.py checks the two agree).
MIN_BATCHES = 4
SECTION = "## Probe: sequential stopping"
PATIENCES = (2, 3, 4, 6)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny random Llama instead of SmolLM2")
    p.add_argument("--patience", type=int, nargs="+", default=list(PATIENCES))
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    return p.parse_args(argv)


def load(quick: bool):
    """(model, training rows, batch size, max batches, description): the default run's probe input."""
    from hf_depthgrow.pipeline import RunConfig

    cfg = RunConfig()
    if quick:
        from hf_depthgrow.testing import tiny_inputs, tiny_model

        torch.manual_seed(0)
        model = tiny_model("llama").eval()
        batch = tiny_inputs(model, batch=64, seq=16, seed=0)
        rows = [{k: v[i] for k, v in batch.items()} for i in range(64)]
        return model, rows, 8, 8, "a tiny random Llama, 64 random sequences of 16 tokens"
    from hf_depthgrow.data import load_data, split_parts

    model, tok = load_model(cfg.model)
    model.eval()
    data = load_data(cfg.data, model=model, tokenizer=tok, block_size=cfg.block_size, max_examples=cfg.max_examples,
                     seed=cfg.resolved_split_seed)
    train = split_parts(data, cfg.train_fraction, cfg.held_out_fraction, cfg.test_fraction,  # the run's own split
                        seed=cfg.resolved_split_seed, by=cfg.split_by)["train"]
    what = f"SmolLM2-135M-Instruct (fp32), the default run's {len(train)} Shakespeare training blocks of {cfg.block_size} tokens"
    return model, train, cfg.batch_size, cfg.probe_max_batches, what


def traced_probe(model, rows, batch_size: int, max_batches: int):
    """A full probe, and after each batch from the 3rd: (batches, (grow, ranked positions), median z standard error)."""
    t0 = time.perf_counter()
    # A patience no probe reaches: the stop only watches (`recommendation_trace`), it never stops.
    result = probe(model, rows, batch_size=batch_size, max_batches=max_batches, progress=False, stop_patience=10**6)
    seconds = time.perf_counter() - t0
    trace = [(t["batches"], (t["grow"], tuple(t["positions"])), t["median_se"]) for t in result.recommendation_trace]
    return result, trace, seconds


def stop_batch(trace, patience: int) -> int:
    """Where `stop_patience=patience` stops, from the trace (the rule `probe` applies batch by batch)."""
    same, last = 0, None
    for batches, rec, _ in trace:
        same = same + 1 if rec == last else 0
        last = rec
        if batches >= MIN_BATCHES and same >= patience:
            return batches
    return trace[-1][0]


def rows_for(trace, patiences, full_rec) -> list[dict]:
    total, se_full = trace[-1][0], trace[-1][2]
    by_batch = {b: (rec, se) for b, rec, se in trace}
    out = []
    for p in patiences:
        b = stop_batch(trace, p)
        rec, se = by_batch[b]
        out.append({
            "patience": p, "stop": b, "total": total, "saved": 1 - b / total,
            "same_grow": rec[0] == full_rec[0], "same_top": rec[1][:1] == full_rec[1][:1], "same_ranking": rec[1] == full_rec[1],
            "se_ratio": se / se_full if se_full else math.nan, "rec": rec,
        })
    return out


def render(rows, trace, full_rec, seconds, what, argv) -> str:
    command = command_line("bench_probe_stop.py", argv)
    lines = [
        SECTION, "", f"Command: `{command}`", "",
        f"{what}; one full probe of {rows[0]['total']} batches took {seconds:.1f} s and recommended "
        f"{'grow at' if full_rec[0] else 'not growing;'} {list(full_rec[1])} (ranked by z). "
        f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; {date.today()}.", "",
        "| patience | stops at batch | probe time saved | same verdict | same top position | same ranking | z standard error at the stop / full |",
        "|---:|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['patience']} | {r['stop']} of {r['total']} | {r['saved']:.0%} (~{r['saved'] * seconds:.0f} s) | "
            f"{'yes' if r['same_grow'] else 'no'} | {'yes' if r['same_top'] else 'no'} | {'yes' if r['same_ranking'] else 'no: ' + str(list(r['rec'][1]))} | "
            f"{r['se_ratio']:.2f}x |"
        )
    tops = [rec[1][:1] for _, rec, _ in trace]
    last_change = next((trace[i][0] for i in range(len(tops) - 1, 0, -1) if tops[i] != tops[i - 1]), trace[0][0])
    lines += ["", f"The top position last changed at batch {last_change} of {trace[-1][0]}: a stop that waits for a stable "
              "recommendation saves nothing where the ranking is still moving, and an earlier stop would have picked another position."]
    lines += ["", "The recommendation after each batch (what the stop watches; from 3 batches, the first with a standard error):", ""]
    lines += [f"- {b}: {'grow at' if rec[0] else 'do not grow;'} {list(rec[1])}" for b, rec, _ in trace]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model, rows, batch_size, max_batches, what = load(args.quick)
    result, trace, seconds = traced_probe(model, rows, batch_size, max_batches)
    full = (result.recommendation["grow"], tuple(result.recommendation["positions"]))
    if trace[-1][1] != full:
        raise RuntimeError(f"the traced recommendation {trace[-1][1]} differs from the probe's {full}")
    table = rows_for(trace, args.patience, full)
    publish(args, SECTION, render(table, trace, full, seconds, what, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
