"""Grow a BERT-style text classifier by one block (default: all-MiniLM-L6-v2 on sentiment tweets).

    accelerate launch recipes/text_classification.py --config recipes/configs/text_classification/minilm_tweets.yaml

all-MiniLM-L6-v2 ships as a sentence encoder without a classification head, so the recipe works in
two stages, both with the same trainer:

1. base: `BertForSequenceClassification` from the MiniLM folder (`load_model("minilm", "text_classification")`;
   the head is new), fine-tuned in full for `base_steps` -> this is f_old, saved to `<output_dir>/base`.
   Pass `base_model: <folder>` to reuse a saved base instead.
2. growth: one adapter block (BERT is post-norm, so `block: auto` picks the exact adapter) at
   `positions`, trained alone; the fallback rule compares it with f_old on the training loss.
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

    base_model: str | None = field(default=None, metadata={"help": "A saved fine-tuned base; None: fine-tune one first."})
    num_labels: int = field(default=3, metadata={"help": "Classes (tweets: negative, neutral, positive)."})
    base_steps: int = field(default=200, metadata={"help": "Full fine-tuning steps of the base."})
    base_learning_rate: float = field(default=5e-5, metadata={"help": "Learning rate of the base fine-tuning."})

    def __post_init__(self):
        if not isinstance(self.num_labels, int) or self.num_labels < 2:
            raise ValueError(f"num_labels must be an int >= 2, got {self.num_labels!r}")
        if not isinstance(self.base_steps, int) or self.base_steps < 1:
            raise ValueError(f"base_steps must be an int >= 1, got {self.base_steps!r}")


def load_base(args: ScriptArguments, base: BaseArguments):
    """`(model, tokenizer, fitted)`: a saved fine-tuned base, or MiniLM (or `args.model`) with a new head."""
    if base.base_model:
        model, tokenizer = load_model(base.base_model, "text_classification")
        return model, tokenizer, True
    model, tokenizer = load_model(args.model or "minilm", "text_classification", num_labels=base.num_labels)
    return model, tokenizer, False


def parse(argv: list[str] | None = None):
    """`(ScriptArguments, TrainConfig, BaseArguments)` from the command line and `--config file.yaml`."""
    return parse_args(ScriptArguments, TrainConfig, BaseArguments, argv=argv, prog="recipes/text_classification.py", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    args, config, base = parse(argv)
    run(args, config, base)
    return 0


def run(args: ScriptArguments, config: TrainConfig, base: BaseArguments):
    from accelerate import PartialState

    state = PartialState()
    model, tokenizer, fitted = load_base(args, base)
    # max_examples is a seeded sample (hf_depthgrow.data.sources), so the label-sorted tweets file gives every class.
    # padded to block_size, integer labels
    ds = load_data(args.dataset, model=model, tokenizer=tokenizer, block_size=args.block_size, max_examples=args.max_examples, seed=args.split_seed)
    train_ds, held_out = args.split(ds)
    if not fitted:
        # Stage 1: fit head and encoder (an ungrown model trains only with trainable="full").
        base_cfg = replace(config, trainable="full", max_steps=base.base_steps, learning_rate=base.base_learning_rate,
                           fallback=False, save_steps=0, resume_from_checkpoint=None, prefix_cache="off",
                           output_dir=str(Path(config.output_dir) / "base") if config.output_dir else None)
        fit = train(model, train_ds, config=base_cfg, eval_data=held_out, tokenizer=tokenizer)
        model = fit.model
        if state.is_main_process:
            print(f"base: held-out loss {fit.eval_loss_before:.4f} -> {fit.eval_loss_after:.4f}")
    if not args.positions:
        raise ValueError("set positions (where to insert the new block), e.g. positions: [3]")
    # Stage 2: grow (adapter blocks are exact for post-norm BERT) and train the new block alone.
    grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    result = train(model, train_ds, config=config, eval_data=held_out, tokenizer=tokenizer)
    if state.is_main_process:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("history", "eval_history")}
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return result


if __name__ == "__main__":
    sys.exit(main())
