"""`hf-depthgrow grow --model MODEL --positions 15 --output-dir DIR`: grow a saved model and save it.

Where: `--positions 3 7` (explicit), `--positions interleave:8` or `top:2` (a preset; in YAML the
key `placement:`), or `--plan plan.yaml` (a plan or a mergekit passthrough config). The growth
settings are `GrowthConfig`'s (`--block`, `--init`, `--eps`, `--growth-seed`, `--adapter-dim`,
`--adapter-act`); `--config file.yaml` sets any option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..config import ConfigParser, shared_field
from ..growth.config import GrowthConfig
from .common import record_dict, run_command


@dataclass
class GrowArguments:
    """What `hf-depthgrow grow` grows and where it saves it."""

    model: str = shared_field("model", deprecated_positional=True)
    output_dir: str = shared_field("output_dir", more="The grown model is saved here.", deprecated=["--out"])
    positions: list[int] | None = field(default=None, metadata={"help": "Insertion points k, 0 <= k <= L, or one preset: interleave:N or top:N."})
    placement: str | None = field(default=None, metadata={"help": "A preset (interleave:N, top:N): the YAML key for --positions PRESET."})
    plan: str | None = field(default=None, metadata={"help": "YAML file: a plan ({plan: [{at: k, copy_from: j}]}) or a mergekit passthrough config."})
    overwrite: bool = shared_field("overwrite", False)
    trust_remote_code: bool = shared_field("trust_remote_code", False)


def _grow(argv: list[str]) -> int:
    from ..growth.engine import grow_depth
    from ..hub.loading import check_model_source, load_model
    from ..hub.serialization import save_pretrained
    from ..pipeline.output import check_output_dir, staged_output

    args, config = build_parser().parse(_preset_flag(argv))
    # Everything cheap first: nothing loads and nothing on disk changes until the inputs are known good.
    spec = _placement(args)
    check_model_source(args.model)
    check_output_dir(args.output_dir, overwrite=args.overwrite, inputs={"model": args.model})
    model, tokenizer = load_model(args.model, trust_remote_code=args.trust_remote_code)
    grow_depth(model, spec, config=config)
    with staged_output(args.output_dir) as tmp:  # the old folder is replaced only once the new one is saved
        save_pretrained(model, tmp, tokenizer=tokenizer)
    print(json.dumps(record_dict(model), indent=2))
    return 0


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow grow`: `GrowArguments` and `GrowthConfig`, plus `--config`."""
    return ConfigParser([GrowArguments, GrowthConfig], prog="hf-depthgrow grow", description=__doc__)


def _preset_flag(argv: list[str]) -> list[str]:
    # `--positions interleave:8` reads naturally, but the flag holds ints (hf_depthgrow.config has no
    # list-or-string type): a preset given there is passed on as --placement.
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token == "--positions" and ":" in out[i + 1]:
            out[i] = "--placement"
    for i, token in enumerate(out):
        if token.startswith("--positions=") and ":" in token:
            out[i] = "--placement=" + token.split("=", 1)[1]
    return out


def _placement(args: GrowArguments):
    given = {name: value for name, value in (("--positions", args.positions), ("--placement", args.placement), ("--plan", args.plan)) if value}
    if len(given) != 1:
        raise ValueError(f"give exactly one of --positions, --plan (or placement: in --config), got {sorted(given) or 'none'}")
    if args.positions is not None and min(args.positions) < 0:
        raise ValueError(f"--positions must be ints >= 0, got {args.positions}")
    from ..growth.placement import check_placement, load_plan

    # Checked (and a plan file read) now: a bad spec fails before the model loads.
    if args.plan is not None:
        return load_plan(args.plan)
    return check_placement(args.placement) if args.placement is not None else args.positions


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow grow`; an input error is one line on stderr and exit code 2."""
    return run_command("grow", _grow, argv)


if __name__ == "__main__":
    raise SystemExit(main())
