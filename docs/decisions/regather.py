"""Read a committed comparison's stored trials again with the current aggregation, without the model or the data.

    python docs/decisions/regather.py docs/decisions/smollm2-budgets docs/decisions/smollm2-budgets-trials \
        docs/decisions/smollm2-budgets-curve

Every trial in `TRIALS/trials/` holds its per-example test and retention losses at every budget, so the choices,
intervals, frontier and control curve can be recomputed as the current `aggregate` makes them. The original's
per-example losses are read from a trial whose fallback rule kept the original at some budget (its losses there
are the original's). The arms and settings are the committed `compare.json`'s; settings added since take their
defaults. Only what the store holds is re-read: trials the current defaults would add (rates below each grid,
matched controls) were never trained and are not invented. Writes compare.json/.md/.png into OUT.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from safetensors.numpy import load_file

from hf_depthgrow.comparison import CompareConfig
from hf_depthgrow.comparison.aggregate import aggregate
from hf_depthgrow.comparison.arms import Arm
from hf_depthgrow.comparison.trial import BudgetScore, TrialResult, TrialSpec

_ARRAYS = ("test", "test_weight", "retention", "retention_weight")


def _trial(entry: Path, arms: dict, cfg) -> tuple[TrialResult, dict | None]:
    """One stored trial, and the original's losses where its fallback rule kept the original."""
    meta = json.loads(entry.read_text())["meta"]
    tensors = load_file(str(entry.parent / "tensors.safetensors"))
    name, lr, seed = meta["name"].rsplit("@", 2)
    scores, original = {}, None
    for budget, s in meta["scores"].items():
        arrays = {n: tensors.get(f"{budget}.{n}") for n in _ARRAYS}
        scores[int(budget)] = BudgetScore(steps=int(budget), units_seen=s["units_seen"], heldout_loss=float(s["heldout_loss"]),
                                          selected=s["selected"], train_losses=s["train_losses"], seconds=s["seconds"], **arrays)
        if s["selected"] == "old" and original is None:
            original = {"test": (arrays["test"], arrays["test_weight"]), "retention": (arrays["retention"], arrays["retention_weight"])}
    spec = TrialSpec(arms[name], float(lr[2:]), int(seed[4:]), tuple(cfg.sweep), scheduler=cfg.scheduler)
    result = TrialResult(spec, scores, [(int(a), float(b)) for a, b in meta["heldout_curve"]], meta["stopped_at"],
                         int(meta["trainable_parameters"]), float(meta["seconds"]))
    return result, original


def main(study: Path, trials_dir: Path, out: Path) -> None:
    saved = json.loads((study / "compare.json").read_text())
    fields = {f.name for f in dataclasses.fields(CompareConfig)}
    cfg = CompareConfig(**{k: v for k, v in saved["config"].items() if k in fields})
    arms = [Arm(a["name"], a["kind"], layers=a.get("layers"), lora_r=a.get("lora_r"), trainable_parameters=a.get("trainable_parameters") or 0,
                matched_to=a.get("matched_to")) for a in saved["arms"]]
    arms.sort(key=lambda a: a.kind != "original")  # the original first, as aggregate expects
    by_name = {a.name: a for a in arms}
    trials, original = [], None
    for entry in sorted((trials_dir / "trials").glob("*/entry.json")):
        trial, kept = _trial(entry, by_name, cfg)
        trials.append(trial)
        original = original or kept
    if original is None:
        sys.exit(f"{trials_dir}: no trial kept the original at any budget, so its per-example losses are not in the store")
    original["heldout"] = next(a for a in saved["arms"] if a["name"] == "original")["heldout_loss"]
    extra = {"probe": saved["probe"], "seconds": saved["seconds"], "num_examples": saved["num_examples"]}
    result = aggregate(arms, trials, original, cfg, grids=saved["grids"], extra=extra)
    result.save(out)
    print(result.verdict)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*(Path(a) for a in sys.argv[1:]))
