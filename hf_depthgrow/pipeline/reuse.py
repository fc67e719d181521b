"""Which of a run's evidence an identical earlier run already computed (`evidence_cache`), stage by stage.

Five kinds, each keyed by exactly what it depends on:

- `probe`: the probe's result on the training split (model, training rows, batch size, batches, block settings);
- `stepping_stones`: `f~_S` and `f~_pop` at one position, as the line search's results and the two directions'
  gradients (the probe's key, the held-out rows, the position and the line-search settings); the stones are
  rebuilt from them (`rebuild_stepping_stone`), weights identical to the bit;
- `original_losses`: the original's step-0 held-out loss and `L_S(f_old)` on the fallback rule's rows, which
  the growth's trainer takes instead of its two passes (`OriginalLosses`; model, both splits, the trainer's
  batch size, selection and numeric settings);
- `paired_losses`: the per-example losses of the original (and of `f~_S`) on the test split, and of the
  original on the retention set: the paired passes then run only the trained model (`paired_losses(known=)`);
- `stone_margin`: `Delta_R`, `f~_pop`'s margin over the original on the held-out split (the stones' key).

An entry that is stored but cannot be turned back into what it held is skipped with a warning, like an
unreadable one or one that fails its digest (`EvidenceCache.load` checks every file's sha256 first, so an
edited loss never reaches a report): the cache can make a run faster, never fail it or change its result. A probe read from the cache holds no gradients; where the stepping stones then miss (another position), the
probe runs again, so the stones are always those a fresh run makes. `run.reused` names what was reused, in
`summary.json` and on the log.
"""

from __future__ import annotations

from dataclasses import asdict

from ..storage import rows_fingerprint, weights_fingerprint
from .evidence_cache import EvidenceCache


def open_cache(run) -> None:
    """The run's cache and the fingerprints of the original and the splits the evidence reads (nothing when off)."""
    run.cache = EvidenceCache.from_setting(run.cfg.evidence_cache)
    if run.cache.enabled:
        run.fingerprints = {"model": weights_fingerprint(run.model), "device": str(next(run.model.parameters()).device.type)}
        run.fingerprints.update({name: rows_fingerprint(run.splits[name]) for name in ("train", "held_out")})


def _reuse(run, kind: str, parts: dict, read, name: str | None = None):
    """`read(entry)` of the stored entry, recorded in `run.reused[name or kind]` and logged; `None` when missing or unusable.

    Every caller checks `run.cache.enabled` first: with the cache off there are no fingerprints to build `parts` from.
    """
    entry = run.cache.load(kind, parts)
    if entry is None:
        return None
    try:
        value = read(entry)
    except Exception as err:  # stored by other code or damaged in a way the file checks cannot see
        # Set aside, not skipped: an entry left in place would be skipped, and never replaced, on every later run.
        run.cache.reject(kind, entry.key, f"the {kind} entry {entry.key[:12]} cannot be read ({err})", damaged=True)
        return None
    run.reused[name or kind] = entry.key[:12]
    run.log(f"{name or kind}: reused from an identical earlier run (evidence cache entry {entry.key[:12]})")
    return value


def _probe_parts(run) -> dict:
    cfg = run.cfg
    return {"model": run.fingerprints["model"], "device": run.fingerprints["device"], "train": run.fingerprints["train"],
            "batch_size": cfg.batch_size, "max_batches": cfg.probe_max_batches, **run.grow_kwargs}


def load_probe(run):
    """The probe's result from the cache (without gradients), or `None`."""
    from ..probe.result import ProbeResult

    if not run.cache.enabled:
        return None
    return _reuse(run, "probe", _probe_parts(run), lambda entry: ProbeResult.from_dict(entry.meta))


def store_probe(run) -> None:
    if run.cache.enabled:
        run.cache.store("probe", _probe_parts(run), run.probe_result.to_dict())


def probe_again(run):
    """The probe as a fresh run runs it, with `G_S` kept (for stepping stones that missed while the probe hit)."""
    from ..probe.signal import probe

    run.reused.pop("probe", None)
    cfg = run.cfg
    return probe(run.model, run.splits["train"], batch_size=cfg.batch_size, max_batches=cfg.probe_max_batches, progress=cfg.progress,
                 keep_gradients=True, **run.grow_kwargs)


def _stone_parts(run, k: int) -> dict:
    cfg = run.cfg
    return {"probe": _probe_parts(run), "held_out": run.fingerprints["held_out"], "position": k,
            "stone_max_batches": cfg.stone_max_batches, "refine_steps": cfg.stone_refine_steps}


def load_stones(run, k: int) -> tuple | None:
    """`((f~_S, result), (f~_pop, result))` rebuilt from the cache, or `None`."""
    from ..probe.stepping_stone import SteppingStoneResult, rebuild_stepping_stone

    def read(entry):
        stones = []
        for side in ("train", "held_out"):
            result = SteppingStoneResult.from_dict(entry.meta[side])
            gradient = {name[len(side) + 1 :]: t for name, t in entry.tensors.items() if name.startswith(side + "/")}
            stones.append((rebuild_stepping_stone(run.model, result, gradient), result))
        return tuple(stones)

    return _reuse(run, "stepping_stones", _stone_parts(run, k), read) if run.cache.enabled else None


def store_stones(run, k: int, stone_s, stone_pop) -> None:
    if run.cache.enabled:
        sides = (("train", stone_s), ("held_out", stone_pop))
        tensors = {f"{side}/{name}": t for side, r in sides for name, t in r.gradient.items()}
        run.cache.store("stepping_stones", _stone_parts(run, k), {side: r.to_dict() for side, r in sides}, tensors)


def _losses_parts(run, train_config) -> dict:
    # What the two passes' numbers depend on besides the rows: batch size, which rows, numerics. Not the
    # steps: where they switch the prefix cache on or off, the two paths compute the same losses (to the last bits).
    keep = ("per_device_train_batch_size", "per_device_eval_batch_size", "selection_max_examples", "seed", "fallback",
            "mixed_precision", "chunked_loss", "loss_chunk_size", "prefix_cache_dtype")
    settings = {k: v for k, v in asdict(train_config).items() if k in keep}
    return {"model": run.fingerprints["model"], "device": run.fingerprints["device"], "train": run.fingerprints["train"],
            "held_out": run.fingerprints["held_out"], "trainer": settings}


def load_original_losses(run, train_config):
    """The original's `OriginalLosses` (step-0 held-out loss, `L_S(f_old)`) on this run's rows from the cache, or `None`."""
    from ..training.original_losses import OriginalLosses

    if not run.cache.enabled:
        return None
    return _reuse(run, "original_losses", _losses_parts(run, train_config), lambda entry: OriginalLosses(**entry.meta))


def store_original_losses(run, train_config, losses) -> None:
    if run.cache.enabled and losses is not None and losses.held_out is not None and losses.train is not None:
        run.cache.store("original_losses", _losses_parts(run, train_config), losses.to_dict())


def paired_losses(run, split: str, data, extra: dict | None = None):
    """`paired_losses(run.model, data, extra=extra)`, the original's and the extras' sides from the cache where stored.

    The extras (a stepping stone) are keyed by the stones' entry: they are what the stones of this run are.
    """
    from ..evaluation.collector import Collector
    from ..evaluation.paired import paired_losses as run_paired
    from ..growth.prefix import lowest_new_index

    cfg, sides = run.cfg, ["old", *(extra or {})]
    known = parts = None
    if run.cache.enabled:
        parts = {"model": run.fingerprints["model"], "device": run.fingerprints["device"], "rows": rows_fingerprint(data),
                 "batch_size": cfg.batch_size, "index": lowest_new_index(run.model), "sides": sides,
                 "stones": _stone_parts(run, run.positions[0]) if extra else None}
        known = _reuse(run, "paired_losses", parts, lambda entry: Collector.from_tensors(entry.meta["task"], entry.tensors), f"{split}_losses")
    collect, _ = run_paired(run.model, data, batch_size=cfg.batch_size, progress=cfg.progress, extra=extra, known=known)
    if parts is not None and known is None:
        run.cache.store("paired_losses", parts, {"task": collect.task}, collect.to_tensors(sides))
    return collect


def _margin_parts(run) -> dict:
    return {**_stone_parts(run, run.positions[0]), "batch_size": run.cfg.batch_size}


def load_margin(run) -> tuple[float, str] | None:
    """`Delta_R` and how it was measured, from the cache, or `None`."""

    def read(entry):
        how = entry.meta["how"].removeprefix("measured here: ")
        return float(entry.meta["delta_r"]), f"{how}, measured by an identical earlier run (evidence cache entry {entry.key[:12]})"

    return _reuse(run, "stone_margin", _margin_parts(run), read) if run.cache.enabled else None


def store_margin(run, delta_r: float | None, how: str | None) -> None:
    if run.cache.enabled and delta_r is not None and how:
        run.cache.store("stone_margin", _margin_parts(run), {"delta_r": delta_r, "how": how})
