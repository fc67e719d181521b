"""The placement policies' track record on every committed oracle sweep, and the default it chooses.

    python docs/decisions/placement/track_record.py            # writes docs/decisions/placement/track_record.json and .md
    python docs/decisions/placement/track_record.py --check    # exit 1 if the library's default or its row differ from it

Reads each task's `probe_validation.json` and `placement_scores.json` (`docs/decisions/placement/scores.py`) and nothing
else: no model is loaded. `hf_depthgrow.probe.placement_policy` holds the rules (regret, relative regret, Spearman,
the worst case and the tie-break); `DEFAULT_PLACEMENT` and `DEFAULT_TRACK_RECORD` there must equal what this writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DECISIONS = REPO / "docs" / "decisions"
# Every committed oracle sweep, by the name the table prints.
TASKS = {
    "smollm2-shakespeare": DECISIONS / "smollm2-shakespeare",
    "minilm-tweets": DECISIONS / "minilm-tweets",
    "vit-fashion-mnist-to-digits": DECISIONS / "vit-fashion-mnist-to-digits",
    # the regime study as re-run (docs/decisions.md, "A miniature of LLaMA Pro's regime"); its first design's sweep
    # (regime-study/oracle) stays committed but is not a task
    "regime-v2": DECISIONS / "regime-v2" / "oracle",
}
OUTPUT = DECISIONS / "placement"
ROW_KEYS = ("policy", "measured", "worst_relative_regret", "worst_task", "worst_regret", "worst_regret_task", "mean_spearman")


def committed_record() -> dict:
    """`track_record` over the committed tasks, with the files it read."""
    from hf_depthgrow.probe.placement_policy import load_task, track_record

    record = track_record([load_task(folder, name) for name, folder in TASKS.items()])
    record["sources"] = {name: [str(p.relative_to(REPO)) for p in sorted(folder.glob("*.json")) if p.name in ("probe_validation.json", "placement_scores.json")]
                         for name, folder in TASKS.items()}
    return record


def default_row(record: dict) -> dict:
    """The default's row cut to what the library's `DEFAULT_TRACK_RECORD` holds."""
    row = next(r for r in record["policies"] if r["policy"] == record["default"])
    return {k: row[k] for k in ROW_KEYS}


def _matches(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 if isinstance(a[k], float) else a[k] == b[k] for k in a)


def main(argv: list[str] | None = None) -> int:
    from hf_depthgrow.probe.placement_policy import (
        DEFAULT_PLACEMENT,
        DEFAULT_TRACK_RECORD,
        track_record_markdown,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare the library's default with the committed record")
    args = parser.parse_args(argv)
    record = committed_record()
    row = default_row(record)
    same = record["default"] == DEFAULT_PLACEMENT and _matches(row, DEFAULT_TRACK_RECORD)
    if args.check:
        print("the library's default matches the committed track record" if same else
              f"the library's default ({DEFAULT_PLACEMENT}) differs from the committed record's: {json.dumps(row)}")
        return 0 if same else 1
    from hf_depthgrow.utils import atomic_write_text, write_json

    record["command"] = "python docs/decisions/placement/track_record.py"
    write_json(OUTPUT / "track_record.json", record)
    table = track_record_markdown(record)
    atomic_write_text(OUTPUT / "track_record.md", f"# Placement policies on the committed oracle sweeps\n\nRule: {record['rule']}.\n"
                      f"Default: **{record['default']}**.\n\n{table}")
    print(table)
    print(f"default: {record['default']}; wrote {OUTPUT / 'track_record.json'} and .md")
    if not same:
        print(f"update DEFAULT_PLACEMENT / DEFAULT_TRACK_RECORD in hf_depthgrow/probe/placement_policy.py to: {json.dumps(row)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
