"""A small comparison on the serial engine against Ray Tune with concurrent single-thread trials.

    python benchmarks/bench_ray_compare.py --write-results          # a small random Llama, 3 repeats
    python benchmarks/bench_ray_compare.py --quick --repeats 1       # smoke run

Serial: `compare_plans(engine="serial")` in this process with `--serial-threads` torch threads (default:
every core, what a user gets). Ray: `compare_plans(engine="ray", max_concurrent_trials=N, resources_per_trial=1)`
with Ray not yet running, so each repeat pays what `hf-depthgrow compare --engine ray` pays: starting a local
instance, shipping the inputs, a process per concurrent trial (imports included), and shutting it down. The
trials are the same work either way: every arm's per-example test losses of the Ray run are checked equal to a
serial run at one thread (once, before timing). Reported: wall time of each per repeat (alternating within a
repeat), medians, the ratio Ray / serial, and Ray's fixed cost per trial: ((Ray's wall - the set-up) x N - the
trials' own seconds) / trials, i.e. what a trial costs on Ray beyond its compute (start, imports, shipping, Tune's
bookkeeping). The set-up (the original's losses, the arms) is what both engines do on the driver before any trial:
the serial wall minus its trials' seconds. The table also gives the cost with the set-up left in, as a user sees it.

`--write-results` replaces the section "## Serial against Ray Tune, ..., serial at N threads" of `--results`
(default benchmarks/RESULTS.md). On a loaded machine two serial threads can lose much to contention (OpenMP
threads spinning against other processes), so `--serial-threads 1` separates that from what Ray itself brings.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import command_line, machine, publish  # noqa: E402

from hf_depthgrow.comparison import compare_plans  # noqa: E402
from hf_depthgrow.testing import tiny_inputs, tiny_model  # noqa: E402

SECTION = "## Serial against Ray Tune, concurrent single-thread trials"


def section_heading(args) -> str:
    return f"{SECTION}, serial at {args.serial_threads} thread{'s' if args.serial_threads > 1 else ''}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of every trial")
    p.add_argument("--examples", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--concurrent", type=int, default=2, help="Ray trials at once (one CPU and one torch thread each)")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3], help="every arm's grid: 2 arms x this many trials")
    p.add_argument("--serial-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="smoke sizes: 8 steps, 32 examples")
    p.add_argument("--split-steps", type=int, default=8,
                   help="steps of the short trials that split Ray's cost into its one-time and per-trial parts (0: skip)")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.examples = 8, 32
    if args.repeats < 1 or args.steps < 2 or args.examples < 16 or args.concurrent < 1 or args.serial_threads < 1:
        p.error("--repeats >= 1, --steps >= 2, --examples >= 16, --concurrent >= 1 and --serial-threads >= 1 are needed")
    # Checked here, before any timing: a grid with a repeated rate is refused by compare_plans.
    if args.split_steps < 0 or len({f"{lr:.12g}" for lr in _doubled(args.learning_rates)}) < 2 * len(args.learning_rates):
        p.error("--split-steps must be >= 0, and --learning-rates distinct with none 1.1 times another")
    return args


def _data(model, n: int):
    def rows(k, seed):
        batch = tiny_inputs(model, batch=k, seq=32, seed=seed)
        batch["labels"] = batch["input_ids"].clone()
        return [{key: v[i] for key, v in batch.items()} for i in range(k)]

    return rows(n, 0), rows(n // 4, 1), rows(n // 2, 2)


def _settings(args) -> dict:
    # 2 arms x the rates, one round (no extension): the engine is what differs (a timing: a repeated block costs what a
    # new one does, so the default 60 steps of 8 on 128 blocks may repeat them).
    return {"growth": ["top:1"], "controls": ["layers"], "learning_rates": args.learning_rates, "lr_extensions": 0, "max_steps": args.steps,
            "batch_size": args.batch_size, "warmup_steps": 1, "progress": False, "n_bootstrap": 200, "allow_repeated_data": True}


def run(model, data, args, engine: str):
    train, held, test = data
    extra = {"engine": "ray", "max_concurrent_trials": args.concurrent, "resources_per_trial": 1} if engine == "ray" else {}
    return compare_plans(model, train, held, test, **_settings(args), **extra)


def _losses(result) -> dict:
    return {a.name: a.test_per_example for a in result.arms}


def _threads(n: int):
    torch.set_num_threads(n)


def measure(args) -> dict:
    """Time both engines `--repeats` times, alternating; every Ray run is checked equal to serial at one thread."""
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512).eval()
    data = _data(model, args.examples)
    # Untimed: a process's first training pays the imports the library defers (transformers' schedulers pull in
    # peft); the serial timings and the compute the split subtracts must not carry them, a fresh Ray process must.
    # Likewise the first Ray run of a process: the driver's imports of Ray and Tune, and the first read of Ray's
    # binaries from disk, would land in whichever timed run came first (the split's short one, skewing its slope).
    one_step = argparse.Namespace(**{**vars(args), "steps": 1})
    run(model, data, one_step, "serial")
    _threads(1)
    run(model, data, one_step, "ray")
    split = _split(model, data, args) if args.split_steps else []  # first: the short runs, before the long ones
    want = None
    if args.serial_threads != 1:  # else the timed serial runs are the one-thread reference
        _threads(1)
        want = _losses(run(model, data, args, "serial"))
    times, seconds, ray_runs = {"serial": [], "ray": []}, {"serial": [], "ray": []}, []
    for r in range(args.repeats):
        order = ("serial", "ray") if r % 2 == 0 else ("ray", "serial")
        for engine in order:
            _threads(args.serial_threads if engine == "serial" else 1)
            started = time.perf_counter()
            result = run(model, data, args, engine)
            times[engine].append(time.perf_counter() - started)
            seconds[engine].append(sum(a.train_seconds for a in result.arms))
            if engine == "ray":
                ray_runs.append(_losses(result))
            elif want is None:
                want = _losses(result)
            print(f"repeat {r + 1}/{args.repeats}: {engine} {times[engine][-1]:.1f} s", file=sys.stderr)
    for got in ray_runs:
        if any(not np.array_equal(losses, want[arm]) for arm, losses in got.items()):
            raise SystemExit("a Ray run differs from the serial run at one thread: not the same work")
    return {"split": split, "times": times, "trial_seconds": seconds["ray"], "serial_trial_seconds": seconds["serial"], "sizes": [len(d) for d in data],
            "driver_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _doubled(rates: list[float]) -> list[float]:
    """The rates and as many more (each 1.1 times one of them): twice the trials."""
    return [*rates, *(1.1 * lr for lr in rates)]


def _split(model, data, args) -> list[tuple[float, float, float, float]]:
    """Per repeat, `(one-time seconds, seconds per trial, fixed cost per trial of the n-trial run, of the 2n-trial run)`
    of Ray beyond the trials' compute, from runs of short trials (`--split-steps`), n and 2n of them: the one-time part
    (starting Ray, the trial processes and their imports) is paid once, the per-trial part (Tune's bookkeeping, a
    reused process taking one more trial) n more times. The compute is the serial engine's trial seconds of the same
    trials at one thread, so a fresh process's first-call costs and two trials sharing the memory bus count as Ray's."""
    short = argparse.Namespace(**{**vars(args), "steps": args.split_steps})
    doubled = argparse.Namespace(**{**vars(short), "learning_rates": _doubled(args.learning_rates)})
    _threads(1)
    compute = [sum(a.train_seconds for a in run(model, data, s, "serial").arms) for s in (short, doubled)]
    n, out = 2 * len(args.learning_rates), []
    for r in range(args.repeats):
        cost = []  # CPU-slot seconds beyond the compute, n then 2n trials: every slot waits through the wall
        for setting, seconds in zip((short, doubled), compute):
            started = time.perf_counter()
            run(model, data, setting, "ray")
            cost.append((time.perf_counter() - started) * args.concurrent - seconds)
        per_trial = (cost[1] - cost[0]) / n
        out.append((cost[0] - n * per_trial, per_trial, cost[0] / n, cost[1] / (2 * n)))
        print(f"repeat {r + 1}/{args.repeats}: one-time {out[-1][0]:.1f} s, per trial {per_trial:.2f} s", file=sys.stderr)
    return out


def _split_text(split: list, args) -> list[str]:
    if not split:
        return []
    n = 2 * len(args.learning_rates)
    rows = [f"| repeat {i + 1} | {a:.1f} | {b:.2f} | {c:.2f} | {d:.2f} |" for i, (a, b, c, d) in enumerate(split)]
    once, each, at_n, at_2n = (statistics.median(row[k] for row in split) for k in range(4))
    reach = f"from {math.ceil(once / (2 - each))} trials a run on" if each < 2 else "at no number of trials"
    return [
        f"Ray's cost split into a one-time and a per-trial part, from Ray runs of {n} and {2 * n} short trials "
        f"({args.split_steps} steps each), in CPU-slot seconds ({args.concurrent} slots: Ray's wall x {args.concurrent} - the same trials' seconds on the serial engine at one thread):", "",
        f"| | one-time (s) | per trial (s) | fixed cost per trial, {n} trials (s) | fixed cost per trial, {2 * n} trials (s) |",
        "|---|---:|---:|---:|---:|", *rows,
        f"| **median** | **{once:.1f}** | **{each:.2f}** | {at_n:.2f} | **{at_2n:.2f}** |", "",
        "The one-time part is starting Ray and the trial processes (imports included), paid once per run however many "
        "trials it holds; the per-trial part is what reusing a process for one more trial costs. Every timed run comes after "
        "an untimed one-step Ray run, which pays the driver's imports of Ray and Tune once per process. The last two columns are "
        f"each run's own cost over its trials: from the medians, Ray's fixed cost per trial is 2 s or less {reach} "
        "(one-time / (2 - per trial)).", "",
    ]


def section_text(m: dict, args, command: str, load: tuple) -> str:
    med = {k: statistics.median(v) for k, v in m["times"].items()}
    trials = 2 * len(args.learning_rates)
    setup = [w - s for w, s in zip(m["times"]["serial"], m["serial_trial_seconds"])]
    gross = [(w * args.concurrent - s) / trials for w, s in zip(m["times"]["ray"], m["trial_seconds"])]
    fixed = [((w - u) * args.concurrent - s) / trials for w, s, u in zip(m["times"]["ray"], m["trial_seconds"], setup)]
    rates = " and ".join(f"{lr:g}" for lr in args.learning_rates)
    n_train, n_held, n_test = m["sizes"]
    return "\n".join([
        section_heading(args), "",
        f"Command: `{command}`", "",
        f"A random Llama (8 layers, d = 64, vocabulary 512), sequences of 32 random tokens; arms top:1 and layers at rates "
        f"{rates} ({trials} trials), {args.steps} steps of {args.batch_size} examples; {n_train} training, {n_held} held-out, "
        f"{n_test} test examples. Serial: one process, {args.serial_threads} torch thread{'s' if args.serial_threads > 1 else ''}. Ray {_ray_version()}: a fresh local "
        f"instance per run, {args.concurrent} trials at once, 1 CPU and 1 thread each. {machine()}, torch {torch.__version__}; "
        f"load average {load[0]:.2f} before, {load[1]:.2f} after (a shared machine); {date.today().isoformat()}. Ray's "
        "per-example test losses equal the serial run's at one thread (checked, every Ray run).", "",
        "| | serial (s) | Ray (s) | Ray / serial | trials' own compute, serial (s) | on Ray (s) | set-up (s) "
        "| Ray's fixed cost per trial, set-up included (s) | Ray's fixed cost per trial (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| repeat {i + 1} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {t:.1f} | {s:.1f} | {u:.1f} | {g:.1f} | {f:.1f} |"
          for i, (a, b, t, s, u, g, f) in enumerate(zip(m["times"]["serial"], m["times"]["ray"], m["serial_trial_seconds"],
                                                         m["trial_seconds"], setup, gross, fixed))],
        f"| **median** | **{med['serial']:.1f}** | **{med['ray']:.1f}** | **{statistics.median(r / s for s, r in zip(m['times']['serial'], m['times']['ray'])):.2f}x** "
        f"| {statistics.median(m['serial_trial_seconds']):.1f} | {statistics.median(m['trial_seconds']):.1f} | {statistics.median(setup):.1f} "
        f"| {statistics.median(gross):.1f} | **{statistics.median(fixed):.1f}** |", "",
        f"The set-up is the serial wall minus its trials' seconds: the original's losses and the arms, which both engines "
        f"compute on the driver before any trial. Ray's fixed cost per trial is ((Ray's wall - the set-up) x {args.concurrent} "
        f"- the trials' own seconds on Ray) / {trials}: starting Ray, a process per concurrent trial importing torch and "
        f"transformers (reused for the next trial), shipping the inputs, Tune's bookkeeping. The column before it leaves "
        f"the set-up in. Peak memory of the driver process: {m['driver_peak_mib']:.0f} MiB (the trial processes are not "
        "included).", "", *_split_text(m["split"], args),
    ])


def _ray_version() -> str:
    import ray

    return ray.__version__


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    m = measure(args)
    command = command_line("bench_ray_compare.py", argv)
    publish(args, section_heading(args), section_text(m, args, command, (load_before, os.getloadavg()[0])))
    return m


if __name__ == "__main__":
    main()
