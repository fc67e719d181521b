"""Grow a causal LM by one zero-initialised block and train the new block (default: SmolLM2-135M on Shakespeare).

    accelerate launch recipes/causal_lm.py --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

One process on CPU works too (`python recipes/causal_lm.py --config ...`); several GPUs:

    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/causal_lm.py \
        --config recipes/configs/causal_lm/smollm2_shakespeare.yaml

Steps: load the model -> cut the corpus into blocks -> seeded train/held-out split -> (stepping stone
f~_S) -> grow at `positions` -> train the new block (frozen-prefix cache, fallback rule) -> save
`<output_dir>/model` (plain transformers loads it) and `<output_dir>/loss_curve.png`.
Any option of the YAML can be overridden on the command line (`--max_steps 10`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_depthgrow import GrowthConfig, grow_depth
from hf_depthgrow.cli.train import ScriptArguments, load_dataset_for, load_model_and_tokenizer, parse_args, split
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.trainer import train


@dataclass
class RecipeArguments:
    """Extras of this recipe."""

    loss_curve: bool = field(default=True, metadata={"help": "Plot <output_dir>/loss_curve.png (main process)."})


def plot_loss_curve(result, path: Path, title: str) -> None:
    """Training loss per logged step and held-out loss at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    steps = [h["step"] for h in result.history]
    ax.plot(steps, [h["loss"] for h in result.history], lw=1, alpha=0.7, label="train (batch)")
    if result.eval_history:
        ax.plot([e["step"] for e in result.eval_history], [e["eval_loss"] for e in result.eval_history], "o-", label="held-out")
        ax.axhline(result.eval_history[0]["eval_loss"], ls=":", c="grey", label="held-out, original model")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse(argv: list[str] | None = None):
    """`(ScriptArguments, TrainConfig, RecipeArguments)` from the command line and `--config file.yaml`."""
    return parse_args(argv, RecipeArguments)


def main(argv: list[str] | None = None) -> int:
    args, config, recipe = parse(argv)
    run(args, config, recipe)
    return 0


def run(args: ScriptArguments, config: TrainConfig, recipe: RecipeArguments):
    from accelerate import PartialState

    model, tokenizer = load_model_and_tokenizer(args.model or "smollm2", args.dtype)
    ds = load_dataset_for(args, model, tokenizer)  # fixed-size blocks of `block_size` tokens, labels = inputs
    train_ds, held_out = split(args, ds)
    if not args.positions:
        raise ValueError("set positions (where to insert the new block), e.g. positions: [24]")
    stone = None
    if args.stepping_stone:
        from hf_depthgrow.probe.stepping_stone import stepping_stone

        # f~_S for the fallback rule: one first-order step of the new block, built on a copy.
        stone = stepping_stone(model, args.positions[0], train_ds, block=args.block, init=args.init, seed=args.growth_seed,
                               max_batches=args.stepping_stone_max_batches,
                               batch_size=config.per_device_eval_batch_size or config.per_device_train_batch_size)
    grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    result = train(model, train_ds, config=config, eval_data=held_out, stepping_stone=stone, tokenizer=tokenizer)
    if PartialState().is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
        if recipe.loss_curve and config.output_dir:
            title = f"{args.model or 'smollm2'} + 1 block at k={args.positions}, {args.dataset}, {result.global_step} steps"
            plot_loss_curve(result, Path(config.output_dir) / "loss_curve.png", title)
    return result


if __name__ == "__main__":
    sys.exit(main())
