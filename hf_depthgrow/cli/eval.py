"""`hf-depthgrow eval`: paired test-risk delta of a grown model (or of two models), written as a report.

    hf-depthgrow eval out/grown --data shakespeare --block-size 256 --max-examples 400 \
        --splits train=0.8,held_out=0.1,test=0.1 --eval-split test --loss-bound 20 --out out/eval

With `--base PATH` the model is compared with a separate base model (both run fully); without it
the model must carry a growth record, and the original is the same model with its new blocks
bypassed (shared prefix). Writes report.json, report.md and PNG plots into `--out`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..evaluation.bounds import RouteInputs


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `eval` arguments (on `parser` where the main CLI passes its sub-parser)."""
    p = parser or argparse.ArgumentParser(prog="hf-depthgrow eval", description=__doc__.splitlines()[0])
    p.add_argument("model", help="folder of the grown model (saved by hf_depthgrow) or, with --base, the candidate model")
    p.add_argument("--base", default=None, help="a separate reference model (folder, or 'smollm2'): both run fully, no shared prefix")
    p.add_argument("--data", required=True, help="shakespeare, tweets, fashion_mnist, digits, a local file/folder or a Hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's folder)")
    p.add_argument("--block-size", type=int, default=256, help="tokens per LM block / padded text length")
    p.add_argument("--max-examples", type=int, default=None, help="load at most this many examples")
    p.add_argument("--split", default="train", help="split of a Hub dataset to load")
    p.add_argument("--splits", default=None, help="split the loaded data, e.g. train=0.8,held_out=0.1,test=0.1 (as the trainer did)")
    p.add_argument("--eval-split", default="test", help="which of --splits to evaluate on")
    p.add_argument("--split-seed", type=int, default=0, help="seed of --splits (use the trainer's)")
    p.add_argument("--delta", type=float, default=0.05, help="allowed failure probability of each interval")
    p.add_argument("--loss-bound", type=float, default=None, help="a-priori bound B of a per-example loss (default: from the data, with a warning)")
    p.add_argument("--n-bootstrap", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--routes", default=None, help="JSON file with Route A/B inputs (n_train, delta_erm, delta_r, delta_r_test, rho, b_w, b_a)")
    p.add_argument("--n-train", type=int, default=None, help="training-set size n (Route A/B)")
    p.add_argument("--delta-erm", type=float, default=None, help="Delta_ERM from the trainer (Route A/B)")
    p.add_argument("--block-terms", default=None, metavar="SPLIT", help="estimate rho, B_a, B_W of the new blocks on this split of --splits (usually train)")
    p.add_argument("--no-evaluate", action="store_true", help="do not try the Hugging Face `evaluate` metrics")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="output folder for report.json, report.md and plots")
    return p


def _fractions(text: str) -> dict[str, float]:
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError as err:
        raise ValueError(f"--splits must look like train=0.8,test=0.2, got {text!r}") from err


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from ..data.sources import infer_task, load_data, split_dataset
    from ..evaluation.paired import compare_models, evaluate_delta, route_inputs
    from ..growth.engine import growth_record
    from ..evaluation.report import write_report
    from ..hub.serialization import load_pretrained

    from .common import load_tokenizer_if_any

    dtype = getattr(torch, args.dtype)

    def load(name: str):
        if name == "smollm2":  # the embedded SmolLM2-135M-Instruct, as in the other commands
            from ..data.embedded import load_smollm2

            return load_smollm2(dtype=dtype)
        return load_pretrained(name, dtype=dtype).eval(), load_tokenizer_if_any(name)

    model, tokenizer = load(args.model)
    base, base_tokenizer = load(args.base) if args.base else (None, None)
    if base is None and not growth_record(model):
        raise ValueError(f"{args.model} has no growth record: pass --base to compare it with a separate model")
    if args.tokenizer:
        tokenizer = load_tokenizer_if_any(args.tokenizer)
    tokenizer = tokenizer or base_tokenizer
    if tokenizer is None and infer_task(model) != "image_classification":
        raise ValueError(f"no tokenizer beside {args.model}{' or ' + args.base if args.base else ''}: pass --tokenizer")
    data = load_data(args.data, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.max_examples, split=args.split, seed=args.split_seed)
    splits = {"all": data}
    if args.splits:
        splits = split_dataset(data, _fractions(args.splits), seed=args.split_seed)
        if args.eval_split not in splits:
            raise ValueError(f"--eval-split {args.eval_split!r} is not one of --splits {sorted(splits)}")
    test = splits.get(args.eval_split, data) if args.splits else data

    routes = None
    if args.routes or args.n_train is not None or args.delta_erm is not None or args.block_terms:
        given = json.loads(Path(args.routes).read_text()) if args.routes else {}
        if args.block_terms and args.block_terms not in splits:
            raise ValueError(f"--block-terms {args.block_terms!r} is not one of the splits {sorted(splits)}")
        measured = route_inputs(
            model if args.block_terms else None,
            n_train=args.n_train if args.n_train is not None else given.get("n_train"),
            delta_erm=args.delta_erm if args.delta_erm is not None else given.get("delta_erm"),
            block_data=splits.get(args.block_terms) if args.block_terms else None,
            batch_size=args.batch_size, progress=not args.no_progress,
        )
        values = {k: getattr(measured, k) for k in ("n_train", "delta_erm", "rho", "b_w", "b_a")}
        sources = dict(given.get("sources", {}))
        for key in ("n_train", "delta_erm", "delta_r", "delta_r_test", "rho", "b_w", "b_a"):
            if values.get(key) is None and given.get(key) is not None:
                values[key] = given[key]
                sources.setdefault(key, f"from {args.routes}")
        sources.update(measured.sources)
        routes = RouteInputs(**values, sources=sources)

    kwargs = dict(delta=args.delta, loss_bound=args.loss_bound, n_bootstrap=args.n_bootstrap, seed=args.seed,
                  batch_size=args.batch_size, use_evaluate=not args.no_evaluate, routes=routes, progress=not args.no_progress)
    result = compare_models(base, model, test, **kwargs) if base is not None else evaluate_delta(model, test, **kwargs)
    result.models["old"]["name_or_path"] = args.base or f"{args.model} (new blocks bypassed)"
    result.models["new"]["name_or_path"] = args.model
    paths = write_report(result, args.out, command="hf-depthgrow eval " + shlex.join(argv),
                         extra={"data": args.data, "eval split": args.eval_split if args.splits else "all", "examples": result.num_examples})
    print(result.verdict)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow eval`; returns the exit code (1 for a clear input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"hf-depthgrow eval: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
