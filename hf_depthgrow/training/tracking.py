"""Experiment tracking through Accelerate's trackers (TensorBoard, Weights & Biases), chosen by `report_to`.

Every run logs through `accelerate`: trackers are handed to the `Accelerator` (`log_with`), started
with `accelerator.init_trackers` and written with `accelerator.log`, so what works for an Accelerate
script works here (a tracker's own options, main-process-only writing under `accelerate launch`).
With `report_to="none"` (the default) no tracker is created and nothing is written.

One tracker *run* per model that trains (TensorBoard: a folder `<logging_dir>/<run_name>/`; W&B: a run
named `run_name` in the project `project_name`), so runs that share a logging folder show side by side:

- `train` / `GrownTrainer`, run `run_name` (default: the output_dir's folder name), step = optimizer step:
  `train/loss`, `train/learning_rate`, `train/grad_norm`, `train/tokens_per_s` (`examples_per_s` for
  classifiers) every `logging_steps`; `eval/loss` (held-out) at 0, every `eval_steps` and at the end;
  `selection/loss_new`, `selection/loss_old` (`selection/loss_stepping_stone`), `selection/delta_erm` and
  `eval/loss_selected` at the end.
- `hf-depthgrow run`: run `probe` (`probe/signal`, `probe/z`, step = the position k); run `grown`, shared
  with the trainer (its scalars, then `test/loss_old`, `test/loss_new`, `test/delta`, `test/mean_delta`,
  `test/<interval>_low` / `_high` at the last step); run `control` (the control's training).
- `compare_plans`: a run per arm and learning rate, `<arm>-lr<rate>-seed<seed>`; `probe-seed<seed>`;
  `compare-seed<seed>` with `compare/<arm>/test_loss`, `heldout_loss`, and the corrected
  `delta_vs_original` / `delta_vs_best_control` (each with `_low` / `_high`) at the last step.

The probe has a run of its own because W&B drops points logged at a step below one it has already
seen: the probe's positions (0..L) would otherwise collide with the training steps.

Example:
    ```python
    >>> from hf_depthgrow.training.tracking import tracking_run
    >>> tracking = tracking_run("tensorboard", logging_dir="runs/logs", run_name="probe")
    >>> tracking.log_probe(probe_result)  # probe/signal and probe/z, step = k
    >>> tracking.finish()
    ```
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from typing import Any, Mapping

REPORT_TO = ("tensorboard", "wandb")
NONE = "none"
DEFAULT_PROJECT = "hf_depthgrow"
# What `pip install` needs for each tracker (the messages name it).
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb>=0.19.10"}

__all__ = ["REPORT_TO", "Tracking", "NO_TRACKING", "active_trackers", "check_available", "check_logging_dir", "check_report_to",
           "log_probe_run", "make_accelerator", "make_trackers", "start_tracking", "trainer_tracking", "tracking_run"]


def check_report_to(value, name: str = "report_to") -> list[str]:
    """`value` as a list of tracker names (`["none"]` for none); a `ValueError` listing the valid names otherwise.

    Accepts `"none"` (or `None` or `[]`), one name, or a list of names.

    Example:
        ```python
        >>> check_report_to("tensorboard"), check_report_to(None), check_report_to(["wandb", "tensorboard"])
        (['tensorboard'], ['none'], ['wandb', 'tensorboard'])
        ```
    """
    names = [] if value is None else [value] if isinstance(value, str) else value
    valid = f"'{NONE}' or one or more of {', '.join(repr(n) for n in REPORT_TO)}"
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    names = list(dict.fromkeys(n.strip().lower() for n in names)) or [NONE]
    unknown = [n for n in names if n not in (NONE, *REPORT_TO)]
    if unknown:
        raise ValueError(f"{name}: unknown tracker {', '.join(repr(n) for n in unknown)}; valid: {valid} (a list for several)")
    if NONE in names and len(names) > 1:
        raise ValueError(f"{name}: '{NONE}' switches tracking off and cannot be combined with {[n for n in names if n != NONE]}")
    return names


def active_trackers(report_to) -> list[str]:
    """The tracker names `report_to` switches on (`[]` for none)."""
    return [n for n in check_report_to(report_to) if n != NONE]


def check_available(report_to) -> None:
    """Refuse, before any work, a tracker whose package is not installed (the message gives the pip command)."""
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    found = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}
    missing = [n for n in active_trackers(report_to) if not found[n]()]
    if "wandb" in active_trackers(report_to) and "wandb" not in missing:
        from importlib.metadata import version

        from packaging.version import Version

        if Version(version("wandb")) < Version("0.19.10"):  # reinit="create_new" (see make_trackers)
            raise ImportError(f"report_to='wandb' needs wandb>=0.19.10, found {version('wandb')}: pip install -U '{_PACKAGES['wandb']}'")
    if missing:
        pins = " ".join(f"'{_PACKAGES[n]}'" for n in missing)
        raise ImportError(f"report_to={missing} needs {', '.join(missing)}, which is not installed: pip install {pins}")


def check_logging_dir(report_to, logging_dir, missing: str = "logging_dir is not set") -> None:
    """TensorBoard writes files: refuse `report_to` with tensorboard but nowhere to write (`missing` says why)."""
    if "tensorboard" in active_trackers(report_to) and not logging_dir:
        raise ValueError(f"report_to='tensorboard' writes event files, but {missing}")


def run_label(text: str) -> str:
    """A run name usable as one folder name: characters other than letters, digits and `.,:=+-` become `_`."""
    return re.sub(r"[^\w.,:=+-]", "_", str(text)).strip("._") or "run"


def hparams(values: Mapping | None) -> dict:
    """A config as flat scalars for TensorBoard's hparams / W&B's config (lists and dicts as JSON, `None` as "none")."""
    out = {}
    for key, value in (values or {}).items():
        if isinstance(value, bool) or isinstance(value, (int, float, str)):
            out[key] = value
        elif value is None:
            out[key] = NONE
        else:
            out[key] = json.dumps(value, default=str)
    return out


def make_accelerator(mixed_precision: str | None = None, ddp_timeout: int = 1800):
    """The `Accelerator` the trainer makes when none is given (also what `hf-depthgrow run` shares with it).

    Accelerate keeps one `AcceleratorState` per process: a second `Accelerator(mixed_precision=None)` silently
    inherits the first one's bf16 autocast, and an explicit different value raises. A trainer's precision is
    its own setting, so a state left with another precision is reset first (the process group, held by
    `PartialState`, stays).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    wanted = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    left = AcceleratorState._shared_state.get("_mixed_precision")
    if left is not None and str(left) != str(wanted):
        AcceleratorState._reset_state(reset_partial_state=False)
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))]
    return Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)


def make_trackers(names, *, logging_dir, project_name: str, run_name: str, config: Mapping | None = None) -> list:
    """Accelerate tracker objects for `names`, not started (`init_trackers` starts them)."""
    from accelerate.tracking import TensorBoardTracker, WandBTracker

    trackers = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_label(run_name), logging_dir))
        elif name == "wandb":
            extra = {"dir": os.fspath(logging_dir)} if logging_dir else {}
            if logging_dir:
                os.makedirs(logging_dir, exist_ok=True)  # wandb falls back to a temp folder when `dir` is missing
            # A comparison keeps several runs open at once (its learning rates train in step): "create_new"
            # (wandb >= 0.19.10) starts each without finishing the others. The config goes in here because
            # accelerate's `store_init_configuration` writes to the process-global `wandb.config`.
            trackers.append(WandBTracker(project_name, name=run_label(run_name), reinit="create_new", config=hparams(config), **extra))
    return trackers


class Tracking:
    """The small logger of one tracker run; every method is a no-op when tracking is off (`NO_TRACKING`).

    Args:
        accelerator: The `Accelerator` whose trackers are written (`None`: tracking is off).
        owned: The trackers this object started, and finishes in `finish()`; trackers the caller started
            are written but left open.

    Example:
        ```python
        >>> tracking = tracking_run(["tensorboard"], logging_dir="logs", run_name="eval")
        >>> tracking.log_evaluation(eval_result, step=80)  # test/loss_old, test/loss_new, test/delta, intervals
        >>> tracking.finish()
        ```
    """

    def __init__(self, accelerator=None, owned: list | None = None):
        self.accelerator = accelerator
        self.owned = list(owned or [])

    @property
    def enabled(self) -> bool:
        return self.accelerator is not None

    def log(self, values: Mapping[str, Any], step: int) -> None:
        """`accelerator.log` of the numbers in `values` (`None` entries are left out; numpy/torch scalars converted)."""
        if not self.enabled:
            return
        clean = {k: float(v.item() if hasattr(v, "item") else v) for k, v in values.items() if v is not None and not isinstance(v, str)}
        clean.update({k: v for k, v in values.items() if isinstance(v, str)})
        if clean:
            self.accelerator.log(clean, step=int(step))

    def log_train(self, entry: Mapping, unit: str = "tokens") -> None:
        """One entry of the trainer's `history` (`step`, `loss`, `lr`, `grad_norm`, `<unit>_per_s`)."""
        self.log({"train/loss": entry["loss"], "train/learning_rate": entry.get("lr"), "train/grad_norm": entry.get("grad_norm"),
                  f"train/{unit}_per_s": entry.get(f"{unit}_per_s")}, entry["step"])

    def log_eval(self, step: int, loss: float) -> None:
        """The held-out loss at `step` (0: before training)."""
        self.log({"eval/loss": loss}, step)

    def log_result(self, result, step: int) -> None:
        """The end of training: the final held-out loss, the fallback rule's training losses, `Delta_ERM`, the selected model's loss."""
        losses = {f"selection/loss_{k}": v for k, v in (result.train_losses or {}).items()}
        self.log({"eval/loss": result.eval_loss_after, **losses, "selection/delta_erm": result.delta_erm,
                  "eval/loss_selected": result.eval_loss_selected}, step)

    def log_probe(self, probe) -> None:
        """The probe's per-position statistics, `probe/signal` and `probe/z`, with step = the position k."""
        if not self.enabled:
            return
        p = probe.to_dict() if hasattr(probe, "to_dict") else dict(probe)
        for i, k in enumerate(p.get("positions") or []):
            self.log({f"probe/{name}": p[name][i] for name in ("signal", "z") if p.get(name) is not None and i < len(p[name])}, k)

    def log_evaluation(self, evaluation, step: int, prefix: str = "test") -> None:
        """A paired evaluation (an `EvalResult` or a dict of it): losses, the delta and each interval's bounds."""
        if not self.enabled:
            return
        e = evaluation.to_dict() if hasattr(evaluation, "to_dict") else dict(evaluation)
        values = {f"{prefix}/{k}": e.get(k) for k in ("loss_old", "loss_new", "delta", "mean_delta")}
        for name, bounds in (e.get("intervals") or {}).items():
            if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
                values.update({f"{prefix}/{name}_low": bounds[0], f"{prefix}/{name}_high": bounds[1]})
        self.log(values, step)

    def log_comparison(self, result, step: int) -> None:
        """Per arm of a `CompareResult`: test loss and the corrected deltas against the original and the best control."""
        if not self.enabled:
            return
        stats = result.statistics
        for arm in result.arms:
            values = {f"compare/{arm.name}/test_loss": arm.test_loss, f"compare/{arm.name}/heldout_loss": arm.heldout_loss}
            for key, label in (("vs_original", "delta_vs_original"), ("vs_best_control", "delta_vs_best_control")):
                row = ((stats.get(key) or {}).get("arms") or {}).get(arm.name)
                if row:
                    values.update({f"compare/{arm.name}/{label}": row["mean"], f"compare/{arm.name}/{label}_low": row["low"],
                                   f"compare/{arm.name}/{label}_high": row["high"]})
            self.log(values, step)

    def finish(self) -> None:
        """Close the trackers this object started (not `accelerator.end_training()`: that also ends the process group)."""
        if self.accelerator is None:
            return
        for tracker in self.owned:
            tracker.finish()
            if tracker in self.accelerator.trackers:
                self.accelerator.trackers.remove(tracker)
            if tracker in self.accelerator.log_with:
                self.accelerator.log_with.remove(tracker)
        self.accelerator, self.owned = None, []


NO_TRACKING = Tracking()  # shared by every run with report_to="none": it holds nothing


def start_tracking(accelerator, report_to, *, logging_dir=None, project_name: str = DEFAULT_PROJECT,
                   run_name: str = "train", config: Mapping | None = None) -> Tracking:
    """Start a tracker run on `accelerator` (or write into the trackers its owner already started).

    Args:
        accelerator: An `accelerate.Accelerator`. If its trackers are started already (the caller called
            `init_trackers`), they are written and left open; else the `report_to` trackers are added to its
            `log_with` and started with `init_trackers`.
        report_to: `"none"`, `"tensorboard"`, `"wandb"` or a list (see `check_report_to`).
        logging_dir: Where TensorBoard (and W&B's local files) write.
        project_name: The W&B project.
        run_name: TensorBoard's run folder under `logging_dir`; the W&B run's name.
        config: Settings recorded with the run (TensorBoard hparams, W&B config).

    Returns:
        `Tracking` (`NO_TRACKING` when `report_to` is none: nothing is created).
    """
    names = active_trackers(report_to)
    if not names:
        return NO_TRACKING
    if accelerator.trackers:
        return Tracking(accelerator)
    check_available(names)
    check_logging_dir(names, logging_dir)
    trackers = make_trackers(names, logging_dir=logging_dir, project_name=project_name, run_name=run_name, config=config)
    accelerator.log_with.extend(trackers)
    accelerator.init_trackers(project_name)
    for tracker in trackers:
        if tracker.name == "tensorboard":
            tracker.store_init_configuration(hparams(config))
    return Tracking(accelerator, owned=trackers)


def tracking_run(report_to, **kwargs) -> Tracking:
    """A tracker run on a fresh `Accelerator` (as the trainer makes one) for callers that have none; see `start_tracking`."""
    if not active_trackers(report_to):
        return NO_TRACKING
    return start_tracking(make_accelerator(), report_to, **kwargs)


def trainer_tracking(trainer) -> Tracking:
    """The tracker run of a `GrownTrainer` from its `TrainConfig` (`report_to`, `logging_dir`, `project_name`, `run_name`)."""
    cfg = trainer.config
    return start_tracking(trainer.accelerator, cfg.report_to, logging_dir=cfg.resolved_logging_dir(), project_name=cfg.project_name,
                          run_name=cfg.resolved_run_name(), config=cfg.to_dict())


def log_probe_run(probe, report_to, **kwargs) -> None:
    """The probe's statistics as a run of their own (see the module docstring for why)."""
    tracking = tracking_run(report_to, **{"run_name": "probe", **kwargs})
    try:
        tracking.log_probe(probe)
    finally:
        tracking.finish()
