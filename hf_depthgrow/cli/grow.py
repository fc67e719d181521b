"""`hf-depthgrow grow MODEL --positions 15 --out DIR`: grow a saved model and save it.

The growth settings are `GrowthConfig`'s (`--block`, `--init`, `--eps`, `--seed`, `--adapter-dim`,
`--adapter-act`); `--config file.yaml` sets any option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..growth.engine import GrowthConfig
from .common import parse, record_dict, run_command


@dataclass
class GrowArguments:
    """What `hf-depthgrow grow` grows and where it saves it."""

    model: str = field(metadata={"help": "Local folder of a saved model, 'smollm2', or a Hub id.", "positional": True})
    positions: list[int] = field(metadata={"help": "Insertion points k, 0 <= k <= L."})
    out: str = field(metadata={"help": "Output folder (must be empty, or pass --overwrite)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty output folder."})


def _grow(argv: list[str]) -> int:
    from ..growth.engine import grow_depth
    from ..hub.loading import load_model
    from ..hub.serialization import save_pretrained

    args, config = parse("grow", argv, GrowArguments, GrowthConfig, description=__doc__)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    model, tokenizer = load_model(args.model)
    grow_depth(model, args.positions, config=config)
    save_pretrained(model, out, tokenizer=tokenizer)
    print(json.dumps(record_dict(model), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow grow`; an input error is one line on stderr and exit code 2."""
    return run_command("grow", _grow, argv)


if __name__ == "__main__":
    raise SystemExit(main())
