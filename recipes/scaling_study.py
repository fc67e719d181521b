"""Scaling study: depth x width x data on small normalized residual transformers (docs/theory.md §8).

Default grid (a ViT on Fashion-MNIST and a character Llama on Shakespeare, both from scratch), two
CPU processes with one thread each:

    torchrun --nproc_per_node 2 recipes/scaling_study.py --config recipes/configs/scaling/default.yaml

Larger grid on GPUs (cells are spread over the processes, one model per device at a time; `torchrun
--nproc_per_node 8` does the same):

    accelerate launch --multi_gpu --num_processes 8 recipes/scaling_study.py --config recipes/configs/scaling/gpu_large.yaml

`python recipes/scaling_study.py --config ...` runs every cell in one process. On Ray (`pip install
"hf_depthgrow[ray]"`), each cell a Ray Tune trial, with the same results as the serial engine (one process,
no launcher; a local Ray, or a cluster with `--ray-address`):

    python recipes/scaling_study.py --config recipes/configs/scaling/default.yaml --engine ray --max-concurrent-trials 2

Finished cells are kept (verified before reuse) in `<output_dir>/cells/`, so a rerun only does what is missing;
`--aggregate-only` redraws the figures and tables from the cells on disk; `--overwrite` starts afresh. Flags
override the YAML's values (`--help` lists them). Bad input is one line on stderr, exit code 2, nothing written.

Every model trains through `hf_depthgrow.training.train`, each process on its own (see
`hf_depthgrow/scaling/cells.py`), so the launcher only spreads cells; it never joins processes in DDP.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from hf_depthgrow.config import ConfigParser
from hf_depthgrow.scaling import StudyCommand, run_study

# What a person typed or pointed at (a flag, the YAML, Ray's settings): one line, exit code 2, no traceback.
INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except INPUT_ERRORS as err:
        if os.environ.get("HF_DEPTHGROW_TRACEBACK", "").lower() in ("1", "true", "yes"):
            raise
        print(f"scaling_study.py: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = ConfigParser([StudyCommand], config_flag=False, prog="scaling_study.py", description=__doc__)
    (args,) = parser.parse(argv)
    config = args.study_config()
    cells = Path(config.output_dir) / "cells"
    if args.overwrite:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ValueError("--overwrite deletes finished cells: run it without a launcher (or delete the folder first)")
        if cells.exists():
            shutil.rmtree(cells)
    os.environ.setdefault("HF_DEPTHGROW_STUDY_COMMAND", _command(argv))
    summary = run_study(config, only_aggregate=args.aggregate_only)
    if summary:
        print((Path(config.output_dir) / "RESULTS.md").read_text().split("## Power-law")[0])
        print(f"results: {Path(config.output_dir) / 'RESULTS.md'}")
    return 0


def _command(argv) -> str:
    args = sys.argv[1:] if argv is None else argv
    n = os.environ.get("WORLD_SIZE", "1")
    prefix = f"torchrun --nproc_per_node {n} " if n != "1" else "python "
    return prefix + "recipes/scaling_study.py " + " ".join(shlex.quote(a) for a in args)


if __name__ == "__main__":
    sys.exit(main())
