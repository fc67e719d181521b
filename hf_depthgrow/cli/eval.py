"""`hf-depthgrow eval`: paired test-risk delta of a grown model (or of two models), written as a report.

    hf-depthgrow eval --model out/grown --data shakespeare --block-size 256 --max-examples 400 \
        --held-out-fraction 0.1 --test-fraction 0.1 --split-seed 0 --eval-split test --loss-bound 20 --output-dir out/eval

The data is split as `hf-depthgrow train` and `compare` split it: the same `--train-fraction`,
`--held-out-fraction`, `--test-fraction`, `--split-seed` (and `--split-by`) give the same parts, so the test part
evaluated here is the one training never saw. With `--test-fraction 0` (the default) every loaded example is
evaluated.

With `--base PATH` the model is compared with a separate base model (both run fully); without it
the model must carry a growth record, and the original is the same model with its new blocks
bypassed (shared prefix). Writes report.json, report.md and PNG plots into `--output-dir` (empty or
new; `--overwrite` replaces one this tool wrote).

With `--retention-data python_docs` (or any other source) both models are also compared on a
general-domain set outside the training domain, to measure forgetting (positive = the new model
got worse there); the result is printed and written to retention.json beside the report.
"""

from __future__ import annotations

import json
import shlex
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..config import ConfigParser, FlagDeprecation, shared_field
from ..utils import check_int
from .common import dtype_of, run_command


ROUTE_KEYS = ("n_train", "delta_erm", "delta_r", "delta_r_test", "rho", "b_w", "b_a")


def read_routes(path: str | None) -> dict:
    """The `--routes` file, checked: a JSON object of known keys with numbers (`{}` without one)."""
    import difflib
    import math

    if path is None:
        return {}
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such --routes file: {path}")
    try:
        given = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"--routes {path}: not valid JSON ({err})") from None
    if not isinstance(given, dict):
        raise ValueError(f"--routes {path}: expected a JSON object of {', '.join(ROUTE_KEYS)}, got {type(given).__name__}")
    for key, value in given.items():
        if key == "sources":
            if not isinstance(value, dict):
                raise ValueError(f"--routes {path}: sources must be an object")
            continue
        if key not in ROUTE_KEYS:
            near = difflib.get_close_matches(key, ROUTE_KEYS, n=1)
            raise ValueError(f"--routes {path}: unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ValueError(f"--routes {path}: {key} must be a finite number, got {value!r}")
    if given.get("n_train") is not None:
        check_int(f"--routes {path}: n_train", given["n_train"], 1)
    return given


@dataclass
class EvalArguments:
    """Settings of `hf-depthgrow eval`."""

    model: str = shared_field("model", more="The grown model or, with --base, the candidate.", deprecated_positional=True)
    data: str = shared_field("data")
    output_dir: str = shared_field("output_dir", more="report.json, report.md and the plots go here.", deprecated=["--out"])
    overwrite: bool = shared_field("overwrite", False)
    trust_remote_code: bool = shared_field("trust_remote_code", False, more="Applies to --base too.")
    base: str | None = field(default=None, metadata={"help": "A separate reference model (folder, or 'smollm2'): both run fully, no shared prefix."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path (default: the model's folder)."})
    block_size: int = shared_field("block_size", 256)
    max_examples: int | None = shared_field("max_examples", None)
    split: str = field(default="train", metadata={"help": "Split of a Hub dataset to load."})
    # The split of hf-depthgrow train (its defaults too): the same shares and seed give the same parts there, here and
    # in compare.
    train_fraction: float | None = shared_field("train_fraction", None)
    held_out_fraction: float = shared_field("held_out_fraction", 0.1, more="0: none.")
    test_fraction: float = shared_field("test_fraction", 0.0, more="0: none, and every loaded example is evaluated.")
    split_seed: int = shared_field("split_seed", 0, more="Use the trainer's.")
    split_by: str | None = shared_field("split_by", None)
    eval_split: str = field(default="test", metadata={"help": "The part evaluated: train, held_out or test."})
    # The old spelling of the three shares, `train=0.8,held_out=0.1,test=0.1`: hidden, moved to them with a warning.
    splits: str | None = field(default=None, metadata={"help": "Deprecated: use --train-fraction, --held-out-fraction, --test-fraction.",
                                                       "hidden": True})
    delta: float = field(default=0.05, metadata={"help": "Allowed failure probability of each interval."})
    loss_bound: float | None = field(default=None, metadata={"help": "A-priori bound B of a per-example loss (default: from the data, with a warning)."})
    n_bootstrap: int = field(default=2000, metadata={"help": "Bootstrap resamples."})
    seed: int = field(default=0, metadata={"help": "Bootstrap seed."})
    batch_size: int = shared_field("batch_size", 8)
    dtype: str = shared_field("dtype", "float32")
    routes: str | None = field(default=None, metadata={"help": "JSON file (an object) with Route A/B inputs: any of " + ", ".join(ROUTE_KEYS) + ", and sources."})
    n_train: int | None = field(default=None, metadata={"help": "Training-set size n (Route A/B)."})
    delta_erm: float | None = field(default=None, metadata={"help": "Delta_ERM from the trainer (Route A/B)."})
    block_terms: str | None = field(default=None, metadata={"help": "Estimate rho, B_a, B_W of the new blocks on this part (usually train)."})
    retention_data: str | None = field(default=None, metadata={"help": "Also measure forgetting on this general-domain set (e.g. python_docs; any --data source), outside the training domain."})
    retention_max_examples: int = field(default=256, metadata={"help": "Examples (LM blocks of --block-size tokens) of --retention-data to evaluate."})
    lm_eval: bool = field(default=False, metadata={"help": "Also score --retention-data with lm-evaluation-harness (word perplexity, bits per byte; pip install lm-eval)."})
    evaluate: bool = field(default=True, metadata={"help": "Also try the Hugging Face `evaluate` metrics."})
    progress: bool = shared_field("progress", True)

    def __post_init__(self):
        from ..data.sources import SPLIT_PARTS, split_fractions

        if self.splits is not None:
            self._move_splits()
        split_fractions(self.train_fraction, self.held_out_fraction, self.test_fraction)  # checked before anything loads
        if self.eval_split not in SPLIT_PARTS:
            raise ValueError(f"eval_split must be one of {', '.join(SPLIT_PARTS)}, got {self.eval_split!r}")

    def _move_splits(self) -> None:
        """`--splits train=0.8,held_out=0.1,test=0.1`, the old spelling, as the three shares (with a warning)."""
        from ..data.sources import SPLIT_PARTS

        shares = _fractions(self.splits)
        moved = " ".join(f"--{name.replace('_', '-')}-fraction {shares.get(name, 0)}" for name in SPLIT_PARTS)
        if list(shares) != [name for name in SPLIT_PARTS if name in shares]:
            raise ValueError(f"--splits {self.splits}: the parts are {', '.join(SPLIT_PARTS)}, in that order; use {moved}")
        defaults = {f.name: f.default for f in fields(self) if f.name.endswith("_fraction")}
        if any(getattr(self, name) != value for name, value in defaults.items()):
            raise ValueError(f"--splits and --train-fraction, --held-out-fraction, --test-fraction give the split twice: use {moved}")
        warnings.warn(f"--splits is deprecated, use {moved}", FlagDeprecation, stacklevel=3)
        self.train_fraction, self.held_out_fraction, self.test_fraction = (shares.get(name, 0.0) for name in SPLIT_PARTS)
        self.splits = None


def _fractions(text: str) -> dict[str, float]:
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError as err:
        raise ValueError(f"--splits must look like train=0.8,test=0.2, got {text!r}") from err


def check_inputs(args: EvalArguments) -> None:
    """Everything checkable before a model loads: model folders, data, --routes, --output-dir (then locked); the split is
    checked as the arguments are built."""
    from ..hub.loading import check_model_source
    from ..pipeline.checks import check_data_source
    from ..pipeline.output import check_output_dir

    for name in (args.model, args.base):
        if name is not None:
            check_model_source(name)
    check_data_source(args.data)
    read_routes(args.routes)
    check_retention_source(args)
    inputs = {"model": args.model, "base": args.base, "data": args.data, "tokenizer": args.tokenizer,
              "retention data": args.retention_data, "routes": args.routes}
    check_output_dir(args.output_dir, overwrite=args.overwrite, inputs=inputs)


def check_retention_source(args: EvalArguments) -> None:
    """`--retention-data` and `--retention-max-examples`, checked before any model loads (nothing given: nothing to do)."""
    from ..pipeline.checks import check_data_source

    if args.retention_data is None:
        if args.lm_eval:
            raise ValueError("--lm-eval scores the --retention-data set: give --retention-data too")
        return
    if args.lm_eval:
        from ..evaluation.lm_eval_task import check_text_source

        check_text_source(args.retention_data)  # lm_eval installed, and a text source it reads
    if args.retention_max_examples < 1:
        raise ValueError(f"--retention-max-examples must be >= 1, got {args.retention_max_examples}")
    given, data = Path(args.retention_data).expanduser(), Path(args.data).expanduser()
    if args.retention_data == args.data or (given.exists() and data.exists() and given.resolve() == data.resolve()):
        raise ValueError(
            f"--retention-data {args.retention_data!r} is the evaluation data itself: pick a set outside the training domain"
        )
    check_data_source(args.retention_data)
    if args.retention_data == "python_docs":
        from ..data.corpora import python_docs_texts

        python_docs_texts(max_chars=0)  # only looks for the files: a missing package fails now, not after a model load


def load_retention(args: EvalArguments, model, tokenizer):
    """The `--retention-data` rows (`None` without it): its first `--retention-max-examples` examples, via `load_data`."""
    from ..data.sources import load_data

    if args.retention_data is None:
        return None
    return load_data(args.retention_data, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.retention_max_examples, seed=args.split_seed)


def load_models(args: EvalArguments):
    """`(model, base or None, tokenizer)`; without `--base` the model must carry a growth record."""
    from ..data.sources import infer_task
    from ..growth.record import growth_record
    from ..hub.loading import load_model, load_tokenizer

    dtype = dtype_of(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code)
    base, base_tokenizer = load_model(args.base, dtype=dtype, trust_remote_code=args.trust_remote_code) if args.base else (None, None)
    model.eval()
    if base is not None:
        base.eval()
    if base is None and not growth_record(model):
        raise ValueError(f"{args.model} has no growth record: pass --base to compare it with a separate model")
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    tokenizer = tokenizer or base_tokenizer
    if tokenizer is None and infer_task(model) != "image_classification":
        raise ValueError(f"no tokenizer beside {args.model}{' or ' + args.base if args.base else ''}: pass --tokenizer")
    return model, base, tokenizer


def evaluates_all(args: EvalArguments) -> bool:
    """Whether every loaded example is evaluated: `--test-fraction 0` keeps no test part, and the test part is asked for."""
    return args.eval_split == "test" and not args.test_fraction


def load_splits(args: EvalArguments, model, tokenizer) -> tuple[dict, object]:
    """`(parts, evaluated)`: the train / held-out / test parts (`hf_depthgrow.data.split_parts`, as `train` and
    `compare` make them) and the one `--eval-split` names; every loaded example where `evaluates_all`."""
    from ..data.sources import load_data, split_parts

    data = load_data(args.data, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.max_examples, split=args.split, seed=args.split_seed)
    if evaluates_all(args) and args.block_terms in (None, "all"):
        return {"all": data}, data  # no part is asked for: nothing is split (a few rows need not fill every share)
    splits = split_parts(data, args.train_fraction, args.held_out_fraction, args.test_fraction, seed=args.split_seed,
                         by=args.split_by)
    if evaluates_all(args):
        return {**splits, "all": data}, data
    if args.eval_split not in splits:
        raise ValueError(f"--eval-split {args.eval_split}: that part is empty (its --{args.eval_split.replace('_', '-')}-fraction is 0)")
    return splits, splits[args.eval_split]


def route_terms(args: EvalArguments, model, splits: dict):
    """The Route A/B inputs from `--routes`, `--n-train`, `--delta-erm` and `--block-terms` (`None` if none given)."""
    from ..evaluation.route_terms import route_inputs
    from ..evaluation.routes import RouteInputs

    if not (args.routes or args.n_train is not None or args.delta_erm is not None or args.block_terms):
        return None
    given = read_routes(args.routes)
    if args.block_terms and args.block_terms not in splits:
        raise ValueError(f"--block-terms {args.block_terms!r} is not one of the splits {sorted(splits)}")
    measured = route_inputs(
        model if args.block_terms else None,
        n_train=args.n_train if args.n_train is not None else given.get("n_train"),
        delta_erm=args.delta_erm if args.delta_erm is not None else given.get("delta_erm"),
        block_data=splits.get(args.block_terms) if args.block_terms else None,
        batch_size=args.batch_size, progress=args.progress,
    )
    values = {k: getattr(measured, k) for k in ("n_train", "delta_erm", "rho", "b_w", "b_a")}
    sources = dict(given.get("sources", {}))
    for key in ("n_train", "delta_erm", "delta_r", "delta_r_test", "rho", "b_w", "b_a"):
        if values.get(key) is None and given.get(key) is not None:
            values[key] = given[key]
            sources.setdefault(key, f"from {args.routes}")
    sources.update(measured.sources)
    return RouteInputs(**values, sources=sources)


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow eval`: one flag per `EvalArguments` field, plus `--config`."""
    return ConfigParser([EvalArguments], prog="hf-depthgrow eval", description=__doc__)


def _eval(argv: list[str]) -> int:
    (args,) = build_parser().parse(argv)  # first: --help imports no torch
    from ..evaluation.formatting import scrub_paths
    from ..evaluation.paired import compare_models, evaluate_delta
    from ..evaluation.report import write_report
    from ..evaluation.retention import evaluate_retention
    from ..pipeline.output import staged_output
    from ..utils import write_json

    check_inputs(args)
    model, base, tokenizer = load_models(args)
    splits, test = load_splits(args, model, tokenizer)
    retention_data = load_retention(args, model, tokenizer)  # a bad set fails here, before any evaluation runs
    kwargs = dict(delta=args.delta, loss_bound=args.loss_bound, n_bootstrap=args.n_bootstrap, seed=args.seed, batch_size=args.batch_size,
                  use_evaluate=args.evaluate, progress=args.progress)
    routes = route_terms(args, model, splits)
    if base is not None:
        result = compare_models(base, model, test, routes=routes, **kwargs)
    else:
        result = evaluate_delta(model, test, routes=routes, **kwargs)
    result.models["old"]["name_or_path"] = args.base or f"{args.model} (new blocks bypassed)"
    result.models["new"]["name_or_path"] = args.model
    extra = {"data": args.data, "eval split": "all" if evaluates_all(args) else args.eval_split, "examples": result.num_examples}
    retained = None
    if retention_data is not None:
        # Route A/B terms are about the training domain; the retention run only needs the paired intervals.
        retention_result, retained = evaluate_retention(model, retention_data, base=base, **kwargs)
        retention_result.models["old"]["name_or_path"] = result.models["old"]["name_or_path"]
        retention_result.models["new"]["name_or_path"] = args.model
        name = scrub_paths(args.retention_data)  # reports name local files by folder or file name, never a full path
        retained = {"data": name, "block_size": args.block_size, **retained, "paired": retention_result.to_dict()}
        extra["retention"] = f"{name}: {retained['verdict']} (retention.json)"
        if args.lm_eval:
            from ..evaluation.lm_eval_task import lm_eval_retention

            retained["lm_eval"] = lm_eval_retention(model, tokenizer, args.retention_data, base=base, batch_size=args.batch_size)
            extra["retention (lm-eval)"] = retained["lm_eval"]["verdict"]
    with staged_output(args.output_dir) as tmp:  # a folder written whole or not at all, never over a user's files
        paths = write_report(result, tmp, command="hf-depthgrow eval " + shlex.join(argv), extra=extra)
        if retained is not None:
            paths["retention"] = write_json(tmp / "retention.json", retained)
    paths = {name: Path(args.output_dir) / path.relative_to(tmp) for name, path in paths.items()}
    print(result.verdict)
    if retained is not None:
        print(f"retention ({retained['data']}): {retained['verdict']}")
        if "lm_eval" in retained:
            print(retained["lm_eval"]["verdict"])
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow eval`; an input error is one line on stderr and exit code 2."""
    return run_command("eval", _eval, argv)


if __name__ == "__main__":
    raise SystemExit(main())
