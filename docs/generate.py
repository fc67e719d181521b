"""Write the tables of README.md and docs/decisions.md from the committed results, so no figure in them is typed.

A generated block sits between two markers; the first names its generator and the committed result folders it
reads (paths relative to docs/decisions/):

    <!-- generated: curve_table smollm2-budgets smollm2-budgets-curve probe:1 -->
    ...the table, written by this script...
    <!-- end generated -->

    python docs/generate.py            # rewrite every generated block from the committed JSON
    python docs/generate.py --check    # exit 1, naming the block, when a block differs from what the JSON gives

The figures of a generated block are checked against the same JSON by `docs/figures.py` as every other figure;
`--check` goes further: the block must be exactly what the results give, so editing a figure by hand, or
committing new results without regenerating, fails `tests/test_doc_figures.py`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DECISIONS = ROOT / "docs" / "decisions"
DOCS = (ROOT / "README.md", ROOT / "docs" / "decisions.md")
_BLOCK = re.compile(r"(<!-- generated: (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _compare(folder: str) -> dict:
    path = DECISIONS / folder / "compare.json"
    if not path.is_file():
        raise SystemExit(f"docs/generate.py: {path.relative_to(ROOT)} does not exist (a generated block names it)")
    return json.loads(path.read_text())


def _num(x: float) -> str:
    return f"{x:.3f}"


def _interval(d: dict) -> str:
    return f"{_num(d['mean'])} [{_num(d['low'])}, {_num(d['high'])}]"


def _rate(value: float) -> str:
    """A learning rate at two significant digits: 3e-5, 3.3e-4."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def _point(name: str) -> str:
    """`full@lr1e-05@80steps` as `` `full` at 1e-5 ``."""
    arm, rate = name.split("@")[:2]
    return f"`{arm}` at {_rate(float(rate.removeprefix('lr')))}"


def _status(entry: dict | None, *, old: bool) -> str:
    if entry is None:
        return "not tested"
    words = {"off the curve": "off it", "forgets more than the curve": "forgets more", "on the curve": "on it"}
    text = f"{words.get(entry['status'], entry['status'])}: {_interval(entry['margin'])}"
    if not old and entry.get("dominated_by"):
        text += f", dominated by {_point(entry['dominated_by'])}"
    return text


def _within(detail: dict) -> str:
    best = detail.get("best_within")
    if best in (None, "original") or not detail.get("best_within_test"):
        return "original"
    test = detail["best_within_test"]
    return f"{_point(best)}: {_interval(test['gain'])}, {_interval(test['forgetting'])}"


def curve_table(before: str, now: str, arm: str) -> str:
    """Per budget, the verdict within the forgetting budget and `arm` against the controls' curve, before (a curve
    through each control at its gain-optimal rate) and now (through every trained control point)."""
    old, new = _compare(before)["budgets"], _compare(now)["budgets"]
    eps = new[0]["frontier_detail"].get("max_forgetting") or _compare(now)["config"]["max_forgetting"]
    head = (f"| steps | within {eps:g} nats: before | within {eps:g} nats now (test gain, forgetting) | {arm} against the curve: before "
            f"| {arm} against every control point now |")
    lines = [head, "|---|---|---|---|---|"]
    for o, n in zip(old, new, strict=True):
        if o["steps"] != n["steps"]:
            raise SystemExit(f"docs/generate.py: {before} and {now} differ in budgets ({o['steps']} vs {n['steps']})")
        oc, nc = o["frontier_detail"]["control_curve"]["arms"], n["frontier_detail"]["control_curve"]["arms"]
        lines.append(f"| {n['steps']} | {_within(o['frontier_detail'])} | {_within(n['frontier_detail'])} "
                     f"| {_status(oc.get(arm), old=True)} | {_status(nc.get(arm), old=False)} |")
    return "\n".join(lines) + "\n"


def largest_budget_table(folder: str) -> str:
    """Every arm at the largest budget: its chosen rate, gain and forgetting with their corrected intervals."""
    result = _compare(folder)
    last = result["budgets"][-1]
    lines = ["| arm | rate | trainable parameters | gain | forgetting |", "|---|---|---|---|---|"]
    for name in (a["name"] for a in result["arms"] if a["kind"] != "original"):  # the arms in the order the run lists them
        arm = last["arms"][name]
        forgetting = _interval(arm["forgetting"]) if arm.get("forgetting") else "not measured"
        lines.append(f"| {name} | {_rate(arm['learning_rate'])} | {arm['trainable_parameters']:,} | {_interval(arm['gain'])} | {forgetting} |")
    return "\n".join(lines) + "\n"


def _seed_results(folder: str) -> list[tuple[int, dict]]:
    study = json.loads((DECISIONS / folder / "study.json").read_text())
    return [(seed, _compare(f"{folder}/seed{seed}")) for seed in study["seeds"]]


def regime_table(folder: str, steps: str) -> str:
    """A study's arms at `steps`, every seed side by side (`seed 0 | seed 1 | ...`): trainable parameters, gain,
    forgetting and where each growth arm sits against the curve of every control point."""
    seeds = _seed_results(folder)
    at = [next(b for b in result["budgets"] if b["steps"] == int(steps)) for _, result in seeds]
    arms = [a for a in seeds[0][1]["arms"] if a["kind"] != "original"]
    bar = " \\| "  # a | inside a table cell
    lines = ["| arm | trainable | gain | forgetting | against every control point |", "|---|---|---|---|---|"]
    for arm in arms:
        name = arm["name"]
        rows = [b["arms"][name] for b in at]
        curve = [b["frontier_detail"]["control_curve"]["arms"].get(name) for b in at]
        where = "(control)" if arm["kind"] != "growth" else bar.join(_status(c, old=False) for c in curve)
        gain, forgetting = bar.join(_interval(r["gain"]) for r in rows), bar.join(_interval(r["forgetting"]) for r in rows)
        lines.append(f"| {name} | {arm['trainable_parameters']:,} | {gain} | {forgetting} | {where} |")
    return "\n".join(lines) + "\n"


def placement_table(folder: str) -> str:
    """The placement policies' track record, the table of `folder/track_record.md`, from its `track_record.json`."""
    path = DECISIONS / folder / "track_record.json"
    if not path.is_file():
        raise SystemExit(f"docs/generate.py: {path.relative_to(ROOT)} does not exist (a generated block names it)")
    sys.path.insert(0, str(ROOT))  # the library's own formatter, so the doc's table is the one track_record.md holds
    from hf_depthgrow.probe.placement_policy import track_record_markdown

    return track_record_markdown(json.loads(path.read_text()))


GENERATORS = {"regime_table": regime_table, "curve_table": curve_table, "largest_budget_table": largest_budget_table,
              "placement_table": placement_table}


def render(args: str) -> str:
    name, *params = args.split()
    if name not in GENERATORS:
        raise SystemExit(f"docs/generate.py: unknown generator {name!r} (known: {', '.join(GENERATORS)})")
    return GENERATORS[name](*params)


def regenerate(text: str) -> tuple[str, list[str]]:
    """`text` with every generated block rewritten, and the arguments of the blocks that changed."""
    changed: list[str] = []

    def one(match: re.Match) -> str:
        body = render(match["args"])
        if body != match["body"]:
            changed.append(match["args"])
        return match[1] + body + match[4]

    return _BLOCK.sub(one, text), changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Change nothing; exit 1 when a block is out of date.")
    args = parser.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new, changed = regenerate(text)
        stale += [f"{doc.relative_to(ROOT)}: {c}" for c in changed]
        if changed and not args.check:
            doc.write_text(new)
    for line in stale:
        print(("out of date: " if args.check else "rewrote: ") + line)
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
