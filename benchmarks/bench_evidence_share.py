"""The evidence's share of the default run on a first run (nothing cached), and the share no evidence of this quality can go below.

    python benchmarks/bench_evidence_share.py --write-results            # SmolLM2-135M + Shakespeare, the default run
    python benchmarks/bench_evidence_share.py --model PATH --data PATH --set block_size=32 --repeats 1   # a smoke run

The bar: probe + stepping stones + evaluation cost at most 35% of the training they judge. Each repeat
runs the default `hf-depthgrow run` (`run_pipeline(RunConfig())`, the evidence cache off, so every repeat is a
first run; the equal-budget control and the retention set off: they follow the evidence and do not change it) and
then, in the same process, times the cheapest evaluation that keeps the test set: `evaluate_delta` of the trained
grown model on the same test split with nothing else (no route terms, no stepping stone), the paired pass of the
original and the grown model and its intervals. The floor is probe + that evaluation over the train phase: the
probe cannot stop earlier at equal quality (`bench_probe_stop.py`: its ranking still moves at the last batch) and
item 2 forbids a smaller test set. Medians of `--repeats`, each repeat's value beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md helpers next to this script
from results_file import command_line, machine, publish  # noqa: E402

SECTION = "## Evidence's share of a first default run, and its floor"
PHASES = ("probe", "stepping_stones", "evaluate", "train")
TARGET = 0.35


def config(args, out: Path):
    from hf_depthgrow import RunConfig

    settings = dict(output_dir=str(out), progress=False, evidence_cache="none", control=None, retention_data=None)
    if args.model:
        settings["model"] = args.model
    if args.data:
        settings["data"] = args.data
    settings.update(args.set)
    return RunConfig(**settings)


def minimal_evaluation(cfg, model) -> tuple[float, object]:
    """Seconds of `evaluate_delta` alone on the run's test split (rebuilt with the run's seed), and its `EvalResult`."""
    from hf_depthgrow import evaluate_delta, load_model
    from hf_depthgrow.data import load_data, split_parts

    _, tokenizer = load_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    data = load_data(cfg.data, model=model, tokenizer=tokenizer, block_size=cfg.block_size, max_examples=cfg.max_examples,
                     seed=cfg.resolved_split_seed)
    test = split_parts(data, cfg.train_fraction, cfg.held_out_fraction, cfg.test_fraction,  # the run's own split
                       seed=cfg.resolved_split_seed, by=cfg.split_by)["test"]
    start = time.perf_counter()
    result = evaluate_delta(model, test, delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size)
    return time.perf_counter() - start, result


def one_run(args, out: Path) -> dict:
    from hf_depthgrow import run_pipeline

    cfg = config(args, out)
    start = time.perf_counter()
    result = run_pipeline(cfg)
    wall = time.perf_counter() - start
    summary = result.summary
    if summary.get("decision") != "grew":
        raise RuntimeError(f"the run did not grow ({summary.get('reason')}): nothing to judge")
    seconds, minimal = minimal_evaluation(cfg, result.model)
    full = summary["test"]
    # The same statistical quality: the same delta and, for every interval both report, the same bounds.
    shared = {k: list(v) for k, v in minimal.intervals.items() if k in full["intervals"]}
    if minimal.delta != full["delta"] or not shared or any(v != full["intervals"][k] for k, v in shared.items()):
        raise RuntimeError(f"the minimal evaluation measured another test set or model: {minimal.delta, shared} vs {full}")
    return {
        **{p: float(summary["timings_s"][p]) for p in PHASES}, "minimal_evaluation": seconds, "wall": wall,
        "test_examples": minimal.num_examples, "intervals": shared, "positions": summary.get("positions"),
    }


def measure(args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            runs.append(one_run(args, Path(tmp) / f"run{r}"))
    keys = (*PHASES, "minimal_evaluation", "wall")
    med = {k: statistics.median(run[k] for run in runs) for k in keys}
    evidence = [(run["probe"] + run["stepping_stones"] + run["evaluate"]) / run["train"] for run in runs]
    floor = [(run["probe"] + run["minimal_evaluation"]) / run["train"] for run in runs]
    return {"runs": runs, "median": med, "share": evidence, "floor": floor}


def markdown(result: dict, args, command: str) -> str:
    runs, med = result["runs"], result["median"]
    first = runs[0]

    def row(label, key):
        return f"| {label} | {med[key]:.1f} | {', '.join(f'{run[key]:.1f}' for run in runs)} |"

    widths = ", ".join(f"{k} {hi - lo:.4f}" for k, (lo, hi) in first["intervals"].items())
    # Names, not local paths: RESULTS.md is public.
    model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (fp32)"
    data = Path(args.data).name if args.data else "Shakespeare"
    changed = f"; changed from the default: {', '.join(f'{k}={v}' for k, v in args.set.items())}" if args.set else ""
    share, floor = statistics.median(result["share"]), statistics.median(result["floor"])
    lines = [
        SECTION, "",
        f"Command ({date.today().isoformat()}): `{command}`", "",
        f"{model} on {data}, the default `hf-depthgrow run` with the evidence cache off (every repeat a first run), the "
        f"control arm and the retention set off (they do not change the evidence){changed}. Grown at {first['positions']}; "
        f"{first['test_examples']} test examples; the cheapest evaluation's intervals equal the run's (widths, first "
        f"repeat: {widths}). {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        f"Seconds, median of {len(runs)} repeats, each repeat's value after it.", "",
        "| phase | median s | runs (s) |",
        "|---|---:|---|",
        row("probe", "probe"), row("stepping stones (with `Delta_R` from `afe5b9f` on)", "stepping_stones"),
        row("evaluate (test pass, route terms; `Delta_R` before `afe5b9f`)", "evaluate"),
        row("evaluate, the cheapest at this test size (`evaluate_delta` alone)", "minimal_evaluation"),
        row("train (training, fallback selection, held-out evaluations)", "train"),
        row("whole run (wall)", "wall"), "",
        f"- Evidence over training, as the run is: **{share:.2f}** ({', '.join(f'{v:.2f}' for v in result['share'])}).",
        f"- Floor, probe + the cheapest evaluation over training: **{floor:.2f}** "
        f"({', '.join(f'{v:.2f}' for v in result['floor'])}), against the target {TARGET:.2f}.",
    ]
    budget, floor_s = TARGET * med["train"], med["probe"] + med["minimal_evaluation"]
    lines.append(
        f"- At the target the evidence may cost {budget:.0f} s of this training's {med['train']:.0f} s. The probe and the "
        f"cheapest evaluation alone take {floor_s:.0f} s, which leaves {max(0.0, budget - floor_s):.0f} s for the stepping "
        f"stones, `Delta_R`, the stone's test losses and the route terms "
        f"({med['stepping_stones'] + med['evaluate'] - med['minimal_evaluation']:.0f} s now). For this run's evidence to be {TARGET:.0%} of it, the "
        f"training would have to be {share / TARGET:.1f}x longer."
    )
    return "\n".join(lines) + "\n"


def parse_set(text: str) -> tuple[str, object]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    parsed = yaml.safe_load(value)
    if isinstance(parsed, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return key, parsed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Model of the run (default: the run's, SmolLM2-135M-Instruct).")
    p.add_argument("--data", default=None, help="Data of the run (default: the run's, Shakespeare).")
    p.add_argument("--set", type=parse_set, action="append", default=[], metavar="KEY=VALUE", help="Any other RunConfig setting.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--json", type=Path, default=None, help="Also write the raw figures here.")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.set = dict(args.set)
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    publish(args, SECTION, markdown(result, args, command_line("bench_evidence_share.py", argv)))
    return result


if __name__ == "__main__":
    main()
