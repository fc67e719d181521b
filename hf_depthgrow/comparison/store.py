"""Trial results that survive: each finished trial is stored, verified on every read, and reused instead of rerun.

A sweep that is interrupted, or run in parts, resumes by running the same command again: every trial already stored under
`trials_dir` is read back (its sha256 digest checked, as the evidence cache does; an edited, damaged or
unreadable entry, or one under another trial's key, is moved aside with a warning and rerun, never reused,
and the fresh result takes its place) and only the others train. A trial's key covers its spec (arm with
every placement entry, rate, seed, budgets, schedule), the base model's weights, every row of every split,
the settings that change what it computes, and the package, torch and transformers versions, so a trial of
another plan, model or data is never taken for this one (what it leaves out: the original's losses, computed
from what it covers, and the trackers' settings). Unlike the evidence cache the key leaves out the package's source
hash: a sweep run in parts must survive an unrelated commit (the package version still guards it).

An unfinished trial keeps its latest `TrialCheckpoint` under `checkpoints/<its key>/` (after every budget and
rung it scores; removed once its result is stored). Each carries its trial's key: on resume a checkpoint whose
key is not the trial's (another sweep's, copied in) or that fails its digest is moved aside, with a warning,
and the trial starts over. A plain rerun leaves them unused, with a warning: each unfinished trial starts over.
With `resume` (`compare --resume`) it continues from its checkpoint, which ends bit-identical to the
uninterrupted trial; `resume` where nothing of the sweep is stored or checkpointed is refused.

Beside its trials a comparison records under `sweeps/<key>/` what aggregating them needs (its config and arms,
the original's per-example losses, the documents; `save_sweep`), keyed by both and by the store's fingerprints,
so that `gather.gather_comparison` rebuilds it from the folder alone.

A write that fails (a full disk, a read-only folder, a file where the folder should be) warns once, naming the
folder and why, and the sweep goes on: what it could not store trains again on a rerun, and a trial whose result
could not be stored keeps its checkpoint. Nothing half-written is ever read: every entry and checkpoint is
written in a temporary folder, its digest last, and renamed into place whole. `trials_dir` is never `/`, the
home folder or a folder the run reads (`check_trials_dir`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..storage import ENTRY_FILE, EntryStore, is_whole, rows_fingerprint, set_aside, sha256_of, weights_fingerprint
from ..utils import json_safe, package_version
from .trial import TrialInputs, block_seed
from .trial_record import TrialResult, TrialSpec, rebuild_result, result_entry

KIND = "trials"
CHECKPOINTS = "checkpoints"  # <root>/checkpoints/<trial key>/<events done>/: the latest checkpoint of an unfinished trial
SWEEPS = "sweeps"  # <root>/sweeps/<key>/: a comparison's own record, which with its trials rebuilds it (`gather.gather_comparison`)


def check_trials_dir(trials_dir, *, inputs: dict | None = None) -> None:
    """Refuse a `trials_dir` the store must never write into: `/`, the home folder, or one of the run's own inputs.

    `inputs` maps a name (`"model"`, `"data"`) to a local folder the run reads; the store writes `trials/` and
    `checkpoints/` into its folder, so a folder the run reads must not hold it. One `ValueError`, before any work.

    Example:
        ```python
        >>> check_trials_dir("/")
        Traceback (most recent call last):
        ValueError: trials_dir / is the root folder: give the trials a folder of their own (e.g. runs/sweep-trials)
        ```
    """
    if trials_dir is None:
        return
    folder = Path(trials_dir).resolve()
    named = {Path("/").resolve(): "the root folder", Path.home().resolve(): "the home folder"}
    if folder in named:
        raise ValueError(f"trials_dir {trials_dir} is {named[folder]}: give the trials a folder of their own (e.g. runs/sweep-trials)")
    for what, given in (inputs or {}).items():
        if not given or not Path(given).is_dir():
            continue
        source = Path(given).resolve()
        if folder == source or source in folder.parents:
            raise ValueError(f"trials_dir {trials_dir} lies inside the input {what} folder {given}, which the run reads: put it beside it")


class TrialStore(EntryStore):
    """Verified trial results under `root` (see the module docstring).

    Args:
        root: The trials folder (`compare --trials-dir`).
        inputs: The sweep's `TrialInputs` (their model, rows and settings are part of every key).
        resume: Continue unfinished trials from their checkpoints (`compare --resume`).
        trains: Whether a trial not stored is trained (`False` for `compare --gather`: its warnings say so).
        context: Instead of `inputs`, the fingerprints of the model, rows and settings (a stored comparison's).

    Example:
        ```python
        >>> store = TrialStore("runs/sweep-trials", inputs)
        >>> store.load(spec) is None  # not run yet
        True
        ```
    """

    label = "trial store"

    def __init__(self, root, inputs: TrialInputs | None = None, *, resume: bool = False, trains: bool = True, context: dict | None = None):
        super().__init__(root)
        self.resume, self.trains, self._resume_checked = resume, trains, False
        self.context = context if inputs is None else {
            "model": weights_fingerprint(inputs.base),
            "rows": {k: rows_fingerprint(getattr(inputs, f"{k}_rows")) if getattr(inputs, f"{k}_rows") is not None else None
                     for k in ("train", "eval", "test", "retention")},
            "settings": {"batch_size": inputs.batch_size, "selection_max_examples": inputs.selection_max_examples,
                         "lora_target_modules": inputs.lora_target_modules, "grow_kwargs": inputs.grow_kwargs},
        }

    def redo(self) -> str:
        return "running the trial again" if self.trains else "it counts as not stored (--gather trains nothing)"

    def unstored(self) -> str:
        return "trials it cannot write are not stored or checkpointed (a rerun trains them again)"

    @staticmethod
    def key(kind: str, parts: dict) -> str:
        import transformers

        versions = {"package": package_version(), "torch": torch.__version__, "transformers": transformers.__version__}
        return sha256_of({"kind": kind, "versions": versions, "parts": parts})

    def _parts(self, spec: TrialSpec) -> dict:
        parts = {"spec": spec.to_dict(), **self.context}
        seed = block_seed(self.context["settings"]["grow_kwargs"], spec.seed)
        if spec.arm.kind == "growth" and seed != 0:
            # Block seed 0 (every seed-0 trial) is the default and is left out, so such a key names the arm and spec alone.
            parts["block_seed"] = seed
        return parts

    def trial_key(self, spec: TrialSpec) -> str:
        """The key `spec`'s result and checkpoints are stored under."""
        return self.key(KIND, self._parts(spec))

    def load(self, spec: TrialSpec) -> TrialResult | None:  # type: ignore[override]
        """The stored result of `spec`, or `None` (not stored; or not trusted: then moved aside, with a warning)."""
        entry = super().load(KIND, self._parts(spec), name=f"stored trial {spec.name}")
        if entry is None:
            return None
        try:
            return rebuild_result(spec, entry.meta, entry.tensors)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            self.reject(KIND, entry.key, f"ignoring the unreadable stored trial {spec.name} ({err})")
            return None

    def save(self, result: TrialResult) -> str | None:
        """Store `result` atomically (digest written last); returns its key (`None` if it could not be written)."""
        meta, tensors = result_entry(result)
        return self.store(KIND, self._parts(result.spec), meta, tensors)

    def save_sweep(self, cfg, arms: list, original: dict, documents: dict, extra: dict) -> str | None:
        """Store a comparison's own record beside its trials (`gather.gather_comparison` reads it back): its config and
        arms (with the store's fingerprints, its key), the original's losses, the documents, `extra` (sizes, probe)."""
        import time

        meta = json_safe({"written": time.time(), "config": cfg.to_dict(), "arms": [a.to_dict() for a in arms], "heldout": original["heldout"],
                          "documents": documents, **extra})
        arrays = {k: original[k] for k in ("test", "retention") if k in original}
        tensors = {f"{k}{part}": torch.from_numpy(np.array(a[i], dtype=np.float64)) for k, a in arrays.items() for i, part in enumerate(("", "_weight"))}
        return self.store(SWEEPS, {"context": self.context, "config": meta["config"], "arms": meta["arms"]}, meta, tensors)

    @classmethod
    def sweep_in(cls, root) -> tuple["TrialStore", dict, dict]:
        """`(store, meta, tensors)` of the comparison last recorded under `root` (`save_sweep`), each record verified
        against its digest; `ValueError` where `root` holds none that this version wrote."""
        found = []
        for header in sorted(Path(root, SWEEPS).glob(f"*/{ENTRY_FILE}")):
            try:
                parts = json.loads(header.read_text(encoding="utf-8"))["parts"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # names no comparison; never read as one
            store = cls(root, context=parts["context"], trains=False)
            if (entry := EntryStore.load(store, SWEEPS, parts, name=f"stored comparison {header.parent.name[:12]}")) is not None:
                found.append((entry.meta["written"], store, entry))
        if not found:
            raise ValueError(f"gather: {root} holds no comparison this version recorded (compare --trials-dir records one beside "
                             "its trials; a folder written by another version is read by that version)")
        _, store, entry = max(found, key=lambda f: f[0])
        return store, entry.meta, entry.tensors

    def keep(self, result: TrialResult) -> None:
        """Store a finished trial and drop its checkpoints; one that could not be written keeps them, for `--resume`."""
        if self.save(result) is not None:
            self.drop_checkpoints(result.spec)

    # ------------------------------------------------------------------ checkpoints of unfinished trials

    def _checkpoints(self, spec: TrialSpec) -> Path:
        return self.root / CHECKPOINTS / self.trial_key(spec)

    def save_checkpoint(self, spec: TrialSpec, checkpoint) -> None:
        """Keep `checkpoint` (a `TrialCheckpoint`, stamped with `spec`'s key) as `spec`'s latest, replacing the one before
        it; a failed write (a full disk, a read-only folder) only warns, once, and leaves the one before it in place."""
        if not self.enabled:
            return
        folder, key = self._checkpoints(spec), self.trial_key(spec)
        new = folder / f"{checkpoint.events_done:04d}"
        try:
            if not is_whole(new):
                shutil.rmtree(new, ignore_errors=True)
                replace(checkpoint, key=key).save(new)
            for old in folder.iterdir():  # the new one is in place first: a crash leaves one whole checkpoint
                if old != new and _ours(old):
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as its own SafetensorError
            self.warn_unwritable(err)

    def _candidates(self, spec: TrialSpec) -> list[Path]:
        folder = self._checkpoints(spec)
        return sorted((p for p in folder.iterdir() if p.name.isdigit()), reverse=True) if folder.is_dir() else []

    def has_checkpoint(self, spec: TrialSpec) -> bool:
        """Whether `spec` has a checkpoint written for it here (its header names its key; the digest is checked on resume)."""
        key = self.trial_key(spec)
        for path in self._candidates(spec):
            try:
                if json.loads((path / ENTRY_FILE).read_text(encoding="utf-8")).get("key") == key:
                    return True
            except (OSError, ValueError, AttributeError):
                continue
        return False

    def resume_point(self, spec: TrialSpec):
        """With `resume`: `spec`'s latest whole checkpoint written for its key (a `TrialCheckpoint`), else `None`.

        A checkpoint that fails its digest, or carries another trial's key (another sweep's, copied in), is moved
        aside to `checkpoints/.rejected-...` with a warning, and the trial starts over (or continues from an older one).
        """
        from .trial_checkpoint import TrialCheckpoint

        if not (self.enabled and self.resume):
            return None
        key = self.trial_key(spec)
        for path in self._candidates(spec):
            try:
                checkpoint = TrialCheckpoint.load(path)
                if checkpoint.key != key:
                    other = f" (of {checkpoint.name})" if checkpoint.name != spec.name else ""
                    raise ValueError(f"it was written for another trial{other}: another model, data, settings or spec"
                                     if checkpoint.key else "it does not carry its trial's key (written by an older version)")
                return checkpoint
            except (OSError, ValueError, KeyError, TypeError) as err:
                aside = set_aside(path, key, into=self.root / CHECKPOINTS)
                where = f"moved aside to {aside}" if aside else "left in place: the folder is read-only"
                warnings.warn(f"trial store: not resuming {spec.name} from the checkpoint {path} ({err}); it starts over "
                              f"unless an older checkpoint of it is whole (the checkpoint is {where})", stacklevel=2)
        return None

    def drop_checkpoints(self, spec: TrialSpec) -> None:
        """Remove `spec`'s checkpoints (once its result is stored they are not needed); nothing else in their folder."""
        if not self.enabled or not (folder := self._checkpoints(spec)).is_dir():
            return
        for path in folder.iterdir():
            if _ours(path):
                shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: what someone else put there stays

    def check_resume(self, specs: list[TrialSpec]) -> None:
        """With `resume`, on the first call (a sweep's first trials): refuse when none of `specs` is stored or checkpointed here."""
        if not self.resume or self._resume_checked:
            return
        self._resume_checked = True
        if not any(self.has_checkpoint(s) or self._folder(KIND, self.trial_key(s)).is_dir() for s in specs):
            raise ValueError(f"resume: nothing to resume in {self.root}: none of the {len(specs)} trials is stored or checkpointed there "
                             "for this model, data and settings (drop --resume to start the sweep)")

    def hooks(self, spec: TrialSpec) -> dict:
        """`run_trial`'s keyword arguments that checkpoint `spec` here and (with `resume`) continue it from its latest checkpoint."""
        if not self.enabled:
            return {}
        return {"checkpoint": lambda c: self.save_checkpoint(spec, c), "resume": self.resume_point(spec)}


def _ours(path: Path) -> bool:
    """Whether `path`, in a trial's checkpoint folder, is what this store writes there: a checkpoint or its temporary folder."""
    return path.is_dir() and (path.name.isdigit() or path.name.startswith(".tmp-"))


_NAMED = 4  # trials named in the message on trials not stored; the rest counted


def stored_or_run(store: TrialStore | None, specs: list[TrialSpec], run, *, halving: bool = False, bar=None) -> list[TrialResult]:
    """Every spec's result in the specs' order: its stored one where `store` holds it, else one of `run(todo)`.

    The one "stored or run" step of every engine (serial, Ray, `stored`). `run` takes the specs not stored and
    returns their results (any order), storing each as it finishes (`TrialStore.keep`: a killed sweep keeps every
    trial it completed); `run=None` trains nothing, and a spec not stored is a `ValueError` naming it. With
    `halving` an arm's rates are decided together, so its group is reused only when all of it is stored. With
    the store's `resume`, the first call refuses a folder that holds none of `specs`.
    """
    use = store is not None and store.enabled
    if use:
        store.check_resume(specs)
    found = {s.name: store.load(s) if use else None for s in specs}
    if halving:
        for arm in {s.arm.name for s in specs}:
            group = [s.name for s in specs if s.arm.name == arm]
            if any(found[n] is None for n in group):
                found.update({n: None for n in group})
    todo = [s for s in specs if found[s.name] is None]
    if todo and run is None:
        names = ", ".join(s.name for s in todo[:_NAMED]) + (f" and {len(todo) - _NAMED} more" if len(todo) > _NAMED else "")
        raise ValueError(f"{len(todo)} of {len(specs)} trials are not stored in {store.root} for this model, data and "
                         f"settings: {names} (run the command without --gather to train them)")
    if bar is not None:
        bar.update(len(specs) - len(todo))
    if use:
        warn_unresumed(store, todo)
    if todo:
        found.update({r.spec.name: r for r in run(todo)})
    return [found[s.name] for s in specs]


def stored(engine, store: TrialStore | None):
    """`engine` (`run_serial`'s contract) behind `stored_or_run`: stored trials reused, each new one stored as it finishes.

    Without halving each trial is checkpointed here (`hooks`; the engine must take `checkpoints=`); with successive
    halving an arm's rates run together, as one group, in step from their start: no checkpoints.
    """
    if store is None or not store.enabled:
        return engine

    def run(specs, inputs, *, halving=False, bar=None):
        def train(todo):
            groups = [[s for s in todo if s.arm.name == n] for n in dict.fromkeys(s.arm.name for s in todo)] if halving else [[s] for s in todo]
            for group in groups:
                for result in engine(group, inputs, halving=halving, bar=bar, **({} if halving else {"checkpoints": store})):
                    store.keep(result)
                    yield result

        return stored_or_run(store, specs, train, halving=halving, bar=bar)

    return run


def warn_unresumed(store: TrialStore, todo: list[TrialSpec]) -> None:
    """Without `resume`, one warning naming the trials to run that have a checkpoint written for them: they start over.

    Only checkpoints of these very trials count (a sweep sharing the folder keeps its own under other keys), and
    the run that left one may be interrupted or still running elsewhere: the warning says both.
    """
    if store.resume or not store.enabled:
        return
    left = [s.name for s in todo if store.has_checkpoint(s)]
    if left:
        warnings.warn(f"trial store: {len(left)} trial(s) to run ({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}) have a checkpoint "
                      f"under {store.root} from a run that did not finish them (interrupted, or still running elsewhere): "
                      "they start over here (--resume continues them)", stacklevel=3)
