"""Trial results that survive: each finished trial is stored, verified on every read, and reused instead of rerun.

A sweep that outgrows a session resumes by running the same command again: every trial already stored under
`trials_dir` is read back (its sha256 digest checked, as the evidence cache does; an edited or damaged entry
is set aside with a warning and rerun, never reused) and only the others train. A trial's key covers its
spec (arm, rate, seed, budgets, schedule), the base model's weights, every row of every split, the settings
that change what it computes, and the package, torch and transformers versions, so a trial of another plan,
model or data is never taken for this one. Unlike the evidence cache the key leaves out the package's source
hash: a sweep that spans sessions must survive an unrelated commit (the package version still guards it).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..pipeline.evidence_cache import EvidenceCache, _sha, rows_fingerprint, weights_fingerprint
from ..utils import package_version
from .trial import BudgetScore, TrialInputs, TrialResult, TrialSpec

KIND = "trials"
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

    def __init__(self, root, inputs: TrialInputs):
        super().__init__(root)
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
                    tensors[f"{b}.{name}"] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float64))
        return self.store(KIND, self._parts(result.spec), _finite_json(meta), tensors)


def _finite_json(meta: dict) -> dict:
    """Non-finite losses (a diverged run) as strings: the entry's JSON is strict."""
    from ..utils import json_safe

    return json_safe(meta)


def _float(x) -> float:
    return float(x) if not isinstance(x, str) else float(x.replace("Infinity", "inf").replace("NaN", "nan"))


def _rebuild(spec: TrialSpec, meta: dict, tensors: dict) -> TrialResult:
    scores = {}
    for b, s in meta["scores"].items():
        arrays = {n: tensors[f"{b}.{n}"].numpy() if f"{b}.{n}" in tensors else None for n in _ARRAYS}
        scores[int(b)] = BudgetScore(steps=int(b), units_seen=int(s["units_seen"]), heldout_loss=_float(s["heldout_loss"]),
                                     selected=s["selected"], train_losses={k: _float(v) for k, v in s["train_losses"].items()},
                                     seconds=float(s["seconds"]), **arrays)  # fmt: skip
    if sorted(scores) != sorted(spec.budgets) and meta["stopped_at"] is None:
        raise ValueError(f"it holds budgets {sorted(scores)}, not {list(spec.budgets)}")
    return TrialResult(spec, scores, [(int(s), _float(v)) for s, v in meta["heldout_curve"]], meta["stopped_at"],
                       int(meta["trainable_parameters"]), float(meta["seconds"]))  # fmt: skip


def stored(engine, store: TrialStore | None):
    """`engine` that first reads each spec's stored result and stores every result it computes.

    With successive halving an arm's rates are decided together: its group is reused only when all of it is stored.
    """
    if store is None or not store.enabled:
        return engine

    def run(specs, inputs, *, halving=False, bar=None):
        found = {s.name: store.load(s) for s in specs}
        if halving:
            for arm in {s.arm.name for s in specs}:
                group = [s.name for s in specs if s.arm.name == arm]
                if any(found[n] is None for n in group):
                    found.update({n: None for n in group})
        todo = [s for s in specs if found[s.name] is None]
        if bar is not None:
            bar.update(len(specs) - len(todo))
        # Stored as each finishes (an arm's group with halving): a killed sweep keeps every trial it completed.
        groups = [[s for s in todo if s.arm.name == n] for n in dict.fromkeys(s.arm.name for s in todo)] if halving else [[s] for s in todo]
        for group in groups:
            for spec, result in zip(group, engine(group, inputs, halving=halving, bar=bar)):
                store.save(result)
                found[spec.name] = result
        return [found[s.name] for s in specs]

    return run
