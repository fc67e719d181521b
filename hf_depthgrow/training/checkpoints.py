"""Atomic checkpoints: the trainable weights, optimizer, scheduler, RNG streams and trainer state.

A checkpoint is written to `.checkpoint-{step}.tmp` and published with one `os.replace`, so a crash
mid-save leaves either the old set of checkpoints or the new one, never half a folder. Only the
trainable set is saved (the frozen weights are the starting model's). Under FSDP and DeepSpeed
accelerate writes the state (`save_state`: sharded files, or the DeepSpeed engine's checkpoint of
the trainable set and its partitioned optimizer state) into the same temp folder.

A checkpoint is resumed only if it is consistent with itself: `digest.json`, written last at save, holds
the sha256 of every other file and is checked before the run's set-up (`verify_digest`); `global_step` must
match the folder's name, lie within `max_steps` and agree with the micro-batch count, the history, and the
step counts of the scheduler and the optimizer (`check_state`, `check_counts`). Anything else is refused
with `CheckpointIntegrityError`, one line naming what contradicts what, before a weight is touched (sharded:
the scheduler's count is checked once the engine has loaded its state).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .deepspeed_support import LOAD_KWARGS, SAVE_KWARGS

CHECKPOINT_PREFIX = "checkpoint-"
TRAINABLE_WEIGHTS = "trainable.safetensors"
TRAINER_STATE = "trainer_state.json"
DIGEST = "digest.json"


class CheckpointMismatchError(ValueError):
    """A checkpoint in the way was written by a different run (model, data or training config)."""


class CheckpointIntegrityError(CheckpointMismatchError):
    """A checkpoint that contradicts its digest (edited or damaged files) or itself (step counts that disagree)."""


def stored_fingerprint(checkpoint: Path) -> dict | None:
    """The run fingerprint a checkpoint was written with (`None`: none, or unreadable)."""
    try:
        return json.loads((Path(checkpoint) / TRAINER_STATE).read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `output_dir`, oldest first (temp folders of a crashed save are ignored).

    Example:
        ```python
        >>> [p.name for p in list_checkpoints("out")]
        ['checkpoint-4', 'checkpoint-5']
        ```
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", path.name)
        if m and path.is_dir() and (path / TRAINER_STATE).exists():
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states as tensors and numbers (loadable with `weights_only`)."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python_version": py[0],
        "python": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": py[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _engine_kwargs(acc, kwargs: dict) -> dict:
    """`kwargs` for the DeepSpeed engine's `save_checkpoint`/`load_checkpoint` under DeepSpeed, else none."""
    return kwargs if acc.distributed_type == "DEEPSPEED" else {}


def _write_unsharded(acc, tmp: Path, step: int, named, optimizer, scheduler) -> None:
    from safetensors.torch import save_file

    weights = {n: p.detach().cpu().contiguous() for n, p in named}
    save_file(weights, str(tmp / TRAINABLE_WEIGHTS), metadata={"format": "pt", "step": str(step)})
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    if getattr(acc, "scaler", None) is not None:
        torch.save(acc.scaler.state_dict(), tmp / "scaler.pt")


def _publish(tmp: Path, final: Path, root: Path, save_total_limit: int | None, fingerprint: dict | None) -> None:
    """fsync the temp folder's files, swap it in with `os.replace`, fsync the parent, prune old ones."""
    for file in tmp.rglob("*"):
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():  # a resumed run re-saving a step: move the old one out of the way first
        aside = root / f".{final.name}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    with contextlib.suppress(OSError):
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if save_total_limit:
        # Only this run's checkpoints (same fingerprint) count and are pruned: never another run's.
        ours = [p for p in list_checkpoints(root) if fingerprint is not None and stored_fingerprint(p) == fingerprint]
        for old in ours[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    accelerator, root: str | os.PathLike, step: int, *, sharded: bool, named: Sequence, optimizer, scheduler,
    trainer_state: dict, save_total_limit: int | None = None,
) -> Path:
    """Write `<root>/checkpoint-{step}` atomically: everything goes to a temp folder, then one `os.replace`.

    Every process must call it (it synchronises); `trainer_state` is written as `trainer_state.json`.
    `save_total_limit` prunes only checkpoints whose fingerprint equals `trainer_state["fingerprint"]`.

    Example:
        ```python
        >>> save_checkpoint(acc, "out", 4, sharded=False, named=named, optimizer=opt, scheduler=sched, trainer_state={"global_step": 4})
        PosixPath('out/checkpoint-4')
        ```
    """
    acc, root = accelerator, Path(root)
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    tmp = root / f".{CHECKPOINT_PREFIX}{step}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    if sharded:
        # FSDP / DeepSpeed: weights and optimizer state are sharded; accelerate writes them (every
        # process takes part), together with the RNG states, into the same temp folder.
        acc.save_state(str(tmp), **_engine_kwargs(acc, SAVE_KWARGS))
    else:
        torch.save(rng_state(), tmp / f"rng_state_{acc.process_index}.pt")
    if acc.is_main_process and not sharded:
        _write_unsharded(acc, tmp, step, named, optimizer, scheduler)
    if acc.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_digest(tmp)  # last: it covers every file every process wrote
        _publish(tmp, final, root, save_total_limit, trainer_state.get("fingerprint"))
    acc.wait_for_everyone()
    return final


# ------------------------------------------------------------------ integrity


def _refuse(path: Path, why: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"cannot resume from {path}: {why}. Resume from an earlier checkpoint by its path, or start afresh without resume_from_checkpoint."
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:  # in blocks: a full fine-tune's optimizer state is several GB (hashlib.file_digest is 3.11+)
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != DIGEST)


def write_digest(folder: str | os.PathLike) -> None:
    """Write `digest.json` into a checkpoint folder: the sha256 of every other file in it (subfolders included)."""
    folder = Path(folder)
    digest = {"algorithm": "sha256", "files": {name: _file_sha256(folder / name) for name in _files(folder)}}
    (folder / DIGEST).write_text(json.dumps(digest, indent=1, sort_keys=True))


def verify_digest(path: str | os.PathLike) -> None:
    """Raise `CheckpointIntegrityError` unless `path` holds exactly the files its `digest.json` lists, each matching its sha256.

    A checkpoint without one (an older version's, or a partial copy) is refused too: its files cannot be checked.

    Example:
        ```python
        >>> verify_digest("out/checkpoint-4")  # after a byte of trainable.safetensors flipped on disk
        CheckpointIntegrityError: cannot resume from out/checkpoint-4: trainable.safetensors does not match its sha256 in digest.json (edited or damaged on disk). ...
        ```
    """
    path = Path(path)
    try:
        listed = json.loads((path / DIGEST).read_text())["files"]
    except FileNotFoundError:
        raise _refuse(path, f"it has no {DIGEST} (written by an older version, or copied in part), so its files cannot be checked") from None
    except (ValueError, KeyError, TypeError) as err:
        raise _refuse(path, f"its {DIGEST} cannot be read ({err})") from None
    if not isinstance(listed, dict):
        raise _refuse(path, f"its {DIGEST} cannot be read (no file list)")
    present = _files(path)
    if sorted(listed) != present:
        odd = sorted(set(listed) ^ set(present))
        raise _refuse(path, f"its files are not the ones {DIGEST} lists ({', '.join(odd[:4])} missing or added)")
    for name in present:
        if _file_sha256(path / name) != listed[name]:
            raise _refuse(path, f"{name} does not match its sha256 in {DIGEST} (edited or damaged on disk)")


def _step_of(entry) -> object:
    return entry.get("step") if isinstance(entry, dict) else None


def check_state(path: str | os.PathLike, state: dict, max_steps: int | None = None) -> None:
    """Raise `CheckpointIntegrityError` where `trainer_state.json` contradicts itself, its folder's name or `max_steps`."""
    path, step = Path(path), state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise _refuse(path, f"its global_step is {step!r}, not a step count >= 1")
    named = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", path.name)
    if named and int(named.group(1)) != step:
        raise _refuse(path, f"it contradicts itself: the folder is step {named.group(1)}, its {TRAINER_STATE} says global_step {step}")
    if max_steps is not None and max_steps > 0 and step > max_steps:
        raise _refuse(path, f"it contradicts itself: global_step {step} is beyond the run's max_steps {max_steps}")
    accum = (state.get("config") or {}).get("gradient_accumulation_steps")
    if isinstance(accum, int) and state.get("micro_batches") != step * accum:
        raise _refuse(path, f"it contradicts itself: global_step {step} with {accum} micro-batches a step, but micro_batches "
                            f"{state.get('micro_batches')!r}")
    for key in ("history", "eval_history"):
        late = [s for s in map(_step_of, state.get(key) or []) if not isinstance(s, int) or s > step]
        if late:
            raise _refuse(path, f"it contradicts itself: its {key} records step {late[0]!r}, after global_step {step}")


def check_counts(path: str | os.PathLike, step: int, *, scheduler_steps, optimizer_state: dict | None, scaled: bool) -> None:
    """Raise `CheckpointIntegrityError` unless the scheduler took `step` steps and the optimizer as many (at most, under a grad scaler).

    Under a grad scaler an overflowing step is skipped by the optimizer but not by the scheduler.
    """
    if scheduler_steps != step:
        raise _refuse(Path(path), f"it contradicts itself: global_step {step}, but its scheduler has taken {scheduler_steps} steps")
    counts = [float(s["step"]) for s in (optimizer_state or {}).get("state", {}).values() if isinstance(s, dict) and "step" in s]
    top = max(counts, default=None)
    if top is not None and (top > step or (not scaled and top != step)):
        raise _refuse(Path(path), f"it contradicts itself: global_step {step}, but its optimizer has taken {top:g} steps")


def trainer_state(trainer, step: int) -> dict:
    """What a checkpoint records of a `GrownTrainer` at `step` (besides tensors), with the run fingerprint."""
    return {
        "global_step": step,
        "micro_batches": step * trainer.config.gradient_accumulation_steps,
        "global_batch": trainer.order.global_batch,
        "num_processes": trainer.accelerator.num_processes,
        "units_seen": trainer.units_seen,
        "elapsed": trainer._elapsed(),
        "history": trainer.history,
        "eval_history": trainer.eval_history,
        "baseline": trainer.baseline,
        "config": trainer.config.to_dict(),
        "fingerprint": trainer.fingerprint,
    }


def resolve_resume(target: str | None, output_dir: str | None, *, is_main_process: bool = True) -> Path | None:
    """The checkpoint folder `resume_from_checkpoint` names: a path, `"latest"` (or `None` if there is none yet).

    Example:
        ```python
        >>> resolve_resume("latest", "out")
        PosixPath('out/checkpoint-5')
        ```
    """
    if not target:
        return None
    if target == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            if is_main_process:
                print(f"[hf_depthgrow] no checkpoint under {output_dir}: starting from step 0")
            return None
        return found[-1]
    path = Path(target)
    if not path.exists():
        raise FileNotFoundError(f"resume_from_checkpoint {path}: no such checkpoint folder")
    if not (path / TRAINER_STATE).exists():
        raise ValueError(f"{path} is not a complete checkpoint (no {TRAINER_STATE})")
    return path


def load_checkpoint(path: Path, accelerator, *, global_batch: int, sharded: bool, named: Sequence, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler, scaler and RNG streams from `path`; return its trainer state.

    Refuses a checkpoint written with another global micro-batch (the data order and loss scale would change),
    and one whose scheduler or optimizer step counts contradict its `global_step` (`CheckpointIntegrityError`,
    before any weight changes; sharded: after the engine loaded it). Its digest and trainer state are checked
    earlier, before the run's set-up (`guards.check_checkpoints`).

    Example:
        ```python
        >>> load_checkpoint(path, acc, global_batch=4, sharded=False, named=named, optimizer=opt, scheduler=sched)["global_step"]
        4
        ```
    """
    from safetensors.torch import load_file

    acc = accelerator
    state = json.loads((path / TRAINER_STATE).read_text())
    if state["global_batch"] != global_batch:
        raise ValueError(
            f"{path} was written with a global micro-batch of {state['global_batch']} examples, this run has "
            f"{global_batch}: resuming would change the data order and the loss scale."
        )
    if sharded:
        if acc.distributed_type == "DEEPSPEED" and state["num_processes"] != acc.num_processes:
            # ZeRO's optimizer state is stored as one partition per process (no elastic / universal checkpoint here).
            raise ValueError(f"{path} holds DeepSpeed optimizer partitions of {state['num_processes']} processes, this run has "
                             f"{acc.num_processes}: resume with {state['num_processes']}")
        acc.load_state(str(path), **_engine_kwargs(acc, LOAD_KWARGS))  # weights, optimizer, scheduler (registered), RNG states
        # The engine's optimizer state is sharded: the scheduler's count is what can be checked here.
        check_counts(path, state["global_step"], scheduler_steps=scheduler.last_epoch, optimizer_state=None, scaled=True)
        return state
    weights = load_file(str(path / TRAINABLE_WEIGHTS))
    names = {n for n, _ in named}
    if set(weights) != names:
        raise ValueError(f"{path}: trainable weights do not match this run's trainable set ({sorted(set(weights) ^ names)[:4]})")
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    scheduler_state = torch.load(path / "scheduler.pt", weights_only=True)
    scaled = (path / "scaler.pt").exists()
    check_counts(path, state["global_step"], scheduler_steps=scheduler_state.get("last_epoch"), optimizer_state=optimizer_state, scaled=scaled)
    with torch.no_grad():
        for name, param in named:
            param.copy_(weights[name].to(param.device, param.dtype))
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    if scaled and getattr(acc, "scaler", None) is not None:
        acc.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    rng_file = path / f"rng_state_{acc.process_index}.pt"
    if state["num_processes"] != acc.num_processes or not rng_file.exists():
        warnings.warn("resuming with a different number of processes: RNG streams (dropout) are not restored exactly")
        rng_file = path / "rng_state_0.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return state
