"""`hf-depthgrow grow MODEL --positions 15 --out DIR`: grow a saved model and save it.

The growth settings are `GrowthConfig`'s (`--block`, `--init`, `--eps`, `--seed`, `--adapter-dim`,
`--adapter-act`); `--config file.yaml` sets any option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..growth.engine import GrowthConfig
from .common import parse, record_dict, run_command


@dataclass
class GrowArguments:
    """What `hf-depthgrow grow` grows and where it saves it."""

    model: str = field(metadata={"help": "Local folder of a saved model, 'smollm2', or a Hub id.", "positional": True})
    positions: list[int] = field(metadata={"help": "Insertion points k, 0 <= k <= L."})
    out: str = field(metadata={"help": "Output folder (must be empty, or pass --overwrite)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty output folder written by hf-depthgrow."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run Python code shipped with the model (off unless given)."})


def _grow(argv: list[str]) -> int:
    from ..growth.engine import grow_depth
    from ..hub.loading import check_model_source, load_model
    from ..hub.serialization import save_pretrained
    from ..pipeline.output import check_output_dir, staged_output

    args, config = parse("grow", argv, GrowArguments, GrowthConfig, description=__doc__)
    # Everything cheap first: nothing loads and nothing on disk changes until the inputs are known good.
    if not args.positions or min(args.positions) < 0:
        raise ValueError(f"--positions must be ints >= 0, got {args.positions}")
    check_model_source(args.model)
    check_output_dir(args.out, overwrite=args.overwrite, inputs={"model": args.model})
    model, tokenizer = load_model(args.model, trust_remote_code=args.trust_remote_code)
    grow_depth(model, args.positions, config=config)
    with staged_output(args.out) as tmp:  # the old folder is replaced only once the new one is saved
        save_pretrained(model, tmp, tokenizer=tokenizer)
    print(json.dumps(record_dict(model), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow grow`; an input error is one line on stderr and exit code 2."""
    return run_command("grow", _grow, argv)


if __name__ == "__main__":
    raise SystemExit(main())
