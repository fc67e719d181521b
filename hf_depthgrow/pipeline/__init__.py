"""The whole job in one call: probe -> grow -> stepping stones -> train -> select -> evaluate -> control -> report -> save.

`run_pipeline(RunConfig())` runs the embedded default offline (SmolLM2-135M on Shakespeare)
and writes everything a person wants to read or reuse into `output_dir`:

    config.yaml            the resolved configuration (feed it back with --config)
    summary.md / .json     where it grew and why, losses, delta with interval, verdict, artifacts
    probe/                 probe.json and the signal plot
    stepping_stones.json   f~_S (train direction) and f~_pop (held-out direction)
    train/                 train_result.json and the loss curve
    control/               the equal-budget control's training record (RunConfig.control; none: absent)
    eval/                  report.json, report.md and plots; control/ (grown vs control), retention.json
    model/                 the selected model (safetensors), tokenizer, README.md model card, report
"""

from ..hub.loading import HubUnreachable
from .config import RunConfig
from .output import MARKER, check_output_dir, claim_output_dir, record_outputs, staged_output
from .stages import PushFailed, RunResult, run_pipeline
from .summary import summary_markdown

__all__ = [
    "MARKER", "HubUnreachable", "PushFailed", "RunConfig", "RunResult", "check_output_dir", "claim_output_dir", "record_outputs",
    "run_pipeline", "staged_output", "summary_markdown",
]
