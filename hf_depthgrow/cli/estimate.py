"""`hf-depthgrow estimate`: the memory an arm needs per device, from the model's config alone (offline, no weights).

    hf-depthgrow estimate --model smollm2 --positions 24 --block-size 512 --batch-size 8
    hf-depthgrow estimate --model path/to/config.json --positions interleave:8 --trainable new new+lora full \
        --block-size 4096 --batch-size 1 --gradient-checkpointing --dtype bfloat16 --device-memory 80GiB
    hf-depthgrow estimate --model meta-llama/Llama-3.1-70B --positions interleave:16 --quantize 4bit --gpus 8 --zero 3

The grown model is built on the meta device and one forward runs on fake tensors to see what autograd keeps
(`hf_depthgrow.training.plan_memory`). Per arm and per device: parameters, gradients, AdamW state (two fp32
moments and the step's temporaries), activations (batch size x block size per device) and their total, and whether it
fits `--device-memory`. Not counted: the frozen-prefix cache, the CUDA context, the data. `--json` prints
the plans as JSON instead of the table.

Exit codes: 0 done; 2 bad input (one line on stderr; nothing is written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..config import ConfigParser, shared_field
from .common import run_command


@dataclass
class EstimateArguments:
    """What `hf-depthgrow estimate` plans: the model, the growth, the arms, the batch and the devices."""

    model: str = shared_field("model", more="Or a config.json file: only the config is read, never weights or code.")
    positions: list[int] | None = field(default=None, metadata={"help": "Insertion points k, 0 <= k <= L, or one preset: interleave:N or top:N."})
    placement: str | None = field(default=None, metadata={"help": "A preset (interleave:N, top:N): the YAML key for --positions PRESET."})
    trainable: list[str] = field(
        default_factory=lambda: ["new"], metadata={"help": "Arms to plan: new, new+lora, full (several allowed).", "choices": ["new", "new+lora", "full"]}
    )
    block_size: int = shared_field("block_size", 512, deprecated=["--seq"])
    batch_size: int = shared_field("batch_size", 1, more="One micro-batch.", deprecated=["--batch"])
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Plan with gradient checkpointing above the frozen prefix."})
    quantize: str | None = field(default=None, metadata={"help": "Frozen base in 4bit (NF4) or 8bit; new blocks stay at --dtype.", "choices": ["4bit", "8bit"]})
    dtype: str = shared_field("dtype", "float32", more="Activations too.")
    gpus: int = field(default=1, metadata={"help": "Devices the run is spread over (data parallel)."})
    zero: int | None = field(default=None, metadata={"help": "DeepSpeed ZeRO stage 1, 2 or 3 over --gpus.", "choices": [1, 2, 3]})
    fsdp: bool = field(default=False, metadata={"help": "FSDP full sharding over --gpus (as ZeRO-3)."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank of the new+lora arm."})
    device_memory: str | None = field(default=None, metadata={"help": "Memory per device, e.g. 80GiB, 80GB, 24g: says whether each arm fits."})
    json: bool = field(default=False, metadata={"help": "Print the plans as JSON."})


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _table(args: EstimateArguments, plans: list) -> str:
    first = plans[0]
    layout = f"{args.gpus} device(s)" + (f", ZeRO-{args.zero}" if args.zero else ", FSDP" if args.fsdp else ", DDP" if args.gpus > 1 else "")
    head = (f"{args.model} grown at {first.details['settings']['positions']}: {_count(first.parameters)} parameters; "
            f"per device batch {args.batch_size} x seq {args.block_size}, {args.dtype}" + (f", {args.quantize} base" if args.quantize else "")
            + (", gradient checkpointing" if args.gradient_checkpointing else "") + f"; {layout}")
    cols = ["arm", "trainable", "parameters", "gradients", "AdamW", "activations", "total"]
    if args.device_memory:
        cols.append(f"fits {_size(first.device_memory)}")
    rows = []
    for plan in plans:
        row = [plan.trainable, _count(plan.trainable_parameters), _size(plan.parameter_bytes), _size(plan.gradient_bytes),
               _size(plan.optimizer_bytes), _size(plan.activation_bytes), _size(plan.total_bytes)]
        if args.device_memory:
            row.append("yes" if plan.fits else "no")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [head, "", "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", "Not counted: the frozen-prefix cache, the CUDA context and allocator slack, the data."]
    return "\n".join(lines)


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow estimate`: one flag per `EstimateArguments` field, plus `--config`."""
    return ConfigParser([EstimateArguments], prog="hf-depthgrow estimate", description=__doc__)


def _estimate(argv: list[str]) -> int:
    from ..training.memory_plan import PlanSettings, load_config, parse_memory_size, plan_memory
    from .grow import _preset_flag

    (args,) = build_parser().parse(_preset_flag(argv))
    # Every input checked before the (seconds-long) planning: the size, the arms' settings, the positions.
    device_memory = parse_memory_size(args.device_memory) if args.device_memory is not None else None
    if (args.positions is None) == (args.placement is None):
        raise ValueError("give --positions (insertion points k, or a preset such as interleave:8)")
    if args.positions is not None and min(args.positions) < 0:
        raise ValueError(f"--positions must be ints >= 0, got {args.positions}")
    common = dict(positions=args.positions if args.positions is not None else args.placement, seq=args.block_size, batch=args.batch_size,
                  gradient_checkpointing=args.gradient_checkpointing, quantize=args.quantize, gpus=args.gpus, zero=args.zero,
                  fsdp=args.fsdp, dtype=args.dtype, lora_r=args.lora_r)
    settings = [PlanSettings(trainable=arm, **common) for arm in dict.fromkeys(args.trainable)]
    config = load_config(args.model)
    plans = [plan_memory(config, s, device_memory=device_memory) for s in settings]
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=2, default=str))
    else:
        print(_table(args, plans))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow estimate`; an input error is one line on stderr and exit code 2."""
    return run_command("estimate", _estimate, argv)


if __name__ == "__main__":
    raise SystemExit(main())
