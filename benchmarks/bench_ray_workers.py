"""Peak memory per process and wall time of one trial as 1 process against a Ray Train trial of 2 workers.

    python benchmarks/bench_ray_workers.py --write-results           # a small random Llama (~30M parameters)
    python benchmarks/bench_ray_workers.py --quick                    # smoke run

Each setting runs in its own Python process (Ray's serializer reads its settings once, at import): a fresh local
Ray of 2 CPUs, then `run_ray([spec], inputs, workers_per_trial=W)` on one growth trial (`at:2`, its new block
trained). `W = 1` is a plain Tune trial process; `W = 2` a Tune trial that starts a `TorchTrainer` of 2 gloo
workers (DDP), each taking half of every batch. `--zero-copy` adds `W = 2` with `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`
(the workers read the base's tensors from Ray's shared object store instead of unpickling a private copy).
`--fsdp` adds `W = 2` under FSDP2 (`accelerate_config`: `hf_depthgrow.testing.fsdp2_cpu_config`, full precision, as
`tests/test_ray_workers.py` uses): each worker keeps its shard of every parameter and of the trained block's
Adam moments, after reading the whole base from the object store once (growth and sharding start from it).

A thread samples every trial and worker process of that Ray (psutil, every 0.25 s): peak RSS and peak USS (memory
private to the process; the object store's shared pages count in RSS, not in USS). The frozen base's size is
printed beside them, so the copies per process can be read off. The wall time is `run_ray`'s (the local Ray is
started before it, outside the time). Every 2-worker result is checked against the 1-process one (held-out
loss within 1e-4 relative).

`--write-results` replaces the section "## One trial across 2 Ray Train workers: memory per process" of
`--results` (default benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import command_line, machine, publish  # noqa: E402

SECTION = "## One trial across 2 Ray Train workers: memory per process"
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="runs of each setting (a 2-worker trial takes minutes on a loaded 2-core machine)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--zero-copy", action="store_true", help="also 2 workers with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1")
    p.add_argument("--fsdp", action="store_true", help="also 2 workers under FSDP2 (--accelerate-config)")
    p.add_argument("--quick", action="store_true", help="smoke sizes: 2 layers, d = 64, 2 steps")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting here, print JSON
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.steps = 2, 64, 512, 2
    return args


class Sampler(threading.Thread):
    """Peak RSS and USS of this Ray's trial (ImplicitFunc) and worker (RayTrainWorker) processes."""

    def __init__(self, interval: float = 0.25):
        super().__init__(daemon=True)
        self.interval, self.peaks, self.stop = interval, {}, threading.Event()

    def run(self):
        import psutil

        me = psutil.Process()
        while not self.stop.is_set():
            for proc in me.children(recursive=True):  # this benchmark's local Ray only
                try:
                    title = " ".join(proc.cmdline())
                    kind = "worker" if "RayTrainWorker" in title else "trial" if "ImplicitFunc" in title else None
                    if kind is None:
                        continue
                    mem = proc.memory_full_info()
                except Exception:  # noqa: BLE001  (a process that just ended)
                    continue
                rss, uss = self.peaks.get(proc.pid, (kind, 0, 0))[1:]
                self.peaks[proc.pid] = (kind, max(rss, mem.rss), max(uss, mem.uss))
            self.stop.wait(self.interval)


def run_one(args, workers: int, fsdp: bool = False) -> dict:
    """One setting in this process: a fresh local Ray, one trial, the peaks of its processes."""
    import ray
    import torch

    from hf_depthgrow.comparison import TrialInputs, TrialSpec, build_arms, example_losses, ray_engine
    from hf_depthgrow.testing import tiny_inputs, tiny_model

    torch.set_num_threads(1)
    base = tiny_model("llama", hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden), num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab)

    def rows(n, seed):
        batch = tiny_inputs(base, batch=n, seq=32, seed=seed)
        batch["labels"] = batch["input_ids"].clone()
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]

    train, heldout, test = rows(args.examples, 0), rows(8, 1), rows(8, 2)
    inputs = TrialInputs(base=base, train_rows=train, eval_rows=heldout, test_rows=test, retention_rows=None, batch_size=args.batch_size,
                         selection_max_examples=None, lora_target_modules=None, grow_kwargs=None,
                         original={"test": example_losses(base, test, args.batch_size), "heldout": 9.0})
    spec = TrialSpec(build_arms(base, ["at:2"], [])[1], 3e-3, 0, (args.steps,), warmup_steps=1)
    config = None
    if fsdp:
        import tempfile

        from hf_depthgrow.testing import fsdp2_cpu_config

        config = fsdp2_cpu_config(tempfile.mkdtemp(prefix="bench-fsdp-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sampler = Sampler()
    sampler.start()
    started = time.perf_counter()
    try:
        (result,) = ray_engine.run_ray([spec], inputs, workers_per_trial=workers, max_failures=0,
                                       accelerate_config=None if config is None else str(config))
    finally:
        wall = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
        ray.shutdown()
    base_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    return {"wall": wall, "heldout": result.scores[args.steps].heldout_loss, "base_mib": base_bytes / MIB,
            "parameters": sum(p.numel() for p in base.parameters()), "peaks": list(sampler.peaks.values())}


SETTINGS = {"1 process": (1, {}), "2 workers": (2, {}), "2 workers, zero-copy tensors": (2, {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}),
            "2 workers, FSDP2": (2, {})}


def run_setting(argv: list[str], name: str) -> dict:
    workers, env = SETTINGS[name]
    proc = subprocess.run([sys.executable, __file__, *argv, "--one", name], capture_output=True, text=True, env={**os.environ, **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name}: failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def summary(runs: list[dict]) -> dict:
    """Medians over repeats of the wall time and of each process kind's peak (the largest process of a kind per run)."""
    out = {"wall": statistics.median(r["wall"] for r in runs)}
    for kind in ("trial", "worker"):
        for i, what in ((1, "rss"), (2, "uss")):
            values = [max((p[i] for p in r["peaks"] if p[0] == kind), default=0) / MIB for r in runs]
            out[f"{kind}_{what}"] = statistics.median(values)
    out["workers_seen"] = max(sum(p[0] == "worker" for p in r["peaks"]) for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    if args.one:
        print(json.dumps(run_one(args, SETTINGS[args.one][0], fsdp="FSDP2" in args.one)))
        return 0
    names = [n for n in SETTINGS if (args.zero_copy or "zero-copy" not in n) and (args.fsdp or "FSDP2" not in n)]
    load_before = os.getloadavg()[0]
    runs = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:  # alternating within a repeat
            runs[n].append(run_setting([a for a in raw if a != "--write-results"], n))
            print(f"{n}: {runs[n][-1]['wall']:.1f} s", file=sys.stderr)
    load_after = os.getloadavg()[0]
    reference = runs["1 process"][0]["heldout"]
    for n in names:
        for r in runs[n]:
            if abs(r["heldout"] - reference) > 1e-4 * abs(reference):
                raise SystemExit(f"{n}: held-out loss {r['heldout']!r} differs from the 1-process trial's {reference!r}")
    first = runs["1 process"][0]
    import ray
    import torch

    rows = []
    for n in names:
        s = summary(runs[n])
        trial = f"{s['trial_rss']:.0f} / {s['trial_uss']:.0f}"
        worker = f"{s['worker_rss']:.0f} / {s['worker_uss']:.0f}" if s["workers_seen"] else "-"
        rows.append(f"| {n} | {s['wall']:.1f} | {trial} | {worker} |")
    text = "\n".join([
        f"{SECTION}",
        "",
        f"Command: `{command_line('bench_ray_workers.py', argv)}`",
        "",
        f"One growth trial (`at:2`, its new block trained, {args.steps} steps of {args.batch_size} sequences of 32 tokens, "
        f"{args.examples} training examples) on a random Llama ({args.layers} layers, d = {args.hidden}, vocabulary {args.vocab}: "
        f"{first['parameters'] / 1e6:.1f}M parameters, {first['base_mib']:.0f} MiB of fp32 weights). Ray {ray.__version__}, a fresh "
        f"local instance of 2 CPUs per setting; each setting in its own process. {machine()}, torch {torch.__version__}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after: a shared machine, so the times are loose. "
        f"{'Median of ' + str(args.repeats) + ' runs' if args.repeats > 1 else 'One run'} per setting; "
        f"the 2-worker held-out losses equal the 1-process one within 1e-4 relative (checked). {date.today()}.",
        "",
        "| setting | trial wall (s) | trial process: peak RSS / USS (MiB) | each worker: peak RSS / USS (MiB) |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "RSS counts the object store's shared pages a process maps; USS only its private memory. Under 2 workers the "
        "trial process only starts the TorchTrainer (it is handed a reference, not the model).",
    ])
    publish(args, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
