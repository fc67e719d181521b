"""What a run says at the end: `summary.json`, and `summary.md`, the table a person reads first."""

from __future__ import annotations

import json
from pathlib import Path


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
        ("probe", f"best k = {probe['best']}, signal {_fmt(probe['best_signal'])}, z = {_fmt(probe['best_z'], 1)}; "
                  f"{probe['num_improvable']} of {probe['num_positions']} positions improvable"),
        ("selected (fallback rule)", f"{summary['selected']}, Delta_ERM = {_fmt(summary['delta_erm'])}"),
        ("train loss", ", ".join(f"{k} {_fmt(v)}" for k, v in summary["train_losses"].items())),
        ("held-out loss", f"{_fmt(summary['held_out_loss']['before'])} -> {_fmt(summary['held_out_loss']['after'])}"),
        ("test loss old -> new", f"{_fmt(test['loss_old'])} -> {_fmt(test['loss_new'])}"),
        ("test delta (old - new)", _fmt(test["delta"])),
    ]
    rows += [(f"interval ({name})", f"[{_fmt(lo)}, {_fmt(hi)}]") for name, (lo, hi) in test["intervals"].items()]
    if test.get("verdict"):
        rows.append(("verdict", str(test["verdict"])))
    rows += [(f"artifact: {k}", f"`{v}`") for k, v in summary.get("artifacts", {}).items()]
    if summary.get("pushed"):
        rows.append(("pushed", summary["pushed"]))
    rows.append(("time (s)", ", ".join(f"{k} {v}" for k, v in summary["timings_s"].items())))
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def write_summary(out: Path, summary: dict) -> None:
    """`summary.json` and `summary.md` in `out`."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text("# hf-depthgrow run\n\n" + summary_markdown(summary))
