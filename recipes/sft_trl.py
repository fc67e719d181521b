"""Grow a causal LM by one zero-initialised block and train the new block with trl's SFTTrainer (default: SmolLM2-135M on Shakespeare).

    accelerate launch recipes/sft_trl.py --config recipes/configs/sft_trl/smollm2_shakespeare.yaml

One process on CPU works too (`python recipes/sft_trl.py --config ...`). Needs `pip install trl`.

Steps: load the model -> cut the corpus into blocks -> seeded train/held-out split -> grow at `positions`
-> `prepare_grown_model` (only the new blocks train; saves keep the growth files) -> `SFTTrainer` on the
training blocks, with `FallbackCallback` on the held-out blocks (if the trained model is worse than the
original there, the new blocks go back to zero init) -> `<output_dir>/model` (`hf_depthgrow.load_pretrained`
loads it; native growth also with plain transformers) and `<output_dir>/sft_summary.json`.
Any option of the YAML can be overridden on the command line (`--max-steps 10`). Unlike `recipes/causal_lm.py`
(hf_depthgrow's own trainer) there is no frozen-prefix cache: every step runs the whole model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_depthgrow import GrowthConfig, grow_depth, load_model
from hf_depthgrow.config import ScriptArguments, parse_args
from hf_depthgrow.data import load_data
from hf_depthgrow.training import FallbackCallback, prepare_grown_model

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclass
class SFTArguments:
    """The `trl.SFTConfig` fields this recipe sets (same names); every other field keeps trl's default."""

    output_dir: str = field(default="runs/sft-trl", metadata={"help": "Where the model, checkpoints and summary go."})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate (only the new blocks train)."})
    max_steps: int = field(default=64, metadata={"help": "Optimizer steps."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Blocks per device and micro-batch."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Blocks per forward of the fallback rule's losses."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule.", "choices": list(SCHEDULERS)})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping."})
    logging_steps: int = field(default=1, metadata={"help": "Log (and check the loss is finite) every N steps."})
    save_steps: int = field(default=0, metadata={"help": "Write a checkpoint every N steps; 0: none."})
    seed: int = field(default=0, metadata={"help": "Seed of the data order."})
    bf16: bool = field(default=False, metadata={"help": "bf16 autocast (trl's default is on; off here: exact on CPU)."})
    activation_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in the backward (trl's default is on)."})
    fallback: bool = field(default=True, metadata={"help": "Apply the fallback rule on the held-out blocks at the end."})

    def __post_init__(self):
        for name in ("max_steps", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "logging_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if self.warmup_steps < 0 or self.save_steps < 0:
            raise ValueError(f"warmup_steps and save_steps must be >= 0, got {self.warmup_steps} and {self.save_steps}")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"lr_scheduler_type must be one of {SCHEDULERS}, got {self.lr_scheduler_type!r}")

    def sft_config(self, max_length: int):
        """The `trl.SFTConfig` of these settings (fixed-size token blocks of `max_length`, no packing)."""
        from dataclasses import fields

        from trl import SFTConfig

        values = {k: v for k, v in asdict(self).items() if k not in ("fallback", "save_steps")}
        if "activation_checkpointing" not in {f.name for f in fields(SFTConfig)}:  # transformers < 5.2x: the older name
            values["gradient_checkpointing"] = values.pop("activation_checkpointing")
        saving = {"save_strategy": "steps", "save_steps": self.save_steps} if self.save_steps else {"save_strategy": "no"}
        import torch

        # pin_memory only helps a copy to a GPU (and warns without one)
        return SFTConfig(**values, **saving, max_length=max_length, packing=False, report_to="none",
                         dataloader_pin_memory=torch.cuda.is_available())


def parse(argv: list[str] | None = None):
    """`(ScriptArguments, SFTArguments)` from the command line and `--config file.yaml`."""
    return parse_args(ScriptArguments, SFTArguments, argv=argv, prog="recipes/sft_trl.py", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    args, sft = parse(argv)
    run(args, sft)
    return 0


def run(args: ScriptArguments, sft: SFTArguments) -> dict:
    import torch
    import trl
    from accelerate import PartialState

    if not args.positions:
        raise ValueError("set positions (where to insert the new block), e.g. positions: [24]")
    if args.stepping_stone:
        raise ValueError("stepping_stone is not supported by this recipe (its fallback rule compares f_new with f_old only)")
    if sft.fallback and not args.held_out_fraction:
        raise ValueError("fallback: true needs held-out blocks; set held_out_fraction > 0 (or fallback: false)")
    model, tokenizer = load_model(args.model or "smollm2", dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer found; SFTTrainer needs one")
    # fixed-size blocks of `block_size` tokens with labels = inputs: trl takes them as a tokenised dataset
    ds = load_data(args.dataset, model=model, tokenizer=tokenizer, block_size=args.block_size, max_examples=args.max_examples, seed=args.split_seed)
    train_ds, held_out = args.split(ds)
    grow_depth(model, args.positions, config=GrowthConfig(block=args.block, init=args.init, seed=args.growth_seed))
    trainable = prepare_grown_model(model)
    callback = FallbackCallback(held_out, batch_size=sft.per_device_eval_batch_size) if sft.fallback else None
    trainer = trl.SFTTrainer(model=model, args=sft.sft_config(args.block_size), train_dataset=train_ds.with_format(None),
                             processing_class=tokenizer, callbacks=[callback] if callback else None)
    trainer.train()
    out = Path(sft.output_dir)
    trainer.save_model(str(out / "model"))  # keeps the growth record (and adapter blocks: prepare_grown_model)
    summary = {
        "trainable_parameters": trainable,
        "num_train_examples": len(train_ds),
        "fallback": callback.result.to_dict() if callback else None,
        "train_losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
    }
    if PartialState().is_main_process:
        (out / "sft_summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        print(json.dumps({k: v for k, v in summary.items() if k != "train_losses"}, indent=2, sort_keys=True))
    return summary


if __name__ == "__main__":
    sys.exit(main())
