"""`hf-depthgrow <command>`: one entry point; each command lives in `hf_depthgrow/cli/<name>.py`.

Commands are imported only when called, so `hf-depthgrow --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "probe -> grow -> train -> select -> evaluate -> report -> save (the whole job)",
    "demo": "grow the embedded SmolLM2-135M at a middle layer and show that it is exact",
    "grow": "grow a saved model at given positions and save it",
    "probe": "first-order signal at every position: where a new block can help",
    "train": "train the new blocks of a grown model with Accelerate",
    "eval": "paired test-risk delta of a grown model against its original, with intervals",
    "compare": "growth plans against equal-budget controls (and the probe against realized gains)",
    "export-gguf": "write a natively grown decoder as a llama.cpp GGUF file (f32, f16, q8_0, q4_1, ... or the source's types)",
    "estimate": "memory per device of training a grown model (parameters, gradients, AdamW, activations), from its config",
}
# A command whose module is named otherwise: a dash is not allowed in a Python module name.
MODULES = {"export-gguf": "export"}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hf-depthgrow <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, help_ in COMMANDS.items()]
    lines += ["", "`hf-depthgrow <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"hf_depthgrow {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hf-depthgrow: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"hf_depthgrow.cli.{MODULES.get(name, name)}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
