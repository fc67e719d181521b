"""Cost growth: probe, training step and paired evaluation against sequence length, positions and test-set size.

    python benchmarks/bench_cost_growth.py --write-results                 # SmolLM2-135M, all three sweeps
    python benchmarks/bench_cost_growth.py --model tiny --quick --repeats 1  # CPU smoke run (what CI runs)

Three sweeps, each point timed as the median of `--repeats` runs:

(a) sequence length (`--seqs`) at a fixed batch (`--batch` sequences of random token ids):
    - probe: `probe(model, [batch])` over all L+1 positions (time per batch);
    - train step: one `GrownTrainer.training_step` (what `train` runs per step) of a copy grown at
      k = L // 2 (native block, copy init), only the new block trains, `prefix_cache="off"`: every
      step is a forward from the bottom and a backward down to the new block;
    - evaluation: `evaluate_delta` of that grown model on one batch;
(b) number of probed positions (`--positions`, counts spread evenly over 0..L; `all` = L+1) at `--probe-seq`;
(c) test-set size (`--test-sizes` examples of `--eval-seq` tokens, batched by `--batch`) for `evaluate_delta`.

Every repeat runs every point of every sweep once, in a fresh random order, so that drift of the
machine's load hits all points alike (as `bench_probe.py` does). Untimed first: one run of each point (one-time
work such as the chunked loss's self-check), one under torch's `FlopCounterMode` (the FLOP prediction) and
`--warmup` more rounds.

Prediction: the FLOPs torch counts for one run of the point (multiply-add = 2): matmuls and the
attention kernels. torch has no formula for the CPU flash-attention kernel, so this script maps it
(forward and backward) to torch's own SDPA formulas; attention is counted dense (the causal kernel
skips masked blocks, so the count overstates attention at long sequences). Not counted: element-wise
work (norms, RoPE, SiLU, softmax, the loss's log-softmax over the vocabulary), AdamW's update, the
probe's covariance eigendecompositions and `evaluate_delta`'s bootstrap (numpy).

The baseline of each row is the smallest point of its sweep scaled by FLOPs: t_0 x F / F_0, i.e. what
the run would take if cost grew exactly as the FLOP count says. 'measured / baseline' > 1 is growth
beyond the count (e.g. memory-bound work growing faster), < 1 is fixed costs amortised.

`--write-results` replaces the section "## Cost growth" of `--results` (default benchmarks/RESULTS.md)
with the table, the machine, the command and the date. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import platform
import random
import statistics
import sys
import time
import warnings
from datetime import date
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from flops import flop_counter  # noqa: E402
from results_file import command_line, publish  # noqa: E402
SECTION = "## Cost growth"
# Defaults per mode; an explicit flag always wins. The quick sizes keep the CI smoke test in seconds.
DEFAULTS = {
    "full": dict(seqs=[128, 256, 512, 1024], positions=["1", "4", "16", "all"], test_sizes=[16, 64, 256],
                 batch=2, probe_seq=256, eval_seq=128, n_bootstrap=2000, warmup=1),
    "quick": dict(seqs=[16, 32, 64], positions=["1", "2", "all"], test_sizes=[4, 8, 16],
                  batch=2, probe_seq=16, eval_seq=16, n_bootstrap=200, warmup=0),
}
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class Point:
    """One timed unit: a point of a sweep for one kind of work, its timings and counted FLOPs.

    A plain class rather than a dataclass: the tests load this file with importlib, outside
    `sys.modules`, where dataclasses cannot resolve postponed annotations."""

    def __init__(self, sweep: str, work: str, x: int, label: str, run: Callable[[], object]):
        self.sweep = sweep  # "a" | "b" | "c"
        self.work = work  # "probe" | "train step" | "evaluation"
        self.x = x  # the sweep variable: tokens per sequence, positions probed, test examples
        self.label = label
        self.run = run
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.flops = 0
        self.attention_flops = 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--quick", action="store_true", help="small sizes for the smoke test")
    p.add_argument("--seqs", type=int, nargs="+", help="sweep (a): tokens per sequence (default 128 256 512 1024)")
    p.add_argument("--positions", nargs="+", help="sweep (b): numbers of positions probed, or 'all' (default 1 4 16 all)")
    p.add_argument("--test-sizes", type=int, nargs="+", help="sweep (c): test examples (default 16 64 256)")
    p.add_argument("--batch", type=int, help="sequences per batch in every sweep (default 2)")
    p.add_argument("--probe-seq", type=int, help="tokens per sequence in sweep (b) (default 256)")
    p.add_argument("--eval-seq", type=int, help="tokens per sequence in sweep (c) (default 128)")
    p.add_argument("--n-bootstrap", type=int, help="evaluate_delta's resamples (default 2000, its own default)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--warmup", type=int, help="untimed rounds after the FLOP count (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="what ratios use: wall clock, or process CPU time (a shared CPU machine, with --threads 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-results", action="store_true", help="replace the 'Cost growth' section of --results")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    for name, value in DEFAULTS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    sizes = [*args.seqs, *args.test_sizes, args.batch, args.probe_seq, args.eval_seq, args.repeats, args.n_bootstrap]
    if min(sizes) < 1 or args.warmup < 0:
        p.error("sizes, --repeats and --n-bootstrap must be at least 1, --warmup at least 0")
    if any(c != "all" and (not c.isdigit() or int(c) < 1) for c in args.positions):
        p.error("--positions takes counts >= 1 or 'all'")
    return args


def load_base(args, device: torch.device):
    """The ungrown model (fp32, eval mode) on `device`."""
    if args.model == "tiny":
        from hf_depthgrow.testing import tiny_model

        # RoPE needs no table, but the config should admit the longest sequence asked for.
        longest = max([*args.seqs, args.probe_seq, args.eval_seq])
        model = tiny_model("llama", max_position_embeddings=max(128, longest))
    else:
        from hf_depthgrow import load_model

        model, _ = load_model("smollm2", dtype=torch.float32)
    return model.float().eval().to(device)


def random_rows(vocab: int, n: int, seq: int, seed: int) -> list[dict]:
    """`n` causal-LM rows of random token ids: cost does not depend on the text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]


def spread(count: int, num_layers: int) -> list[int]:
    """`count` distinct positions evenly over 0..L (the middle one for a single position)."""
    if count == 1:
        return [num_layers // 2]
    return sorted({round(i * num_layers / (count - 1)) for i in range(count)})


def make_trainer(grown, rows: list[dict], batch: int):
    """A set-up `GrownTrainer` (new block only, no prefix cache) driven step by step; returns `step()`."""
    from hf_depthgrow.training import GrownTrainer, TrainConfig

    cfg = TrainConfig(
        trainable="new", prefix_cache="off", max_steps=1_000_000, per_device_train_batch_size=batch,
        learning_rate=1e-4, fallback=False, progress_bar=False, seed=0,
    )
    trainer = GrownTrainer(grown, cfg, rows)
    trainer.setup()
    steps = itertools.count(1)
    return lambda: trainer.training_step(next(steps))


def evaluation(grown, rows: list[dict], args) -> Callable[[], object]:
    """`evaluate_delta` on `rows` as a user calls it (task metrics off: they are not the paired cost)."""
    from hf_depthgrow.evaluation import evaluate_delta

    def run():
        with warnings.catch_warnings():  # the data-derived loss bound: cost is measured here, not intervals
            warnings.filterwarnings("ignore", message="loss_bound not given")
            return evaluate_delta(grown, rows, batch_size=args.batch, n_bootstrap=args.n_bootstrap, metrics=False, use_evaluate=False)

    return run


def build_points(args, base, grown) -> list[Point]:
    """Every point of the three sweeps; models are shared, data is built here (not timed)."""
    from hf_depthgrow import probe

    vocab, num_layers = base.config.vocab_size, base.config.num_hidden_layers
    points = []
    for seq in sorted(set(args.seqs)):  # (a) sequence length at a fixed batch
        rows = random_rows(vocab, args.batch, seq, args.seed + seq)
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        label = f"T={seq}"
        points.append(Point("a", "probe", seq, label, lambda b=batch: probe(base, [b], progress=False)))
        # One grown model serves every trainer: a step's cost does not depend on the block's weights,
        # and a copy per point would hold another full model per sequence length.
        points.append(Point("a", "train step", seq, label, make_trainer(grown, rows, args.batch)))
        points.append(Point("a", "evaluation", seq, label, evaluation(grown, rows, args)))
    rows = random_rows(vocab, args.batch, args.probe_seq, args.seed + 1)
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    counts = sorted({num_layers + 1 if c == "all" else int(c) for c in args.positions})
    if counts[-1] > num_layers + 1:
        raise SystemExit(f"--positions: the model has {num_layers + 1} positions, {counts[-1]} asked for")
    for count in counts:  # (b) positions probed
        where = spread(count, num_layers)
        label = f"{count} position{'s' if count > 1 else ''}" + (" (all)" if count == num_layers + 1 else "")
        points.append(Point("b", "probe", count, label, lambda w=where: probe(base, [batch], positions=w, progress=False)))
    test = random_rows(vocab, max(args.test_sizes), args.eval_seq, args.seed + 2)
    for n in sorted(set(args.test_sizes)):  # (c) test-set size
        points.append(Point("c", "evaluation", n, f"n={n}", evaluation(grown, test[:n], args)))
    return points


class _GlobalOnly:
    """Stands in for `FlopCounterMode`'s module tracker, which attributes counts to modules through
    autograd hooks on their inputs; `torch.autograd.grad` (the probe's backward) refuses those hooks
    ("A leaf node was passed to _will_engine_execute_node"). Only the total is needed here."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def count_flops(point: Point) -> None:
    """One untimed run under `FlopCounterMode`, with the attention kernels given torch's SDPA formulas (`flops.py`)."""
    counter = flop_counter()
    counter.mod_tracker = _GlobalOnly()
    with counter:
        point.run()
    by_op = counter.get_flop_counts()["Global"]
    point.flops = int(sum(by_op.values()))
    point.attention_flops = int(sum(v for op, v in by_op.items() if any(a in str(op) for a in ATTENTION_OPS)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(point: Point, device: torch.device) -> tuple[float, float]:
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    point.run()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(points: list[Point], args, device: torch.device) -> None:
    """One untimed run, the FLOP count, warm-up rounds, then `--repeats` rounds over every point in a fresh order each.

    The count follows a first run so that it holds a call's steady work only: a model's first chunked-loss batch also
    runs the chunked path's self-check (one more forward of the body, `hf_depthgrow.chunked_loss`), once per model,
    which the first count of the first chunked point took as its own (T=256 counted 2.6-3.1x T=128's FLOPs).
    """
    for i, point in enumerate(points):
        point.run()
        count_flops(point)
        print(f"[count {i + 1}/{len(points)}] ({point.sweep}) {point.work} {point.label}: {point.flops / 1e9:.3f} GFLOP",
              file=sys.stderr, flush=True)
    for w in range(args.warmup):
        for point in points:
            timed(point, device)
        print(f"[warm-up {w + 1}/{args.warmup}] done", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    for r in range(args.repeats):
        order = points[:]
        rng.shuffle(order)
        for point in order:
            wall, cpu = timed(point, device)
            point.wall.append(wall)
            point.cpu.append(cpu)
            print(f"[repeat {r + 1}/{args.repeats}] ({point.sweep}) {point.work} {point.label}: {wall:.3f} s wall, {cpu:.3f} s CPU",
                  file=sys.stderr, flush=True)


SWEEPS = {"a": "(a) sequence length", "b": "(b) positions probed", "c": "(c) test-set size"}
WORKS = ("probe", "train step", "evaluation")
HEADER = (
    "| sweep | work | point | median s | CPU s | counted GFLOP | attention share | achieved GFLOP/s "
    "| time ratio to smallest | FLOP ratio to smallest | baseline s = smallest point's time x FLOP ratio | measured / baseline |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def rows_markdown(points: list[Point], clock: str) -> list[str]:
    """One row per point; ratios against the smallest point of the same sweep and work."""
    lines = []
    # Sweep (a) is built point by point (all works at one length); the table groups each work's points.
    ordered = sorted(points, key=lambda p: (p.sweep, WORKS.index(p.work), p.x))
    for (sweep, work), group in itertools.groupby(ordered, key=lambda p: (p.sweep, p.work)):
        group = list(group)
        t0 = statistics.median(getattr(group[0], clock))
        f0 = group[0].flops
        for p in group:
            t, cpu = statistics.median(getattr(p, clock)), statistics.median(p.cpu)
            time_ratio, flop_ratio = t / t0, p.flops / f0
            baseline = t0 * flop_ratio
            lines.append(
                f"| {SWEEPS[sweep]} | {work} | {p.label} | {t:.4g} | {cpu:.4g} | {p.flops / 1e9:,.3f} | "
                f"{100 * p.attention_flops / p.flops:.1f}% | {p.flops / t / 1e9:,.2f} | {time_ratio:.2f}x | {flop_ratio:.2f}x | "
                f"{baseline:.4g} | **{t / baseline:.3f}** |"
            )
    return lines


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        where = f"CPU {platform.processor() or platform.machine()}"
    return (f"{where}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s), "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def section_text(points: list[Point], args, base, device, command: str, load: tuple[float, float]) -> str:
    """The whole 'Cost growth' section: how it was run, the table, and every timed run."""
    cfg = base.config
    model = "SmolLM2-135M-Instruct" if args.model == "smollm2" else "tiny Llama (`hf_depthgrow.testing.tiny_model`)"
    clock = "wall clock" if args.clock == "wall" else "process CPU time (`time.process_time`)"
    raw = [f"- ({p.sweep}) {p.work}, {p.label}: {[round(t, 4) for t in p.wall]} s wall, {[round(t, 4) for t in p.cpu]} s CPU" for p in points]
    return "\n".join([
        SECTION,
        "",
        f"Command ({date.today().isoformat()}): `{command}`",
        "",
        f"{model} (fp32, {cfg.num_hidden_layers} layers, d = {cfg.hidden_size}, vocabulary {cfg.vocab_size}), random token ids, "
        f"batch {args.batch}; {machine(device)}; load average {load[0]:.2f} before, {load[1]:.2f} after. (a) sequence length at batch "
        f"{args.batch}: the probe over all {cfg.num_hidden_layers + 1} positions, one training step of a copy grown at "
        f"k = {cfg.num_hidden_layers // 2} (new block only, prefix cache off: a forward from the bottom), `evaluate_delta` on one batch; "
        f"(b) positions probed (spread evenly over 0..L) at {args.probe_seq} tokens; (c) `evaluate_delta` on n test examples of "
        f"{args.eval_seq} tokens ({args.n_bootstrap} bootstrap resamples, task metrics off). Median of {args.repeats} runs per point "
        f"({clock}), every repeat running all points in a fresh random order, after one untimed run, a FLOP-counting run and {args.warmup} warm-up round(s).",
        "",
        "Prediction: FLOPs torch's `FlopCounterMode` counts on one run of each point (matmuls and attention, attention dense; the CPU "
        "flash-attention kernel given torch's SDPA formulas). Not counted: element-wise work (norms, RoPE, SiLU, softmax, the loss), "
        "AdamW's update, the probe's eigendecompositions, the bootstrap. The baseline of each row is the smallest point of its sweep "
        "scaled by FLOPs (its time x FLOP ratio): measured / baseline above 1 is growth beyond the FLOP count, below 1 fixed costs amortised.",
        "",
        HEADER,
        *rows_markdown(points, args.clock),
        "",
        "Every timed run:",
        "",
        *raw,
        "",
    ])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_depthgrow import grow_depth

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and args.clock == "cpu":
        raise SystemExit("--clock cpu measures the host, not the GPU: use --clock wall on CUDA")
    base = load_base(args, device)
    grown = grow_depth(copy.deepcopy(base), [base.config.num_hidden_layers // 2], block="native", init="copy")
    points = build_points(args, base, grown)
    load_before = os.getloadavg()[0]
    measure(points, args, device)
    load_after = os.getloadavg()[0]
    command = command_line("bench_cost_growth.py", argv)
    publish(args, SECTION, section_text(points, args, base, device, command, (load_before, load_after)))
    return [
        {"sweep": p.sweep, "work": p.work, "x": p.x, "label": p.label, "wall": p.wall, "cpu": p.cpu,
         "flops": p.flops, "attention_flops": p.attention_flops}
        for p in points
    ]


if __name__ == "__main__":
    main()
