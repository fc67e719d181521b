"""What keeps a training run from losing or corrupting data: run fingerprints, the output-dir lock, finiteness.

- A run fingerprint (model identity, the starting base's weights, training data, training-relevant
  config) is stored in every checkpoint. A checkpoint is resumed only if its fingerprint matches, and a
  run prunes only checkpoints carrying its own fingerprint, so an older run's checkpoints are neither
  resumed nor deleted. Checkpoints hold the trainable set only (under FSDP every weight, sharded): the
  frozen base of a resumed run is the starting model's, hence the check of its weights.
- One trainer per `output_dir`: a lock file made with `O_CREAT | O_EXCL`, holding pid and host.
- A non-finite training loss stops the run (`NonFiniteTrainingLossError`).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ..utils import pid_alive
from .checkpoints import TRAINER_STATE, CheckpointMismatchError, check_state, list_checkpoints, stored_fingerprint, verify_digest
from .config import RESUME_MAY_CHANGE

LOCK_NAME = ".hf_depthgrow.lock"
FRESH_START = "use a fresh output_dir, or delete the old checkpoints yourself (hf_depthgrow never deletes what another run wrote)"


class NonFiniteTrainingLossError(ValueError):
    """Training produced a non-finite loss (or weights); `step` and `loss` name where."""

    def __init__(self, message: str, step: int | None = None, loss: float | None = None):
        super().__init__(message)
        self.step, self.loss = step, loss


class OutputDirLockedError(FileExistsError):
    """Another trainer holds the lock of this `output_dir`."""


# ------------------------------------------------------------------ run fingerprint


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_fingerprint(model) -> str:
    """Hash of the growth record, the config's architecture and every parameter's name, shape and dtype (not values: cheap)."""
    from ..growth.record import growth_record

    record = growth_record(model)
    cfg = getattr(model, "config", None)
    ident = {
        "record": record.to_dict() if record else None,
        "architectures": getattr(cfg, "architectures", None),
        "model_type": getattr(cfg, "model_type", None),
        "layers": getattr(cfg, "num_hidden_layers", None),
        "params": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
    }
    return _sha(ident)


def base_weights_fingerprint(model, samples: int = 256) -> str:
    """Hash of `samples` evenly spaced values of every parameter outside the new blocks, with its name and dtype.

    Those are the weights a resumed run takes from its starting model rather than from the checkpoint (which
    holds the trainable set only): another base of the same architecture (a different fine-tune, revision or
    seed) changes nearly every value, and is refused on resume instead of training on under the old
    checkpoint's new blocks. Sampled, not hashed whole: cheap for a 70B base. A tensor with no local values
    here (on the meta device, FSDP-sharded, ZeRO-3-partitioned) contributes its name and shape only.
    """
    from ..growth.engine import new_block_parameters

    new = {id(p) for _, p in new_block_parameters(model)}
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        if id(param) in new:
            continue
        value = param.detach()
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        if type(value).__name__ == "DTensor" or hasattr(param, "ds_id") or value.device.type == "meta" or value.numel() == 0:
            continue  # a shard or a placeholder: its values are not all here
        flat = value.as_subclass(torch.Tensor).reshape(-1)  # plain, also for a bitsandbytes parameter
        n, k = flat.numel(), min(samples, flat.numel())
        picks = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)  # in integers: exact for any size
        h.update(flat[picks.to(flat.device)].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def data_fingerprint(rows, samples: int = 16) -> dict:
    """Row count and a hash of up to `samples` evenly spaced rows (first and last included).

    Streamed rows give their own: a hash of every token, taken in the pass that checked the stream."""
    if getattr(rows, "streamed", False):
        return rows.fingerprint()
    n = len(rows)
    picks = sorted({round(i * (n - 1) / max(samples - 1, 1)) for i in range(min(samples, n))})
    h = hashlib.sha256()
    for i in picks:
        for key, value in sorted(rows[i].items()):
            arr = np.ascontiguousarray(value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value))
            h.update(f"{i}:{key}:{arr.dtype}:{arr.shape}".encode())
            h.update(arr.tobytes() if arr.dtype != object else repr(arr.tolist()).encode())
    return {"rows": n, "sha256": h.hexdigest()[:16]}


def run_fingerprint(model, rows, config) -> dict:
    """What identifies a run for resume and pruning: `{"model", "base", "data", "config"}` (config: training-relevant fields only)."""
    relevant = {k: v for k, v in config.to_dict().items() if k not in RESUME_MAY_CHANGE}
    return {"model": model_fingerprint(model), "base": base_weights_fingerprint(model), "data": data_fingerprint(rows), "config": relevant}


def fingerprint_differences(stored: dict | None, current: dict) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's, one phrase each ([] if they match)."""
    if not stored:
        return ["the checkpoint has no run fingerprint (written by another tool or an older version)"]
    diffs = []
    if stored.get("model") != current["model"]:
        diffs.append("the model differs (architecture, growth or parameter shapes)")
    elif "base" not in stored:
        diffs.append("the checkpoint records no hash of its base's weights (written by an older version), so the frozen base "
                     "a resume would pair with its trained blocks cannot be checked")
    elif stored["base"] != current["base"]:
        # Checkpoints hold the trainable set only: resuming would pair its new blocks with another frozen base.
        diffs.append("the starting model's weights differ (another base, fine-tune or revision of the same architecture: "
                     "the checkpoint's trained blocks belong to the base it was trained on)")
    if stored.get("data") != current["data"]:
        old, new = stored.get("data") or {}, current["data"]
        diffs.append(f"the training data differs (checkpoint: {old.get('rows')} rows, hash {old.get('sha256')}; "
                     f"this run: {new['rows']} rows, hash {new['sha256']})")
    old_cfg, new_cfg = stored.get("config") or {}, current["config"]
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(key) != new_cfg.get(key):
            diffs.append(f"{key}: checkpoint {old_cfg.get(key)!r}, this run {new_cfg.get(key)!r}")
    return diffs


def check_checkpoints(resume_path: Path | None, output_dir, fingerprint: dict, will_save: bool, max_steps: int | None = None) -> None:
    """Refuse a resume from another run's checkpoint or a damaged one, and a run that would write checkpoints beside another run's.

    Raises `CheckpointMismatchError` naming what differs and how to proceed, or `CheckpointIntegrityError` where the
    checkpoint's files do not match their digest or its trainer state contradicts itself or `max_steps`.
    """
    if resume_path is not None:
        diffs = fingerprint_differences(stored_fingerprint(resume_path), fingerprint)
        if diffs:
            raise CheckpointMismatchError(
                f"cannot resume from {resume_path}: it was written by a different run: {'; '.join(diffs)}. "
                f"Resume with the settings it was written with, or {FRESH_START}."
            )
        verify_digest(resume_path)  # here, before the run's set-up: a damaged checkpoint costs no cache build
        check_state(resume_path, json.loads((Path(resume_path) / TRAINER_STATE).read_text()), max_steps)
    if will_save and output_dir:
        foreign = [p.name for p in list_checkpoints(output_dir) if stored_fingerprint(p) != fingerprint]
        if foreign:
            raise CheckpointMismatchError(
                f"{output_dir} holds checkpoints of a different run ({', '.join(foreign[:4])}); writing this run's "
                f"checkpoints beside them would mix the two runs on resume: {FRESH_START}."
            )


def guard_output_dir(config, resume_path: Path | None, fingerprint: dict, accelerator) -> "OutputLock | None":
    """Lock `output_dir` and run `check_checkpoints` on the main process; every process raises the same error.

    Returns the held lock (or `None` without an output_dir / off the main process).
    """
    lock, error = None, None
    if accelerator.is_main_process:
        try:
            lock = OutputLock(config.output_dir).acquire() if config.output_dir else None
            check_checkpoints(resume_path, config.output_dir, fingerprint, will_save=bool(config.save_steps), max_steps=config.max_steps)
        except (OutputDirLockedError, CheckpointMismatchError) as err:
            error = err
            if lock is not None:
                lock.release()
    if accelerator.num_processes > 1:  # the others would otherwise wait at the next collective until ddp_timeout
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise error
    return lock


# ------------------------------------------------------------------ finiteness


def check_step(step: int, loss: float, grad_norm: float | None) -> None:
    """Raise `NonFiniteTrainingLossError` if a step's loss (or, without a grad scaler, its gradient norm) is not finite."""
    if not math.isfinite(loss):
        raise NonFiniteTrainingLossError(f"training diverged: the loss at step {step} is {loss}", step, loss)
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise NonFiniteTrainingLossError(
            f"training diverged: the gradient norm at step {step} is {grad_norm} (loss {loss})", step, loss
        )


def nonfinite_weights(named, accelerator) -> list[str]:
    """Names of trainable weights holding NaN/inf (every process must call it; one host sync)."""
    named = list(named)
    ok = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu().tolist() if named else []
    bad = [n for (n, _), good in zip(named, ok) if not good]
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(torch.tensor([float(len(bad))], device=accelerator.device), reduction="sum")
        if flag.item() and not bad:
            bad = ["(on another process)"]
    return bad


def nonfinite_stop(step: int, out: dict | None, *, named, accelerator, sharded: bool, fallback: bool) -> dict | None:
    """Check a step's loss and gradient norm (`out`), or with `out=None` the trainable weights.

    Non-finite: `NonFiniteTrainingLossError` (the last checkpoint stays, no model is written), or with
    the fallback rule on, a warning and `{"step", "loss"}`: training stops there and `f_new` is never
    selected. `None` if all is finite. The loss check costs no extra device sync (the step's loss is
    read on the host for logging anyway); the weight check is one sync per checkpoint and one at the end.
    The gradient norm is not checked under a grad scaler (fp16 skips overflowing steps by design),
    nor the weights under FSDP (sharded).
    """
    try:
        if out is not None:
            check_step(step, out["loss"], out["grad_norm"] if getattr(accelerator, "scaler", None) is None else None)
        elif not sharded and (bad := nonfinite_weights(named, accelerator)):
            raise NonFiniteTrainingLossError(
                f"training diverged: trainable weights are non-finite after step {step} ({', '.join(bad[:3])})", step
            )
    except NonFiniteTrainingLossError as err:
        if not fallback:
            raise
        warnings.warn(f"{err}; training stops here and the fallback rule selects among the other candidates")
        return {"step": step, "loss": err.loss}
    return None


# ------------------------------------------------------------------ the output-dir lock



class OutputLock:
    """`<output_dir>/.hf_depthgrow.lock`: one trainer per output_dir. Released by `release()` or at exit.

    Example:
        ```python
        >>> lock = OutputLock("out").acquire()
        >>> lock.release()
        ```
    """

    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_NAME
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump({**self.owner, "started": time.time()}, fh)
            self.held = True
            atexit.register(self.release)
            return self
        raise OutputDirLockedError(f"could not take the lock {self.path}")

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError):
            holder = None
        if holder is None and time.time() - self.path.stat().st_mtime < 10:
            holder = {"pid": "?", "host": "?"}  # being written right now
        stale = holder is None or (holder.get("host") == self.owner["host"] and isinstance(holder.get("pid"), int)
                                   and holder["pid"] != self.owner["pid"] and not pid_alive(holder["pid"]))
        if not stale:
            raise OutputDirLockedError(
                f"{self.path.parent} is in use by another hf_depthgrow run (pid {holder.get('pid')} on {holder.get('host')}): "
                f"two runs writing one output_dir would overwrite each other's checkpoints and model. Wait for it to "
                f"finish or use another output_dir; if that run is gone, delete {self.path}."
            )
        warnings.warn(f"taking over the stale lock {self.path} of a run that is gone ({holder})")
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
        try:  # a rename, not an unlink: of two runs taking over at once, only one succeeds
            os.replace(self.path, aside)
            os.unlink(aside)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:  # only our own lock: never delete another run's
            if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
