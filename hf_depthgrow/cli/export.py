"""`hf-depthgrow export-gguf --model FOLDER --output FILE --gguf-type f16`: write a grown model as a llama.cpp GGUF.

    hf-depthgrow export-gguf --model out/grown --output out/grown.f16.gguf --gguf-type f16
    hf-depthgrow export-gguf --model out/grown --output out/grown.q4_1.gguf --gguf-type source --source-gguf smollm2

The model must be natively grown (`--block native`, or `auto` on a pre-norm family) or not grown at all;
adapter blocks have no llama.cpp form and are refused. `--source-gguf` names the GGUF the original came from
(`smollm2` is the embedded SmolLM2 file): its tokenizer metadata and licence are copied, and `--gguf-type source`
keeps its tensor types (SmolLM2: Q4_1, token embedding Q8_0). Without it the vocabulary is built from the
folder's tokenizer (byte-level BPE). `--dtype` is the torch dtype the model loads in, as in every command.
Bad input is one line on stderr, exit code 2, and nothing is written.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TORCH_DTYPES, ConfigParser, FlagDeprecation, shared_field
from .common import dtype_of, run_command

# The tensor types `hf_depthgrow.hub.gguf_export.export_gguf` writes (kept here: --help imports no torch).
GGUF_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "source"]


@dataclass
class ExportArguments:
    """Settings of `hf-depthgrow export-gguf`."""

    model: str = shared_field("model", more="Natively grown or not grown.")
    output: str = field(metadata={"help": "The GGUF file to write (ends in .gguf; its folder must exist)."})
    gguf_type: str = field(default="f16", metadata={"help": "GGUF tensor type; 'source' keeps the --source-gguf types.", "choices": GGUF_TYPES})
    source_gguf: str | None = field(default=None, metadata={"help": "The GGUF the original came from ('smollm2': the embedded file)."})
    name: str | None = field(default=None, metadata={"help": "general.name in the file; none: the source's name + ' (depth-grown)'."})
    overwrite: bool = shared_field("overwrite", False, more="Here: an existing --output file is replaced.")
    trust_remote_code: bool = shared_field("trust_remote_code", False)
    # No `choices`: a GGUF type given here (the flag's meaning before --gguf-type) is moved there, with a warning.
    dtype: str = shared_field("dtype", "float32", more="Before the conversion.", choices=None, deprecated=["--load-dtype"])

    def __post_init__(self):
        if self.dtype in GGUF_TYPES:
            if self.gguf_type != "f16":
                raise ValueError(f"dtype {self.dtype!r} is a GGUF tensor type and gguf_type is {self.gguf_type!r}: give the GGUF type once")
            warnings.warn(f"--dtype {self.dtype} (a GGUF tensor type) is deprecated, use --gguf-type {self.dtype}", FlagDeprecation, stacklevel=3)
            self.gguf_type, self.dtype = self.dtype, "float32"
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)} (or a GGUF tensor type for --gguf-type), got {self.dtype!r}")


def _source_path(args: ExportArguments) -> str | None:
    # The embedded model is the float copy of its GGUF: without --source-gguf, that file is its source.
    given = args.source_gguf if args.source_gguf is not None else ("smollm2" if args.model == "smollm2" else None)
    if given == "smollm2":
        from ..data.models import smollm2_gguf_path

        return str(smollm2_gguf_path())
    if given is not None and not Path(given).is_file():
        raise FileNotFoundError(f"no such --source-gguf file: {given}")
    return given


def _check_output(args: ExportArguments) -> None:
    # The same rules export_gguf applies, checked before the (slow) model load.
    output = Path(args.output)
    if output.suffix != ".gguf":
        raise ValueError(f"--output must end in .gguf, got {args.output!r}")
    if output.is_dir() or (output.exists() and not args.overwrite):
        raise FileExistsError(f"--output {args.output} already exists (pass --overwrite to replace a file)")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"no such folder for --output: {output.parent}")


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow export-gguf`: one flag per `ExportArguments` field, plus `--config`."""
    return ConfigParser([ExportArguments], prog="hf-depthgrow export-gguf", description=__doc__)


def _export(argv: list[str]) -> int:
    parser = build_parser()
    (args,) = parser.parse(argv)  # first: --help imports no torch
    from ..hub.gguf_export import export_gguf
    from ..hub.loading import check_model_source, load_model

    check_model_source(args.model)
    _check_output(args)
    if args.gguf_type == "source" and args.source_gguf is None and args.model != "smollm2":
        raise ValueError("--gguf-type source keeps the source GGUF's tensor types: pass --source-gguf")
    source = _source_path(args)
    model, tokenizer = load_model(args.model, dtype=dtype_of(args.dtype), trust_remote_code=args.trust_remote_code)
    try:
        path = export_gguf(model, tokenizer, args.output, dtype=args.gguf_type, source_gguf=source, name=args.name, overwrite=args.overwrite)
    except ValueError as err:  # the library names its arguments (`source_gguf=`, `dtype=`); here they are this command's flags
        raise ValueError(parser.flagged(re.sub(r"\bdtype\b", "gguf_type", str(err)))) from None
    info = {"output": str(path), "bytes": path.stat().st_size, "gguf_type": args.gguf_type, "block_count": model.config.num_hidden_layers}
    print(json.dumps(info, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow export-gguf`; an input error is one line on stderr and exit code 2."""
    return run_command("export-gguf", _export, argv)


if __name__ == "__main__":
    raise SystemExit(main())
