"""What a run says at the end: `summary.json`, and `summary.md`, the table a person reads first."""

from __future__ import annotations

import json
from pathlib import Path

from ..data.batches import documents_of
from ..evaluation.checks import cluster_labels
from ..evaluation.formatting import data_parts_text
from ..hub.loading import public_name


def probe_summary(result) -> dict:
    """The probe's recommendation and best position, as `summary.json` holds them."""
    best = result.recommendation.get("best")
    i = result.positions.index(best) if best in result.positions else None
    return {
        "recommendation": result.recommendation,
        "best": best,
        "best_signal": result.signal[i] if i is not None else None,
        "best_z": result.z[i] if i is not None else None,
        "num_improvable": int(sum(result.improvable)),
        "num_positions": len(result.positions),
    }


def placement_policy_summary(policy: str | None) -> dict | None:
    """The placement policy that chose where to grow, with its track record when it is the default (else `None` when the
    user placed the blocks).

    Example:
        ```python
        >>> placement_policy_summary("z")["policy"]
        'z'
        ```
    """
    from ..probe.placement_policy import DEFAULT_TRACK_RECORD, track_record_line

    if policy is None:
        return None
    if policy != DEFAULT_TRACK_RECORD["policy"]:
        return {"policy": policy, "track_record": None, "line": f"placement policy: {policy} (not the validated default)"}
    record = {k: DEFAULT_TRACK_RECORD[k] for k in ("worst_relative_regret", "worst_task", "worst_regret", "worst_regret_task",
                                                   "mean_spearman", "measured")}
    return {"policy": policy, "track_record": record, "line": track_record_line()}


def data_parts(run) -> dict:
    """Blocks and documents of each part of a run's data (`train`, `held_out`, `test`, `retention`); for the test part
    and the retention set, `resampled` says whether their bootstrap drew documents or blocks (the evaluation's
    `cluster_key="auto"`: documents where the part names at least 2)."""
    sets = {**dict(run.splits or {}), "retention": run.retention_data}
    out = {}
    for name, rows in sets.items():
        if rows is None:
            continue
        docs = documents_of(rows)
        out[name] = {"blocks": len(rows), "documents": len(set(docs)) if docs is not None else None}
        if name in ("test", "retention"):
            out[name]["resampled"] = "documents" if cluster_labels(docs, "auto") is not None else "blocks"
    return out


def grown_summary(run) -> dict:
    """`summary.json` of a run that grew: what was decided, trained, measured and reused, and the timings."""
    train_result, eval_result = run.train_result, run.eval_result
    stones = {k: {key: v[key] for key in ("eta", "grad_norm", "loss_old", "loss_stone") if key in v} for k, v in run.stones.items()}
    return {
        "decision": "grew",
        "base_model": run.base_name,
        "data": public_name(run.cfg.data),
        "positions": run.positions,
        "why": run.why,
        "placement_policy": placement_policy_summary(run.placement_policy),
        "probe": probe_summary(run.probe_result),
        "stepping_stones": stones,
        "selected": train_result.selected,
        "train_losses": train_result.train_losses,
        "delta_erm": train_result.delta_erm,
        "held_out_loss": {"before": train_result.eval_loss_before, "after": train_result.eval_loss_after},
        "test": {
            "loss_old": eval_result.loss_old,
            "loss_new": eval_result.loss_new,
            "delta": eval_result.delta,
            "intervals": {k: list(v) for k, v in eval_result.intervals.items()},
            "certified": getattr(eval_result, "certified", None),
            "verdict": getattr(eval_result, "verdict", None),
        },
        "data_parts": data_parts(run),
        **({"control": run.control} if run.control else {}),
        **({"retention": run.retention} if run.retention else {}),
        **({"reused": run.reused} if run.reused else {}),
        "timings_s": run.timings,
    }


def _describe_control(c: dict) -> str:
    """What the control trained, in the words of the sentence: which parameters, how many, the same budget."""
    params, steps, units = c["trainable_parameters"], c["steps"]["control"], c["units_seen"]["control"]
    if c["kind"] == "layers":
        what = f"training layers {c['layers']} of the original, {params['control']:,} parameters"
    else:
        what = (f"LoRA rank {c['lora_r']} on every linear layer of the original, {params['control']:,} parameters "
                f"vs {params['growth']:,} in the new blocks")
    return f"{what}, same {steps} steps and {units:,} {c['unit']}"


def control_sentence(control: dict) -> str:
    """One plain sentence: did growth beat the equal-parameter control, by how much, how sure.

    `control` is `summary.json`'s `control` entry (its `test`: `delta = loss(control) - loss(grown)`, positive =
    growth better, and the interval named by `test["interval"]`).

    Example:
        ```python
        >>> print(control_sentence(run_pipeline(cfg).summary["control"]))
        Growth beat the equal-parameter control (training layers [14] of the original, 3,540,096 parameters, same 80 steps
        and 40,960 tokens): +0.031 nats/token [0.012, 0.050] (bootstrap, 95%).
        ```
    """
    test = control["test"]
    low, high = test["intervals"][test["interval"]]
    numbers = f"{test['delta']:+.3f} {test['unit']} [{low:.3f}, {high:.3f}] ({test['interval']}, {test['confidence']:.0%})"
    head = f"the equal-parameter control ({_describe_control(control)}): {numbers}"
    # Only a gain over the original can be credited to adaptation rather than depth.
    gain = control.get("growth_vs_original")
    adaptation = "; the gain over the original is mostly adaptation, not depth" if gain is None or gain > 0 else ""
    if low > 0:
        sentence = f"Growth beat {head}."
    elif high < 0:
        sentence = f"Growth did NOT beat {head} — the control is better{adaptation}."
    else:
        sentence = f"Growth did NOT beat {head} — no certified difference, the control is as good{adaptation}."
    if control.get("growth_selected") == "old":
        sentence += " (The fallback rule kept the original function for the grown model: no growth was selected.)"
    return sentence


def retention_sentence(retention: dict) -> str:
    """Forgetting on the retention set, of the grown model and of the control (when trained), in one sentence.

    Example:
        ```python
        >>> print(retention_sentence(summary["retention"]))
        Forgetting on python_docs (128 examples; loss - loss of the original, positive = forgot): grown model: no certified
        forgetting: +0.000 nats/token [-0.002, 0.0027] (bootstrap, 95%); control: ...
        ```
    """
    parts = [f"grown model: {retention['growth']['verdict']}"]
    if retention.get("control"):
        parts.append(f"control: {retention['control']['verdict']}")
    where = f"{retention['data']} ({retention['num_examples']} examples; loss - loss of the original, positive = forgot)"
    return f"Forgetting on {where}: " + "; ".join(parts) + "."


def _fmt(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def summary_markdown(summary: dict) -> str:
    """The closing table a person reads first, from `summary.json`'s content.

    Example:
        ```python
        >>> print(summary_markdown(run_pipeline(cfg).summary))
        ```
    """
    if summary["decision"] != "grew":
        probe = summary["probe"]
        return (
            "| | |\n|---|---|\n"
            f"| decision | **do not grow** |\n| why | {summary.get('reason')} |\n"
            f"| positions with an observable signal | {probe['num_improvable']} of {probe['num_positions']} |\n"
        )
    test, probe = summary["test"], summary["probe"]
    rows = [
        ("grew at", f"k = {summary['positions']} ({summary['why']})"),
        *([("placement policy", summary["placement_policy"]["line"])] if summary.get("placement_policy") else []),
        ("probe", f"best k = {probe['best']}, signal {_fmt(probe['best_signal'])}, z = {_fmt(probe['best_z'], 1)}; "
                  f"{probe['num_improvable']} of {probe['num_positions']} positions improvable"),
        ("selected (fallback rule)", f"{summary['selected']}, Delta_ERM = {_fmt(summary['delta_erm'])}"),
        ("train loss", ", ".join(f"{k} {_fmt(v)}" for k, v in summary["train_losses"].items())),
        ("held-out loss", f"{_fmt(summary['held_out_loss']['before'])} -> {_fmt(summary['held_out_loss']['after'])}"),
        ("test loss old -> new", f"{_fmt(test['loss_old'])} -> {_fmt(test['loss_new'])}"),
        ("test delta (old - new)", _fmt(test["delta"])),
    ]
    rows += [(f"interval ({name})", f"[{_fmt(lo)}, {_fmt(hi)}]") for name, (lo, hi) in test["intervals"].items()]
    if summary.get("data_parts"):
        rows.append(("data", data_parts_text(summary["data_parts"])))
    if test.get("verdict"):
        rows.append(("verdict", str(test["verdict"])))
    if summary.get("control"):
        control = summary["control"]
        rows.append(("vs equal-parameter control", control["sentence"]))
        rows.append(("control test loss -> grown", f"{_fmt(control['test']['loss_control'])} -> {_fmt(control['test']['loss_grown'])}"))
    if summary.get("retention"):
        rows.append(("retention", summary["retention"]["sentence"]))
    rows += [(f"artifact: {k}", f"`{v}`") for k, v in summary.get("artifacts", {}).items()]
    if summary.get("pushed"):
        rows.append(("pushed", summary["pushed"]))
    if summary.get("reused"):
        rows.append(("reused from an identical earlier run", ", ".join(f"{k} ({v})" for k, v in summary["reused"].items())))
    rows.append(("time (s)", ", ".join(f"{k} {v}" for k, v in summary["timings_s"].items())))
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def write_summary(out: Path, summary: dict) -> None:
    """`summary.json` and `summary.md` in `out`."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text("# hf-depthgrow run\n\n" + summary_markdown(summary))
