"""Grow a small ViT image classifier by one block (default: Fashion-MNIST at 28x28, patches of 4).

    accelerate launch recipes/image_classification.py --config recipes/configs/image_classification/vit_fashion_mnist.yaml

No ViT weights ship in any installed package, so the recipe works in two stages with the same trainer:

1. base: a small `ViTForImageClassification` from a config (`vit_*` options), trained from scratch in
   full for `base_steps` -> this is f_old, saved to `<output_dir>/base`. Pass `base_model: <folder>` to
   reuse a saved base (or any ViT/DeiT/DINOv2 classifier folder).
2. growth: one native block (ViT is pre-norm: the family's own layer with zeroed output projections is
   exact) at `positions`, trained alone; the fallback rule compares it with f_old.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from hf_depthgrow import GrowthConfig, grow_depth
from hf_depthgrow.config import ScriptArguments, parse_args
from hf_depthgrow.data import load_data
from hf_depthgrow import load_model
from hf_depthgrow.training import TrainConfig, train


@dataclass
class BaseArguments:
    """Stage 1: the classifier the new block is grown on."""

    base_model: str | None = field(default=None, metadata={"help": "A saved ViT classifier; None: train one from scratch."})
    base_steps: int = field(default=300, metadata={"help": "Training steps of the base."})
    base_learning_rate: float = field(default=1e-3, metadata={"help": "Learning rate of the base."})
    num_labels: int = field(default=10, metadata={"help": "Classes."})
    vit_image_size: int = field(default=28, metadata={"help": "Input size the images are resized to."})
    vit_patch_size: int = field(default=4, metadata={"help": "Patch size."})
    vit_hidden_size: int = field(default=96, metadata={"help": "Width."})
    vit_layers: int = field(default=6, metadata={"help": "Depth of the base."})
    vit_heads: int = field(default=4, metadata={"help": "Attention heads."})
    vit_seed: int = field(default=0, metadata={"help": "Seed of the base's initialisation."})

    def __post_init__(self):
        for name in ("base_steps", "num_labels", "vit_image_size", "vit_patch_size", "vit_hidden_size", "vit_layers", "vit_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.vit_image_size % self.vit_patch_size:
            raise ValueError("vit_image_size must be a multiple of vit_patch_size")
        if self.vit_hidden_size % self.vit_heads:
            raise ValueError("vit_hidden_size must be a multiple of vit_heads")


def build_base(base: BaseArguments):
    """`(model, fitted)`: a saved classifier, or a fresh small ViT."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    if base.base_model:
        return load_model(base.base_model, "image_classification")[0], True
    config = ViTConfig(
        image_size=base.vit_image_size, patch_size=base.vit_patch_size, num_channels=1, hidden_size=base.vit_hidden_size,
        num_hidden_layers=base.vit_layers, num_attention_heads=base.vit_heads, intermediate_size=4 * base.vit_hidden_size,
        num_labels=base.num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(base.vit_seed)
    return ViTForImageClassification(config), False


def parse(argv: list[str] | None = None):
    """`(ScriptArguments, TrainConfig, BaseArguments)` from the command line and `--config file.yaml`."""
    return parse_args(ScriptArguments, TrainConfig, BaseArguments, argv=argv, prog="recipes/image_classification.py", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    args, config, base = parse(argv)
    run(args, config, base)
    return 0


def run(args: ScriptArguments, config: TrainConfig, base: BaseArguments):
    from accelerate import PartialState

    state = PartialState()
    model, fitted = build_base(base)
    # pixel values at the model's size and channels
    ds = load_data(args.dataset, model=model, block_size=args.block_size, max_examples=args.max_examples, seed=args.split_seed)
    train_ds, held_out = args.split(ds)
    if not fitted:
        base_cfg = replace(config, trainable="full", max_steps=base.base_steps, learning_rate=base.base_learning_rate,
                           fallback=False, save_steps=0, resume_from_checkpoint=None, prefix_cache="off", warmup_ratio=0.05,
                           warmup_steps=0, output_dir=str(Path(config.output_dir) / "base") if config.output_dir else None)
        fit = train(model, train_ds, config=base_cfg, eval_data=held_out)
        model = fit.model
        if state.is_main_process:
            print(f"base: held-out loss {fit.eval_loss_before:.4f} -> {fit.eval_loss_after:.4f}")
    if not args.positions:
        raise ValueError("set positions (where to insert the new block), e.g. positions: [4]")
    grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    result = train(model, train_ds, config=config, eval_data=held_out)
    if state.is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return result


if __name__ == "__main__":
    sys.exit(main())
