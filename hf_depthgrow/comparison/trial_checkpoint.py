"""A trial's checkpoint: what it needs to continue after a budget (or rung) bit for bit as if never stopped.

`trial_steps(spec, inputs, checkpoint=..., resume=...)` takes one after every budget it scores and every rung
(`capture`), and continues from one (`TrialCheckpoint.restore`). It holds what `training.branching.BranchPoint`
holds of the trunk, which is everything a step reads: the trained parameters (not the frozen base: the trial
rebuilds that from the base model, as at its start), the optimizer's and the scheduler's state, the RNG
streams (Python, NumPy, torch), the step and units seen; the data order is indexed by the step. Beside them,
the trial's result so far (the budgets scored, the held-out curve) and how many of its events are done.

On disk a checkpoint is a folder like an evidence-cache entry: `tensors.safetensors` (parameters, optimizer
moments, RNG states), `entry.json` (everything else, strict JSON, with the trial store's key of its trial)
and `digest.json` (their sha256, written last): no pickle, and a damaged or half-written folder is never read.
A DDP trial's ranks hold the same state (one seed, all-reduced gradients): rank 0's checkpoint
continues every rank. Their RNG states stay equal while every rank draws as many random numbers (dropout on
shares of one shape, as compare's fixed-length blocks are); otherwise a resumed rank continues with rank 0's, a
valid run but not bit for bit the uninterrupted one. Sharded trials (FSDP, DeepSpeed) take none: each rank holds
a part; they rerun.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..storage import ENTRY_FILE, TENSORS_FILE, read_verified, write_digest
from .trial_record import rebuild_result, result_entry

__all__ = ["TrialCheckpoint", "capture"]

FORMAT = 2  # 2: the header carries the trial's store key
_PARAM, _OPTIM, _RNG = "param.", "optim.", "rng."


@dataclass
class TrialCheckpoint:
    """A trial after `events_done` of its events (`step` optimizer steps on its trunk); see the module docstring.

    Example:
        ```python
        >>> saved = []
        >>> result = run_trial(spec, inputs, checkpoint=saved.append)       # one per budget (and rung) but the last
        >>> run_trial(spec, inputs, resume=saved[-1]).scores == result.scores  # the rest only, the same numbers
        True
        ```
    """

    name: str
    events_done: int
    step: int
    tensors: dict = field(repr=False)
    state: dict = field(repr=False)
    key: str | None = None  # the trial store's key of its trial (model, data, settings, spec): checked on resume

    # ------------------------------------------------------------------ into a trainer

    @torch.no_grad()
    def restore(self, trainer, result) -> None:
        """Put a freshly begun trainer (`trainer.begin()` ran) and an empty result where this checkpoint was taken."""
        from ..training.checkpoints import set_rng_state

        named = dict(trainer.trainable_named)
        saved = {k[len(_PARAM) :] for k in self.tensors if k.startswith(_PARAM)}
        if saved != set(named):
            raise ValueError(f"checkpoint of {self.name}: its parameters are not this trial's trainable set ({sorted(saved ^ set(named))[:3]})")
        for name, p in named.items():
            p.copy_(self.tensors[_PARAM + name].to(p.device, p.dtype))
        s = self.state
        trainer.optimizer.load_state_dict({"state": _optimizer_state(self.tensors, s["optimizer_scalars"]), "param_groups": s["param_groups"]})
        trainer.scheduler.load_state_dict(s["scheduler"])  # the trunk's rate factors stay those the set-up built
        rng = {k[len(_RNG) :]: v for k, v in self.tensors.items() if k.startswith(_RNG) and not k.startswith(_RNG + "cuda.")}
        # In device order: by name, rng.cuda.10 would come before rng.cuda.2.
        cuda = [v for _, v in sorted((int(k.rpartition(".")[2]), v) for k, v in self.tensors.items() if k.startswith(_RNG + "cuda."))]
        set_rng_state({**rng, **s["rng"], **({"cuda": cuda} if cuda else {})})
        trainer._step, trainer.units_seen = self.step, s["units_seen"]
        scores = {k[len("score.") :]: v for k, v in self.tensors.items() if k.startswith("score.")}
        partial = rebuild_result(result.spec, s["result"], scores, partial=True)
        result.scores, result.heldout_curve, result.trainable_parameters = partial.scores, partial.heldout_curve, partial.trainable_parameters

    @property
    def seconds(self) -> float:
        """The trial's seconds up to this checkpoint (a resumed trial counts them too)."""
        return float(self.state["seconds"])

    # ------------------------------------------------------------------ on disk

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the checkpoint into `folder` (created; written in a temporary folder beside it, then renamed)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}, str(tmp / TENSORS_FILE))
            header = {"format": FORMAT, "name": self.name, "key": self.key, "events_done": self.events_done, "step": self.step,
                      "state": self.state}
            (tmp / ENTRY_FILE).write_text(json.dumps(header, allow_nan=False, sort_keys=True), encoding="utf-8")
            write_digest(tmp)  # last: a folder with a valid digest holds every file it lists
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "TrialCheckpoint":
        """Read a checkpoint `save` wrote, its files checked against their digest (`ValueError` if not whole)."""
        from safetensors.torch import load as load_bytes

        files = read_verified(folder)  # UnverifiedEntryError is a ValueError
        header = json.loads(files[ENTRY_FILE].decode("utf-8"))
        if header.get("format") != FORMAT or TENSORS_FILE not in files:
            raise ValueError(f"{folder} is not a trial checkpoint of this version (format {header.get('format')!r})")
        return cls(header["name"], int(header["events_done"]), int(header["step"]), load_bytes(files[TENSORS_FILE]), header["state"],
                   header.get("key"))


def capture(trainer, result, events_done: int, seconds: float) -> TrialCheckpoint | None:
    """The trial now, on its trunk after `events_done` events; `None` where it cannot be taken (see the module docstring)."""
    from ..training.checkpoints import rng_state

    if getattr(trainer, "sharded", False) or trainer.stopped or trainer.nonfinite is not None:
        return None  # sharded: each rank holds a part of the state; a diverged trunk: the rerun is as short
    tensors = {_PARAM + n: p.detach().cpu().clone() for n, p in trainer.trainable_named}
    optimizer = trainer.optimizer.state_dict()
    scalars = {}
    for index, per_param in optimizer["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{_OPTIM}{index}.{key}"] = value.detach().cpu().clone()
            else:
                scalars[f"{index}.{key}"] = value
    rng = rng_state()
    tensors.update({_RNG + k: v.clone() for k, v in rng.items() if torch.is_tensor(v)})
    meta, scores = result_entry(result)
    tensors.update({"score." + k: v for k, v in scores.items()})
    state = {
        "units_seen": trainer.units_seen, "seconds": seconds, "param_groups": optimizer["param_groups"], "optimizer_scalars": scalars,
        "scheduler": trainer.scheduler.state_dict(), "rng": {k: v for k, v in rng.items() if not torch.is_tensor(v) and k != "cuda"},
        "result": meta,
    }
    if "cuda" in rng:
        tensors.update({f"{_RNG}cuda.{i}": t for i, t in enumerate(rng["cuda"])})
    return TrialCheckpoint(result.spec.name, events_done, trainer._step, tensors, json.loads(json.dumps(state)))


def _optimizer_state(tensors: dict, scalars: dict) -> dict:
    # Cloned: the optimizer updates its moments in place.
    moments = [(k[len(_OPTIM) :], v.clone()) for k, v in tensors.items() if k.startswith(_OPTIM)]
    state: dict = {}
    for key, value in moments + list(scalars.items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return state
