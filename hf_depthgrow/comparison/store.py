"""Trial results that survive: each finished trial is stored, verified on every read, and reused instead of rerun.

A sweep that outgrows a session resumes by running the same command again: every trial already stored under
`trials_dir` is read back (its sha256 digest checked, as the evidence cache does; an edited or damaged entry
is set aside with a warning and rerun, never reused) and only the others train. A trial's key covers its
spec (arm, rate, seed, budgets, schedule), the base model's weights, every row of every split, the settings
that change what it computes, and the package, torch and transformers versions, so a trial of another plan,
model or data is never taken for this one. Unlike the evidence cache the key leaves out the package's source
hash: a sweep that spans sessions must survive an unrelated commit (the package version still guards it).

An unfinished trial keeps its latest `TrialCheckpoint` under `checkpoints/<its key>/` (after every budget and
rung it scores; removed once its result is stored). A plain rerun leaves them unused, with a warning: each
unfinished trial starts over. With `resume` (`compare --resume`) it continues from its checkpoint, which ends
bit-identical to the uninterrupted trial; `resume` where nothing of the sweep is stored or checkpointed is refused.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from ..pipeline.evidence_cache import EvidenceCache, _sha, _whole, rows_fingerprint, weights_fingerprint
from ..utils import package_version
from .trial import BudgetScore, TrialInputs, TrialResult, TrialSpec

KIND = "trials"
CHECKPOINTS = "checkpoints"  # <root>/checkpoints/<trial key>/<events done>/: the latest checkpoint of an unfinished trial
_ARRAYS = ("test", "test_weight", "retention", "retention_weight")


class TrialStore(EvidenceCache):
    """Verified trial results under `root` (see the module docstring).

    Example:
        ```python
        >>> store = TrialStore("runs/sweep-trials", inputs)
        >>> store.load(spec) is None  # not run yet
        True
        ```
    """

    def __init__(self, root, inputs: TrialInputs, *, resume: bool = False):
        super().__init__(root)
        self.resume, self._resume_checked = resume, False
        self.context = {
            "model": weights_fingerprint(inputs.base),
            "rows": {k: rows_fingerprint(getattr(inputs, f"{k}_rows")) if getattr(inputs, f"{k}_rows") is not None else None
                     for k in ("train", "eval", "test", "retention")},
            "settings": {"batch_size": inputs.batch_size, "selection_max_examples": inputs.selection_max_examples,
                         "lora_target_modules": inputs.lora_target_modules, "grow_kwargs": inputs.grow_kwargs},
        }  # fmt: skip

    @staticmethod
    def key(kind: str, parts: dict) -> str:
        import transformers

        versions = {"package": package_version(), "torch": torch.__version__, "transformers": transformers.__version__}
        return _sha({"kind": kind, "versions": versions, "parts": parts})

    def _parts(self, spec: TrialSpec) -> dict:
        return {"spec": spec.to_dict(), **self.context}

    def load(self, spec: TrialSpec) -> TrialResult | None:  # type: ignore[override]
        """The stored result of `spec`, or `None` (not stored, or failed its digest: then with a warning)."""
        entry = super().load(KIND, self._parts(spec))
        if entry is None:
            return None
        try:
            return _rebuild(spec, entry.meta, entry.tensors)
        except (KeyError, TypeError, ValueError) as err:
            warnings.warn(f"trial store: ignoring the unreadable result of {spec.name} ({err}); running it again", stacklevel=2)
            return None

    def save(self, result: TrialResult) -> str | None:
        """Store `result` atomically (digest written last); returns its key (`None` if it could not be written)."""
        meta, tensors = _result_entry(result)
        return self.store(KIND, self._parts(result.spec), meta, tensors)

    # ------------------------------------------------------------------ checkpoints of unfinished trials

    def _checkpoints(self, spec: TrialSpec) -> Path:
        return self.root / CHECKPOINTS / self.key(KIND, self._parts(spec))

    def save_checkpoint(self, spec: TrialSpec, checkpoint) -> None:
        """Keep `checkpoint` (a `TrialCheckpoint`) as `spec`'s latest, replacing the one before it; a failed write only warns."""
        if not self.enabled:
            return
        folder = self._checkpoints(spec)
        new = folder / f"{checkpoint.events_done:04d}"
        try:
            if not _whole(new):
                shutil.rmtree(new, ignore_errors=True)
                checkpoint.save(new)
            for old in folder.iterdir():  # the new one is in place first: a crash leaves one whole checkpoint
                if old != new:
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as err:
            warnings.warn(f"trial store: could not write the checkpoint of {spec.name} under {self.root} ({err}); the run goes on", stacklevel=2)

    def resume_point(self, spec: TrialSpec):
        """With `resume`: `spec`'s latest whole checkpoint (a `TrialCheckpoint`), else `None` (the trial starts over)."""
        from .trial_checkpoint import TrialCheckpoint

        folder = self._checkpoints(spec) if self.enabled and self.resume else None
        if folder is None or not folder.is_dir():
            return None
        for path in sorted((p for p in folder.iterdir() if p.name.isdigit()), reverse=True):
            try:
                checkpoint = TrialCheckpoint.load(path)
                if checkpoint.name != spec.name:
                    raise ValueError(f"it is a checkpoint of {checkpoint.name}")
                return checkpoint
            except (OSError, ValueError, KeyError) as err:
                warnings.warn(f"trial store: not resuming {spec.name} from {path} ({err})", stacklevel=2)
        return None

    def drop_checkpoints(self, spec: TrialSpec) -> None:
        """Remove `spec`'s checkpoints (once its result is stored they are not needed)."""
        if self.enabled:
            shutil.rmtree(self._checkpoints(spec), ignore_errors=True)

    def check_resume(self, specs: list[TrialSpec]) -> None:
        """With `resume`, on the first call (a sweep's first trials): refuse when none of `specs` is stored or checkpointed here."""
        if not self.resume or self._resume_checked:
            return
        self._resume_checked = True
        if not any(self._checkpoints(s).is_dir() or self._folder(KIND, self.key(KIND, self._parts(s))).is_dir() for s in specs):
            raise ValueError(f"resume: nothing to resume in {self.root}: none of the {len(specs)} trials is stored or checkpointed there "
                             "for this model, data and settings (drop --resume to start the sweep)")  # fmt: skip

    def hooks(self, spec: TrialSpec) -> dict:
        """`run_trial`'s keyword arguments that checkpoint `spec` here and (with `resume`) continue it from its latest checkpoint."""
        if not self.enabled:
            return {}
        return {"checkpoint": lambda c: self.save_checkpoint(spec, c), "resume": self.resume_point(spec)}


def _result_entry(result: TrialResult) -> tuple[dict, dict]:
    """A result as JSON-safe meta and its per-example arrays as float64 tensors named `<budget>.<array>`."""
    meta = {
        "name": result.spec.name, "stopped_at": result.stopped_at, "trainable_parameters": result.trainable_parameters,
        "seconds": result.seconds, "heldout_curve": [[int(s), float(v)] for s, v in result.heldout_curve],
        "scores": {str(b): {"units_seen": s.units_seen, "heldout_loss": s.heldout_loss, "selected": s.selected,
                            "train_losses": s.train_losses, "seconds": s.seconds} for b, s in result.scores.items()},
    }  # fmt: skip
    tensors = {}
    for b, s in result.scores.items():
        for name in _ARRAYS:
            value = getattr(s, name)
            if value is not None:
                # A copy: budgets that kept the original share one array, and safetensors refuses shared memory.
                tensors[f"{b}.{name}"] = torch.from_numpy(np.array(value, dtype=np.float64))
    return _finite_json(meta), tensors


def _finite_json(meta: dict) -> dict:
    """Non-finite losses (a diverged run) as strings: the entry's JSON is strict."""
    from ..utils import json_safe

    return json_safe(meta)


def _float(x) -> float:
    return float(x) if not isinstance(x, str) else float(x.replace("Infinity", "inf").replace("NaN", "nan"))


def _rebuild(spec: TrialSpec, meta: dict, tensors: dict, *, partial: bool = False) -> TrialResult:
    scores = {}
    for b, s in meta["scores"].items():
        arrays = {n: tensors[f"{b}.{n}"].numpy() if f"{b}.{n}" in tensors else None for n in _ARRAYS}
        scores[int(b)] = BudgetScore(steps=int(b), units_seen=int(s["units_seen"]), heldout_loss=_float(s["heldout_loss"]),
                                     selected=s["selected"], train_losses={k: _float(v) for k, v in s["train_losses"].items()},
                                     seconds=float(s["seconds"]), **arrays)  # fmt: skip
    if sorted(scores) != sorted(spec.budgets) and meta["stopped_at"] is None and not partial:
        raise ValueError(f"it holds budgets {sorted(scores)}, not {list(spec.budgets)}")
    return TrialResult(spec, scores, [(int(s), _float(v)) for s, v in meta["heldout_curve"]], meta["stopped_at"],
                       int(meta["trainable_parameters"]), float(meta["seconds"]))  # fmt: skip


def stored(engine, store: TrialStore | None):
    """`engine` that first reads each spec's stored result and stores every result it computes.

    Each trial run without halving is checkpointed under the store after every budget (and rung) it scores; with
    the store's `resume` it continues from its latest checkpoint (`hooks`; the engine must take `checkpoints=`).
    With successive halving an arm's rates are decided together: its group is reused only when all of it is
    stored, and its trials take no checkpoints (halving runs them in step from their start).
    """
    if store is None or not store.enabled:
        return engine

    def run(specs, inputs, *, halving=False, bar=None):
        store.check_resume(specs)
        found = {s.name: store.load(s) for s in specs}
        if halving:
            for arm in {s.arm.name for s in specs}:
                group = [s.name for s in specs if s.arm.name == arm]
                if any(found[n] is None for n in group):
                    found.update({n: None for n in group})
        todo = [s for s in specs if found[s.name] is None]
        if bar is not None:
            bar.update(len(specs) - len(todo))
        warn_unresumed(store, todo)
        # Stored as each finishes (an arm's group with halving): a killed sweep keeps every trial it completed.
        groups = [[s for s in todo if s.arm.name == n] for n in dict.fromkeys(s.arm.name for s in todo)] if halving else [[s] for s in todo]
        for group in groups:
            extra = {} if halving else {"checkpoints": store}
            for spec, result in zip(group, engine(group, inputs, halving=halving, bar=bar, **extra)):
                store.save(result)
                store.drop_checkpoints(spec)
                found[spec.name] = result
        return [found[s.name] for s in specs]

    return run


def warn_unresumed(store: TrialStore, todo: list[TrialSpec]) -> None:
    """Without `resume`, one warning naming the trials that have checkpoints of an interrupted run: they start over."""
    if store.resume or not store.enabled:
        return
    left = [s.name for s in todo if store._checkpoints(s).is_dir()]
    if left:
        warnings.warn(f"trial store: {len(left)} trial(s) to run ({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}) have checkpoints "
                      f"of an interrupted run under {store.root}: they start over (--resume continues them)", stacklevel=3)  # fmt: skip
