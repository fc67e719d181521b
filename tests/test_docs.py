"""What the docs state, checked against what they cite: no unfilled placeholder, the family survey's
version and counts, and no local path in the examples meant to be shared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
        *sorted((ROOT / "recipes").rglob("*.md")), *sorted((ROOT / "model_cards").rglob("*.md"))]  # fmt: skip
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# A placeholder: capitals joined by "_", in bold (**EVIDENCE_SIZE**; a bold acronym, **DDP**, is prose) or
# bare (EVIDENCE_CACHE_FIGURES) with each part two letters or more, so that L_S, B_W (the theory's symbols)
# and Q4_1 (a GGUF type) are prose.
_BOLD_PLACEHOLDER = re.compile(r"\*\*[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\*\*")
_BARE_PLACEHOLDER = re.compile(r"(?<![\w$])[A-Z]{2,}(?:_[A-Z]{2,})+(?!\w)")


def _prose(path: Path) -> str:
    """A page without its code blocks and code spans (where capitals are identifiers)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))


def _source_names() -> set[str]:
    """Capitalised names the package's code uses: in prose they name a constant, not a gap."""
    names = set()
    for path in (ROOT / "hf_depthgrow").rglob("*.py"):
        names |= set(_BARE_PLACEHOLDER.findall(path.read_text(encoding="utf-8")))
    return names


def test_placeholder_patterns_find_what_they_should():
    text = "one run takes **EVIDENCE_SIZE**.\n\nEVIDENCE_CACHE_FIGURES\n\n**DDP**, L_S(f_old), B_W, Q4_1 and `HF_HUB_OFFLINE` are prose."
    found = _BOLD_PLACEHOLDER.findall(text) + _BARE_PLACEHOLDER.findall(_CODE_SPAN.sub("", text))
    assert found == ["**EVIDENCE_SIZE**", "EVIDENCE_SIZE", "EVIDENCE_CACHE_FIGURES"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_doc_carries_an_unfilled_placeholder(path):
    prose = _prose(path)
    known = _source_names()
    gaps = _BOLD_PLACEHOLDER.findall(prose) + [w for w in _BARE_PLACEHOLDER.findall(prose) if w not in known]
    assert not gaps, f"{path.relative_to(ROOT)} ships unfilled placeholders {sorted(set(gaps))}: fill them with measured figures"


def _survey() -> tuple[str, int, int]:
    """The family survey's transformers version and its native / adapter counts, as docs/families.md records them."""
    text = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    heading = re.search(r"^## Decoder families \(measured with transformers (\d+\.\d+(?:\.\d+)?)\)$", text, re.M)
    assert heading, "docs/families.md: the decoder survey's heading must say 'measured with transformers X.Y'"
    section = text[heading.end():text.index("\n## ", heading.end())]
    paths = [row.split("|")[3].strip() for row in section.splitlines() if row.startswith("| ") and not row.startswith("| family")]
    stated = re.search(r"(\d+) families grow natively, (\d+) fall back", section)
    assert stated and (int(stated.group(1)), int(stated.group(2))) == (paths.count("native"), paths.count("adapter")), (
        "docs/families.md: the counts stated above the table are not the table's"
    )
    return heading.group(1), paths.count("native"), paths.count("adapter")


def test_docs_cite_the_family_survey_at_the_version_it_was_measured_with():
    """A rerun of the survey changes the heading of docs/families.md; every page citing it must follow."""
    version, native, _ = _survey()
    cites = []
    for path in DOCS:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for match in re.finditer(r"survey, measured with transformers (\d+\.\d+(?:\.\d+)?), (\d+) decoder families", text):
            cites.append((path.relative_to(ROOT).as_posix(), match.group(1), int(match.group(2))))
        for match in re.finditer(r"(\d+) decoder families of transformers (\d+\.\d+)", text):  # the old wording
            cites.append((path.relative_to(ROOT).as_posix(), match.group(2), int(match.group(1))))
    assert any(name == "README.md" for name, _, _ in cites), "README.md no longer cites the family survey as this test reads it"
    wrong = [c for c in cites if c[1:] != (version, native)]
    assert not wrong, f"the survey was measured with transformers {version} ({native} native); these cite otherwise: {wrong}"


# An absolute path under a home, temporary or root folder: where files sat on the machine of a run.
_LOCAL_PATH = re.compile(r"(?<![\w:/.-])(?:~|/(?:home|tmp|root|Users))/[^\s\"'`)]*")


@pytest.mark.parametrize(
    "path", sorted(p for p in (ROOT / "docs" / "examples").rglob("*") if p.suffix in (".md", ".json", ".yaml")),
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_shared_examples_name_no_local_path(path):
    """The committed examples are what a reader sees of a run's outputs: cards, reports and summaries."""
    leaks = _LOCAL_PATH.findall(path.read_text(encoding="utf-8"))
    assert not leaks, f"{path.relative_to(ROOT)} names local paths {leaks}"
