"""Grow a causal LM by one zero-initialised block and train the new block (default: SmolLM2-135M on Shakespeare).

    accelerate launch recipes/causal_lm.py --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

One process on CPU works too (`python recipes/causal_lm.py --config ...`); several GPUs (a grown model of 1B
parameters or more trains with gradient checkpointing: `--gradient-checkpointing-above`):

    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/causal_lm.py \
        --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

Steps: load the model -> cut the corpus into blocks -> seeded train/held-out split -> (stepping stone
f~_S) -> grow at `positions` -> train the new block (frozen-prefix cache, fallback rule) -> save
`<output_dir>/model` (plain transformers loads it) and `<output_dir>/loss_curve.png`.
Any option of the YAML can be overridden on the command line (`--max-steps 10`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_depthgrow import GrowthConfig, grow_depth, stepping_stone
from hf_depthgrow.config import ScriptArguments, parse_args
from hf_depthgrow.data import load_data
from hf_depthgrow import load_model
from hf_depthgrow.plots import plot_training
from hf_depthgrow.training import TrainConfig, train


@dataclass
class RecipeArguments:
    """Extras of this recipe."""

    loss_curve: bool = field(default=True, metadata={"help": "Plot <output_dir>/loss_curve.png (main process)."})
    # From about 1B parameters the activations of the layers above the new blocks outgrow the weights, gradients and
    # AdamW state together (a Llama-3.2-1B shape grown interleave:4, bf16, 4 x 2048 tokens: 10.6 GiB of activations
    # against 5.9 GiB; with checkpointing 1.7 GiB, `hf-depthgrow estimate`); below it, checkpointing buys memory that
    # is not short for one more forward per step.
    gradient_checkpointing_above: int | None = field(
        default=1_000_000_000,
        metadata={"help": "Turn gradient checkpointing on for a grown model with at least this many parameters; none: only "
                          "--gradient-checkpointing decides."},
    )


def parse(argv: list[str] | None = None):
    """`(ScriptArguments, TrainConfig, RecipeArguments)` from the command line and `--config file.yaml`."""
    return parse_args(ScriptArguments, TrainConfig, RecipeArguments, argv=argv, prog="recipes/causal_lm.py", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    args, config, recipe = parse(argv)
    run(args, config, recipe)
    return 0


def with_checkpointing_above(config: TrainConfig, model, threshold: int | None) -> TrainConfig:
    """`config` with gradient checkpointing on when the grown model has at least `threshold` parameters."""
    count = sum(p.numel() for p in model.parameters())
    if threshold is None or config.gradient_checkpointing or count < threshold:
        return config
    print(f"[causal_lm] {count / 1e9:.2f}B parameters >= {threshold / 1e9:g}B: gradient checkpointing on", file=sys.stderr)
    return dataclasses.replace(config, gradient_checkpointing=True)


def run(args: ScriptArguments, config: TrainConfig, recipe: RecipeArguments):
    import torch
    from accelerate import PartialState

    model, tokenizer = load_model(args.model or "smollm2", dtype=getattr(torch, args.dtype))
    # fixed-size blocks of `block_size` tokens, labels = inputs
    ds = load_data(args.dataset, model=model, tokenizer=tokenizer, block_size=args.block_size, max_examples=args.max_examples, seed=args.split_seed)
    train_ds, held_out = args.split(ds)
    if not args.positions:
        raise ValueError("set positions (where to insert the new block), e.g. positions: [24]")
    stone = None
    if args.stepping_stone:
        # f~_S for the fallback rule: one first-order step of the new block, built on a copy.
        stone = stepping_stone(model, args.positions[0], train_ds, block=args.block, init=args.init, seed=args.growth_seed,
                               max_batches=args.stepping_stone_max_batches,
                               batch_size=config.per_device_eval_batch_size or config.per_device_train_batch_size)
    grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    config = with_checkpointing_above(config, model, recipe.gradient_checkpointing_above)
    result = train(model, train_ds, config=config, eval_data=held_out, stepping_stone=stone, tokenizer=tokenizer)
    if PartialState().is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
        if recipe.loss_curve and config.output_dir:
            plot_training(result, Path(config.output_dir) / "loss_curve.png")
    return result


if __name__ == "__main__":
    sys.exit(main())
