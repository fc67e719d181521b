"""Check that every figure the README and docs/decisions.md print comes from a committed result.

A figure is a decimal number (`0.817`, `14.6x`, `1.25 M`) or a percentage in the prose and tables, outside code.
Each section of docs/decisions.md is checked against the committed results it links to (`decisions/<folder>/...`,
with that folder's trial store `<folder>-trials`); a section that links none, and the README, against every
committed JSON under docs/decisions/ and docs/examples/ (the README also against benchmarks/RESULTS.md, where its
timings are measured). Numbers inside stored strings (a verdict's "14.6x") count. A figure matches a stored value at the precision it is
printed with, sign aside ("forgets 0.075 less" prints a margin stored as -0.075). An interval `x [a, b]` (or `[a, b]`)
must match as a whole: its numbers must sit in one stored object (a dict's values, with its lists' values), so a
point and bounds that each match something somewhere do not pass. A lone figure is checked only against its section's pool, which holds
thousands of values: it catches a figure from a run that was never committed more often than a misprint. `N of M (p%)` is checked for
its own arithmetic. Figures that are not results (a paper's, a rule's threshold, a confidence level) are listed
in `NOT_RESULTS` with what they are; anything else that matches nothing is reported.

    python docs/figures.py            # every unmatched figure, with its line; exit 1 if any
    python docs/figures.py --list     # every figure and the file its value was found in
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from bisect import bisect_left
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = (ROOT / "docs" / "decisions", ROOT / "docs" / "examples")
DOCS = (ROOT / "README.md", ROOT / "docs" / "decisions.md")

# Figures that are not results of this repository, each with what it is.
NOT_RESULTS = {
    "75.11": "LLaMA Pro (arXiv:2401.02415), Table 5: 8 interleaved blocks on the law task",
    "65.34": "LLaMA Pro (arXiv:2401.02415), Table 5: LoRA on the law task",
    "5.24": "the transformers release the family survey was measured with",
    "3.3e-6": "the lowest rate of full's default forgetting grid: 3e-5 two x3 steps down, a rule, not a result",
    "95%": "the confidence level of every interval",
    "90%": "the agreement successive halving must reach to be switched on by default, a rule set before the runs",
}
_FIGURE = re.compile(
    r"(?<![\w.:/-])((?:\d+(?:,\d{3})*\.\d+|\d+(?:,\d{3})*)(?:e[-+]?\d+)?)(\s?[Mk]\b|\s?%|x\b)?(?![\w.]*\d)"
)
_OF = re.compile(r"(\d+) of (\d+) \((\d+(?:\.\d+)?)%\)")
_LINK = re.compile(r"decisions/([\w.-]+)/")
_ARXIV = re.compile(r"arXiv:\d{4}\.\d{4,5}")
_NUMBER = r"-?\d+\.\d+"
_INTERVAL = re.compile(rf"(?:({_NUMBER})\s+)?\[({_NUMBER}), ({_NUMBER})\]")


def _numbers(obj, out: list) -> None:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, str):
        out.extend(float(x.replace(",", "")) for x in re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?", obj))
    elif isinstance(obj, (int, float)):
        if math.isfinite(obj):
            out.append(abs(float(obj)))
    elif isinstance(obj, dict):
        for value in obj.values():
            _numbers(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _numbers(value, out)


def _list_numbers(value) -> list[float]:
    if isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
        return [abs(float(v)) for v in value if not isinstance(v, (bool, str)) and math.isfinite(v)]
    return []


def _groups(obj, out: list) -> None:
    """The numbers each dict holds directly, in its lists of numbers, or in the lists of its child dicts (a point
    beside `{"intervals": {"bootstrap": [low, high]}}`): where an interval's parts sit together."""
    if isinstance(obj, dict):
        own: list[float] = []
        for value in obj.values():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                own.append(abs(float(value)))
            own += _list_numbers(value)
            if isinstance(value, dict):
                own += [x for v in value.values() for x in _list_numbers(v)]
            _groups(value, out)
        if len(own) >= 2:
            out.append(sorted(own))
    elif isinstance(obj, list):
        for value in obj:
            _groups(value, out)


class Pool:
    """The absolute values of every number in some JSON files, sorted, with the file each came from."""

    def __init__(self, files):
        pairs, self.groups = [], []
        for path in files:
            found: list[float] = []
            text = Path(path).read_text()
            data = json.loads(text) if path.suffix == ".json" else text
            _numbers(data, found)
            pairs += [(v, path) for v in found]
            groups: list = []
            _groups(data, groups)
            self.groups += [(g, path) for g in groups]
        pairs.sort()
        self.values = [v for v, _ in pairs]
        self.files = [p for _, p in pairs]

    def find_together(self, figures):
        """The file of one stored object holding every `(value, half unit)` of `figures`, else None."""
        for group, path in self.groups:
            if all(any(abs(v - value) <= half + 1e-12 for v in group) for value, half in figures):
                return path
        return None

    def find(self, value: float, half_unit: float):
        """The file holding a value within `half_unit` of `value`, else None."""
        i = bisect_left(self.values, value - half_unit - 1e-12)
        if i < len(self.values) and self.values[i] <= value + half_unit + 1e-12:
            return self.files[i]
        return None


def _json_files(folder: Path) -> list[Path]:
    """The JSON files under `folder` that git tracks: a local run's ignored checkpoints are not committed results."""
    if not folder.is_dir():
        return []
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.json"], cwd=folder, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return sorted(folder.rglob("*.json"))  # not a git checkout (an unpacked release): every file is committed
    return sorted(folder / name for name in listed.stdout.decode().split("\0") if name)


def _sections(text: str):
    """`(first line number, lines)` per `##`/`###` section, code blocks blanked."""
    sections, current, start, fenced = [], [], 1, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            current.append("")
            continue
        if not fenced and re.match(r"#{2,3} ", line):
            sections.append((start, current))
            current, start = [], number
        current.append("" if fenced else line)
    sections.append((start, current))
    return sections


def _figures(line: str):
    """`(text, value, half unit, is percent)` for each figure of a prose or table line."""
    line = re.sub(r"`[^`]*`", " ", line)  # code
    line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
    line = _ARXIV.sub(" ", line)
    for match in _FIGURE.finditer(line):
        digits, unit = match.group(1), (match.group(2) or "").strip()
        if "." not in digits and unit not in ("M", "k", "%"):
            continue  # counts, steps and sizes are integers: not checked
        value = float(digits.replace(",", ""))  # a rate printed 8.1e-3 is 0.0081
        mantissa, _, exponent = digits.partition("e")
        places = len(mantissa.split(".")[1]) if "." in mantissa else 0
        scale = {"M": 1e6, "k": 1e3}.get(unit, 1.0)
        half = 0.5 * 10**-places * 10 ** int(exponent or 0) * scale
        yield digits + (unit if unit else ""), value * scale, half, unit == "%"


def results_pool(doc: Path) -> Pool:
    """Every committed result a figure of `doc` may come from."""
    files = [f for folder in RESULTS for f in _json_files(folder)]
    return Pool(files + ([ROOT / "benchmarks" / "RESULTS.md"] if doc.name == "README.md" else []))


def check(doc: Path, everything: Pool):
    """`(line number, figure, file or None)` for every figure of `doc`."""
    results = []
    for start, lines in _sections(doc.read_text()):
        folders = sorted({m for line in lines for m in _LINK.findall(line)})
        files = [f for name in folders for f in _json_files(ROOT / "docs" / "decisions" / name)
                 + _json_files(ROOT / "docs" / "decisions" / f"{name}-trials")]
        pool = Pool(files) if files and doc.name == "decisions.md" else everything
        for offset, line in enumerate(lines):
            own = {m.group(3) for m in _OF.finditer(line)
                   if abs(100 * int(m.group(1)) / int(m.group(2)) - float(m.group(3)))
                   <= 0.5 * 10 ** -len((m.group(3).split(".") + [""])[1])}
            inside: set[str] = set()
            for match in _INTERVAL.finditer(line):
                parts = [g for g in match.groups() if g is not None]
                figures = [(abs(float(g)), 0.5 * 10 ** -len(g.split(".")[1])) for g in parts]
                inside.update(g.lstrip("-") for g in parts)
                results.append((start + offset, match.group(0), pool.find_together(figures)))
            for text, value, half, percent in _figures(line):
                if text in inside:
                    continue  # checked with its interval
                if text.rstrip("%") in own or text in NOT_RESULTS:
                    results.append((start + offset, text, "(its own arithmetic)" if text.rstrip("%") in own else "(not a result)"))
                    continue
                source = pool.find(value, half) or (percent and pool.find(value / 100, half / 100))
                results.append((start + offset, text, source or None))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every figure with the file its value was found in")
    args = parser.parse_args(argv)
    missing = 0
    for doc in DOCS:
        for number, text, source in check(doc, results_pool(doc)):
            where = source if isinstance(source, str) and source.startswith("(") else (
                Path(source).relative_to(ROOT) if source else "NOT FOUND")
            missing += source is None
            if args.list or source is None:
                print(f"{doc.relative_to(ROOT)}:{number}: {text}  <- {where}")
    print(f"{missing} figure(s) not found in the committed results")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
