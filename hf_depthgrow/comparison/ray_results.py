"""What travels between a Ray trial and the driver: a trial's result as JSON (`pack`/`unpack`, bit for bit), and the
driver's Tune callback (`collector`) that decodes, stores and counts each result as it arrives and keeps each
trial's latest checkpoint beside the stored trials for `compare --resume`.

`ray_engine` schedules the trials; `ray_workers` packs a multi-process trial's result the same way.
"""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import torch

from .trial import TrialResult, TrialSpec

__all__ = ["collector", "pack", "unpack"]

logger = logging.getLogger("hf_depthgrow.comparison.ray_engine")  # the engine's messages, under the name users configure


def collector(specs, store, bar):
    """A Tune callback on the driver: each trial's result decoded, stored and counted as it arrives."""
    from ray.tune import Callback

    class Collect(Callback):
        def __init__(self):
            self.results: dict[str, TrialResult] = {}
            self.checkpointed: dict[str, int] = {}  # the step of each trial's latest checkpoint

        def on_trial_recover(self, iteration, trials, trial, **info):
            spec = specs[trial.config["index"]]
            step = self.checkpointed.get(spec.name)
            where = f"its checkpoint at step {step}" if step is not None else "its start"
            warnings.warn(f"trial {spec.name} failed ({trial.num_failures} time(s)): Ray runs it again from {where}", stacklevel=2)

        def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
            spec = specs[trial.config["index"]]
            if store is None or spec.name in self.results:
                return
            from .trial_checkpoint import TrialCheckpoint

            try:  # kept beside the stored trials, for --resume; a failure here must not stop Tune registering it
                with checkpoint.as_directory() as folder:
                    store.save_checkpoint(spec, TrialCheckpoint.load(folder))
            except Exception as err:  # noqa: BLE001
                warnings.warn(f"trial {spec.name}: its checkpoint was not kept under {store.root} ({err}); --resume would start it over", stacklevel=2)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            spec = specs[trial.config["index"]]
            if result.get("checkpoint_step") is not None:
                self.checkpointed[spec.name] = result["checkpoint_step"]
            if "trial" not in result or spec.name in self.results:
                return
            done = self.results[spec.name] = unpack(spec, result["trial"])
            if result.get("resumed_from"):
                logger.info("trial %s continued from its checkpoint at step %d", spec.name, result["resumed_from"])
            if store is not None and store.save(done) is not None:  # one it could not write keeps its checkpoint
                store.drop_checkpoints(spec)
            if bar is not None:
                bar.set_postfix_str(spec.name)
                bar.update(1)

    return Collect()


def pack(result: TrialResult) -> str:
    """The result as JSON: floats written by `repr` read back bit for bit, `NaN`/`Infinity` included."""
    scores = {}
    for b, s in result.scores.items():
        arrays = {n: None if getattr(s, n) is None else np.asarray(getattr(s, n), dtype=np.float64).tolist()
                  for n in ("test", "test_weight", "retention", "retention_weight")}  # fmt: skip
        scores[str(b)] = {"units_seen": s.units_seen, "heldout_loss": s.heldout_loss, "selected": s.selected,
                          "train_losses": s.train_losses, "seconds": s.seconds, "arrays": arrays}  # fmt: skip
    return json.dumps({"stopped_at": result.stopped_at, "trainable_parameters": result.trainable_parameters, "seconds": result.seconds,
                       "heldout_curve": [[int(s), float(v)] for s, v in result.heldout_curve], "scores": scores}, default=float)  # fmt: skip


def unpack(spec: TrialSpec, text: str) -> TrialResult:
    from .store import _rebuild

    meta = json.loads(text)
    tensors = {}
    for b, s in meta["scores"].items():
        for name, values in s.pop("arrays").items():
            if values is not None:
                tensors[f"{b}.{name}"] = torch.tensor(values, dtype=torch.float64)
    return _rebuild(spec, meta, tensors)
