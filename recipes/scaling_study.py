"""Scaling study: depth x width x data on small normalized residual transformers (THEORY.md §8).

Default grid (a ViT on Fashion-MNIST and a character Llama on Shakespeare, both from scratch), two
CPU processes with one thread each:

    torchrun --nproc_per_node 2 recipes/scaling_study.py --config recipes/configs/scaling/default.yaml

Larger grid on GPUs (cells are spread over the processes, one model per device at a time; `torchrun
--nproc_per_node 8` does the same):

    accelerate launch --multi_gpu --num_processes 8 recipes/scaling_study.py --config recipes/configs/scaling/gpu_large.yaml

`python recipes/scaling_study.py --config ...` runs every cell in one process. Finished cells are kept
in `<output_dir>/cells/`, so a rerun only does what is missing; `--aggregate-only` redraws the figures
and tables from the cells on disk; `--overwrite` starts afresh.

Every model trains through `hf_depthgrow.training.train`, each process on its own (see
`hf_depthgrow/scaling/cells.py`), so the launcher only spreads cells; it never joins processes in DDP.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from hf_depthgrow.scaling import StudyConfig, run_study


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="Study YAML (recipes/configs/scaling/*.yaml).")
    parser.add_argument("--output-dir", help="Override the config's output_dir.")
    parser.add_argument("--aggregate-only", action="store_true", help="Only rebuild findings, fits, figures, tables.")
    parser.add_argument("--overwrite", action="store_true", help="Delete the output folder's cells first.")
    args = parser.parse_args(argv)

    data = StudyConfig.from_yaml(args.config).to_dict()
    if args.output_dir:
        data["output_dir"] = args.output_dir
    config = StudyConfig.from_dict(data)
    cells = Path(config.output_dir) / "cells"
    if args.overwrite:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            parser.error("--overwrite deletes finished cells: run it without a launcher (or delete the folder first)")
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
