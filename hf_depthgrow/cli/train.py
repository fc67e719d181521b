"""`hf-depthgrow train`: grow (optionally) and train a model's new blocks with Accelerate.

Single process:

    hf-depthgrow train --model smollm2 --positions 24 --dataset shakespeare --block_size 128 \
        --max_steps 100 --output_dir runs/smollm2-k24

Several processes (DDP/FSDP from an accelerate config):

    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml \
        -m hf_depthgrow.cli.train --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

Every `TrainConfig` field is an option; `--config file.yaml` sets any of them (and the
`ScriptArguments` below), and options on the command line override the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..training.config import TrainConfig


@dataclass
class ScriptArguments:
    """What to train on: model, growth and data (the settings of the training itself are `TrainConfig`)."""

    model: str | None = field(
        default=None,
        metadata={"help": "A saved model folder (grown or not), a Hub id, or 'smollm2' (the embedded SmolLM2-135M)."},
    )
    positions: list[int] | None = field(default=None, metadata={"help": "Grow at these positions k first (omit for a grown model)."})
    block: str = field(default="auto", metadata={"help": "Block kind for growth: auto, native or adapter."})
    init: str = field(default="copy", metadata={"help": "Native block init: copy or random."})
    growth_seed: int = field(default=0, metadata={"help": "Seed of the new blocks' random parts."})
    dataset: str | None = field(
        default=None,
        metadata={"help": "shakespeare, tweets, fashion_mnist, digits, a local file/folder, a Hub id, or a save_to_disk folder."},
    )
    block_size: int = field(default=256, metadata={"help": "Tokens per causal-LM block / padded text length."})
    max_examples: int | None = field(default=None, metadata={"help": "Use at most this many examples (before the split)."})
    eval_fraction: float = field(default=0.1, metadata={"help": "Held-out share for evaluation; 0: none."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the train/held-out split."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 or bfloat16."})
    stepping_stone: bool = field(default=False, metadata={"help": "Build f~_S (one position) for the fallback rule."})
    stepping_stone_max_batches: int | None = field(default=None, metadata={"help": "Batches of training data f~_S is built on."})

    def __post_init__(self):
        if self.block not in ("auto", "native", "adapter"):
            raise ValueError(f"block must be auto, native or adapter, got {self.block!r}")
        if self.init not in ("copy", "random"):
            raise ValueError(f"init must be copy or random, got {self.init!r}")
        if not (isinstance(self.eval_fraction, (int, float)) and 0 <= self.eval_fraction < 1):
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.positions is not None and (not self.positions or not all(isinstance(k, int) and not isinstance(k, bool) for k in self.positions)):
            raise ValueError(f"positions must be a non-empty list of ints, got {self.positions!r}")
        if self.stepping_stone and self.positions is not None and len(self.positions) != 1:
            raise ValueError("stepping_stone=True needs exactly one growth position")


def _hf_parser_class():
    from transformers import HfArgumentParser

    class DepthgrowArgumentParser(HfArgumentParser):
        """`HfArgumentParser` with `--config file.yaml` (trl's `TrlParser` idea).

        The YAML is flat: keys are field names of any of the dataclasses. Its values become defaults, so
        command-line options override them; an unknown key is an error, not a silent no-op.
        """

        def parse_args_and_config(self, args: list[str] | None = None):
            args = list(sys.argv[1:] if args is None else args)
            pre = argparse.ArgumentParser(add_help=False)
            pre.add_argument("--config", default=None)
            known, rest = pre.parse_known_args(args)
            if known.config:
                self.apply_yaml(known.config)
            outputs = self.parse_args_into_dataclasses(rest)
            return outputs[: len(self.dataclass_types)]  # drop the namespace holding `config`

        def apply_yaml(self, path: str) -> dict:
            import yaml

            values = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(values, dict):
                raise ValueError(f"{path}: expected a mapping of option names to values")
            allowed = {f.name for dtype in self.dataclass_types for f in fields(dtype)}
            unknown = sorted(set(values) - allowed)
            if unknown:
                raise ValueError(f"{path}: unknown option(s) {unknown}; known: {sorted(allowed)}")
            self.set_defaults(**values)
            for action in self._actions:
                if action.dest in values:
                    action.required = False
            return values

    return DepthgrowArgumentParser


def build_parser(*extra_dataclasses):
    """The parser of `hf-depthgrow train`: `ScriptArguments` and `TrainConfig` (plus any dataclasses a recipe adds)."""
    parser_cls = _hf_parser_class()
    parser = parser_cls((ScriptArguments, TrainConfig, *extra_dataclasses), prog="hf-depthgrow train", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file of options (command-line options override it)")
    return parser


def parse_args(argv: list[str] | None = None, *extra_dataclasses):
    """Parse `argv` (and `--config`) into `(ScriptArguments, TrainConfig, *extra)`."""
    return build_parser(*extra_dataclasses).parse_args_and_config(argv)


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_model_and_tokenizer(name: str, dtype: str = "float32"):
    """`(model, tokenizer or None)` for a saved folder, a Hub id, or `smollm2`."""
    import torch

    torch_dtype = getattr(torch, _DTYPES[dtype])
    if name == "smollm2":
        from ..data.embedded import load_smollm2

        return load_smollm2(dtype=torch_dtype)
    from ..hub.serialization import load_pretrained
    from .common import load_tokenizer_if_any

    return load_pretrained(name, dtype=torch_dtype), load_tokenizer_if_any(name)


def load_dataset_for(args: ScriptArguments, model, tokenizer):
    """The data set named by `args.dataset`, as model inputs with labels; a `save_to_disk` folder is read as is."""
    path = Path(args.dataset)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if args.max_examples is not None:
            ds = ds.select(range(min(args.max_examples, len(ds))))
        return ds.with_format("torch")
    from ..data.sources import load_data

    return load_data(args.dataset, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.max_examples, seed=args.split_seed)


def split(args: ScriptArguments, ds):
    """`(train, held_out or None)` by `args.eval_fraction`."""
    if not args.eval_fraction:
        return ds, None
    from ..data.sources import split_dataset

    parts = split_dataset(ds, {"train": 1 - args.eval_fraction, "held_out": args.eval_fraction}, seed=args.split_seed)
    return parts["train"], parts["held_out"]


def run(args: ScriptArguments, config: TrainConfig):
    """Load, grow, split, train: what `main` does after parsing. Returns the `TrainResult`."""
    from ..growth.engine import GrowthConfig, grow_depth, growth_record
    from ..training.trainer import train

    if not args.model or not args.dataset:
        raise ValueError("--model and --dataset are required (on the command line or in --config)")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    ds = load_dataset_for(args, model, tokenizer)
    train_ds, eval_ds = split(args, ds)
    stone = None
    if args.positions:
        if growth_record(model) and config.trainable != "full":
            print(f"[hf-depthgrow train] {args.model} is already grown; growing again at {args.positions}", file=sys.stderr)
        if args.stepping_stone:
            from ..probe.stepping_stone import stepping_stone

            # Built from the original model before it is grown (stepping_stone grows a copy).
            stone = stepping_stone(model, args.positions[0], train_ds, block=args.block, init=args.init,
                                   seed=args.growth_seed, max_batches=args.stepping_stone_max_batches,
                                   batch_size=config.per_device_eval_batch_size or config.per_device_train_batch_size)
        grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    elif args.stepping_stone:
        raise ValueError("stepping_stone=True needs positions (the stone is built while growing)")
    return train(model, train_ds, config=config, eval_data=eval_ds, stepping_stone=stone, tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> int:
    try:
        args, config = parse_args(argv)
    except ValueError as err:
        print(f"hf-depthgrow train: {err}", file=sys.stderr)
        return 2
    result = run(args, config)
    from accelerate import PartialState

    if PartialState().is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
