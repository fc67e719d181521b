"""`hf-depthgrow train`: grow (optionally) and train a model's new blocks with Accelerate.

Single process:

    hf-depthgrow train --model smollm2 --positions 24 --data shakespeare --block-size 128 \
        --max-steps 100 --output-dir runs/smollm2-k24

Several processes (DDP/FSDP from an accelerate config):

    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml \
        -m hf_depthgrow.cli.train --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

Every `ScriptArguments` and `TrainConfig` field is a flag (`--kebab-case`); `--config file.yaml` sets
any of them (keys are the field names), and flags on the command line override the file.

`--output-dir` is new or empty, or holds an earlier run of this command: `--resume` continues it from its
last checkpoint, `--overwrite` replaces what that run wrote. A folder holding anything else is refused, and
nothing in it changes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import ConfigParser, ScriptArguments, shared_field
from ..training.config import TrainConfig
from ..utils import interrupt_hint, interrupt_stage
from .common import dtype_of, run_command


@dataclass
class TrainOutput:
    """What `hf-depthgrow train` does with an output folder an earlier run of it wrote."""

    overwrite: bool = shared_field("overwrite", False, more="Here: an earlier run's checkpoints, logs and model.")
    resume: bool = field(
        default=False,
        metadata={"help": "Continue the run in --output-dir from its last checkpoint (as --resume-from-checkpoint latest)."},
    )


def build_parser(*extra_dataclasses) -> ConfigParser:
    """The parser of `hf-depthgrow train`: `ScriptArguments`, `TrainConfig` and `TrainOutput` (plus any extra dataclasses)."""
    return ConfigParser([ScriptArguments, TrainConfig, TrainOutput, *extra_dataclasses], prog="hf-depthgrow train", description=__doc__)


def _load_dataset(args: ScriptArguments, model, tokenizer):
    """The data set named by `--data` (`args.dataset`) as model inputs with labels; a `save_to_disk` folder is read as is."""
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


def _streamed(args: ScriptArguments, config: TrainConfig, model, tokenizer):
    """`(train rows, held-out)` from a stream: exactly the blocks `--max-steps` reads, checked before training."""
    from accelerate import PartialState

    from ..data.streaming import stream_data

    per_step = config.per_device_train_batch_size * PartialState().num_processes * config.gradient_accumulation_steps
    held_out, rows = stream_data(args.dataset, tokenizer, block_size=args.block_size, train_blocks=config.max_steps * per_step,
                                 held_out_blocks=args.held_out_blocks, model=model)
    return rows, held_out


def run(args: ScriptArguments, config: TrainConfig, before_training=None):
    """Load, grow, split, train: what `main` does after parsing. Returns the `TrainResult`.

    `before_training`, if given, is called once every input has loaded and checked, right before training starts
    (the command claims its output folder there, so that bad input leaves nothing on disk).
    """
    from ..growth.config import GrowthConfig
    from ..growth.engine import grow_depth
    from ..growth.record import growth_record
    from ..hub.loading import load_model
    from ..training.trainer import train

    from ..hub.loading import check_model_source, check_quantizable
    from ..pipeline.checks import check_data_source

    if not args.model or not args.dataset:
        raise ValueError("--model and --data are required (on the command line or in --config)")
    if args.positions is not None and min(args.positions) < 0:
        raise ValueError(f"--positions must be ints >= 0, got {args.positions}")
    if args.stepping_stone and not args.positions:
        raise ValueError("stepping_stone=True needs positions (the stone is built while growing)")
    check_model_source(args.model)  # cheap checks before the (expensive) model load
    check_data_source(args.dataset)
    if args.streaming and config.max_steps <= 0:
        raise ValueError("--streaming needs --max-steps > 0: a stream has no epochs")
    if args.streaming and (args.train_fraction is not None or args.test_fraction or args.split_by is not None):
        raise ValueError("--streaming holds out the stream's first --held-out-blocks and splits nothing: "
                         "drop --train-fraction, --test-fraction and --split-by")
    if args.quantize is not None:
        check_quantizable(args.model, args.quantize)
        if config.trainable != "new":
            raise ValueError(f"--quantize keeps the base frozen, so it needs --trainable new (got {config.trainable!r})")
        if not args.positions:
            raise ValueError("--quantize loads an ungrown base: pass --positions to grow it (its new blocks are what trains)")
    model, tokenizer = load_model(args.model, dtype=dtype_of(args.dtype), quantize=args.quantize, trust_remote_code=args.trust_remote_code)
    train_ds, eval_ds = _streamed(args, config, model, tokenizer) if args.streaming else args.split(_load_dataset(args, model, tokenizer))
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
    if before_training is not None:
        before_training()
    return train(model, train_ds, config=config, eval_data=eval_ds, stepping_stone=stone, tokenizer=tokenizer)


def _resume_hint(config: TrainConfig):
    """How an interrupted `train` goes on (asked at the interrupt): from its last checkpoint when it wrote one."""
    if not (config.save_steps and config.output_dir):
        return "no checkpoint was written (--save-steps 0): the same command starts over"
    again = "the same command" + ("" if config.resume_from_checkpoint == "latest" else " with --resume")

    def hint() -> str:
        written = any(p.is_dir() for p in Path(config.output_dir).glob("checkpoint-*"))
        return f"{again} continues from the last checkpoint in {config.output_dir}" + ("" if written else " (none yet: it starts over)")

    return hint


def _left_by_a_killed_run(out: Path) -> list[Path]:
    """What a run of this command killed before its end (no chance to record its files) left in `out`, provably its own:
    the checkpoints whose files match their digest, and the trainer's lock file."""
    from ..training.checkpoints import CheckpointIntegrityError, list_checkpoints, verify_digest
    from ..training.guards import LOCK_NAME

    found = [out / LOCK_NAME] if (out / LOCK_NAME).is_file() else []
    for checkpoint in list_checkpoints(out):
        try:
            verify_digest(checkpoint)
        except CheckpointIntegrityError:
            continue  # not provably ours: --overwrite refuses it, naming it
        found.append(checkpoint)
    return found


def _first_process() -> bool:
    """Whether this is the first (or only) process of the run; before the trainer starts the processes' group, the
    launcher's environment says."""
    import os

    return os.environ.get("RANK", "0") == "0"


def _check_output(config: TrainConfig, output: TrainOutput) -> None:
    """Refuse, touching nothing, an `--output-dir` that `_claim_output` would refuse (the cheap cases, before anything loads)."""
    from ..pipeline.output import MARKER, foreign_files

    out = Path(config.output_dir) if config.output_dir and _first_process() else None
    if out is None or not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / MARKER).is_file():
        raise FileExistsError(f"will not write into {out}: it was not written by hf-depthgrow (no {MARKER} file); choose another output folder")
    ours = {p.name for p in _left_by_a_killed_run(out)}
    theirs = [f for f in foreign_files(out) if f.split("/", 1)[0] not in ours]
    if theirs:
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        raise FileExistsError(f"will not write into {out}: it holds files hf-depthgrow did not write ({shown}): move them out of it first")
    if config.resume_from_checkpoint is None and not output.overwrite:
        raise FileExistsError(f"{out} holds a training run written earlier: pass --resume to continue it or --overwrite to replace it")


def _claim_output(config: TrainConfig, output: TrainOutput) -> Path | None:
    """Claim `--output-dir` for this run (`claim_output_dir`): `None` without one, and on every process but the first.

    Should the first process refuse the folder, it exits and the launcher stops the others.
    """
    from ..pipeline.output import MARKER, claim_output_dir, record_outputs

    if not config.output_dir or not _first_process():
        return None
    if (Path(config.output_dir) / MARKER).is_file():  # an earlier run's folder
        record_outputs(config.output_dir, _left_by_a_killed_run(Path(config.output_dir)))
    return claim_output_dir(config.output_dir, resume=config.resume_from_checkpoint is not None, overwrite=output.overwrite,
                            what="a training run")


def _resume_flag(argv: list[str]) -> list[str]:
    """`--resume PATH`, the old spelling of `--resume-from-checkpoint PATH`, as that flag (with a warning).

    `--resume` alone (or `--resume latest`) continues from the newest checkpoint in --output-dir.
    """
    import warnings

    from ..config import FlagDeprecation

    out, i = [], 0
    while i < len(argv):
        token, value = argv[i], None
        if token.startswith("--resume="):
            token, value = "--resume", token.split("=", 1)[1]
        elif token == "--resume" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value, i = argv[i + 1], i + 1
        if value is None or value.lower() in ("latest", "true", "yes", "1", "on"):
            out.append(token)
        elif value.lower() in ("false", "no", "0", "off"):
            out.append("--no-resume")
        else:
            warnings.warn(f"--resume {value} is deprecated, use --resume-from-checkpoint {value}", FlagDeprecation, stacklevel=2)
            out += ["--resume-from-checkpoint", value]
        i += 1
    return out


def _train(argv: list[str]) -> int:
    args, config, output = build_parser().parse(_resume_flag(argv))
    if output.resume and config.resume_from_checkpoint is None:
        config = replace(config, resume_from_checkpoint="latest")
    if config.resume_from_checkpoint is not None and output.overwrite:
        raise ValueError("--resume continues the run in --output-dir and --overwrite replaces it: give one of them")
    interrupt_stage("training")
    interrupt_hint(_resume_hint(config))
    _check_output(config, output)  # before the model loads; claimed (and an earlier run's files replaced) once all inputs are good
    claimed = []
    try:
        result = run(args, config, before_training=lambda: claimed.append(_claim_output(config, output)))
    finally:  # checkpoints written before a failure or an interrupt are the tool's too: --resume and --overwrite accept them
        if claimed and claimed[0] is not None:
            from ..pipeline.output import MARKER, record_outputs

            record_outputs(claimed[0], [p for p in claimed[0].iterdir() if p.name != MARKER])
    from accelerate import PartialState

    if PartialState().is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow train`; an input error is one line on stderr and exit code 2."""
    return run_command("train", _train, argv)


if __name__ == "__main__":
    sys.exit(main())
