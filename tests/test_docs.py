"""What the docs state, checked against what they cite: no unfilled placeholder, the family survey's
version and counts, and no local path in the examples meant to be shared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
        *sorted((ROOT / "recipes").rglob("*.md")), *sorted((ROOT / "model_cards").rglob("*.md"))]
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


# --------------------------------------------------------------------------- figures that surprise, explained where they appear


def _eval_result(old, new, bound: float, level: float = 0.05):
    from hf_depthgrow.evaluation.bounds import paired_intervals
    from hf_depthgrow.evaluation.result import EvalResult

    details = paired_intervals(old, new, delta=level, bound=bound, n_bootstrap=200, seed=0)
    m, mean = len(old), sum(o - n for o, n in zip(old, new)) / len(old)
    return EvalResult(
        task="sequence_classification", mode="full", num_examples=m, num_tokens=m, loss_old=sum(old) / m, loss_new=sum(new) / m,
        delta=mean, mean_delta=mean, per_example_old=list(old), per_example_new=list(new), example_ids=list(range(m)),
        example_weights=[1.0] * m, level=level, loss_bound=bound, loss_bound_source="given",
        intervals={k: (d["low"], d["high"]) for k, d in details.items()}, interval_details=details,
        certified={k: d["certified"] for k, d in details.items()},
    )


def test_report_explains_a_bernstein_interval_wider_than_hoeffdings():
    import numpy as np

    from hf_depthgrow.evaluation.bounds import bernstein_half_width, hoeffding_half_width
    from hf_depthgrow.evaluation.report import bernstein_crossover, render_markdown

    rng = np.random.default_rng(0)
    old = rng.uniform(1.0, 4.0, 16).tolist()
    small = _eval_result(old, [x - 0.1 for x in rng.uniform(1.0, 4.0, 16)], bound=5.18)  # a small eval: m = 16, B = 5.18
    details = small.interval_details
    assert details["bernstein"]["half_width"] > details["hoeffding"]["half_width"] == pytest.approx(3.5175, abs=1e-4)
    text = render_markdown(small)
    note = next(line for line in text.splitlines() if line.startswith("Bernstein's interval is wider than Hoeffding's here"))
    assert "7 (2B) ln(4/delta) / (3 (m-1)) = 7.062 at m = 16" in note and "only from m = 59 test examples on" in note
    # The crossover is where the range term alone drops below Hoeffding's half-width, at any B.
    m = bernstein_crossover(0.05)
    for bound in (1.0, 10.8):
        assert bernstein_half_width(np.zeros(m), 0.05, bound) < hoeffding_half_width(bound, m, 0.05)
        assert bernstein_half_width(np.zeros(m - 1), 0.05, bound) >= hoeffding_half_width(bound, m - 1, 0.05)
    # Many examples that vary little: Bernstein is the narrower, and the report says nothing.
    old = rng.uniform(2.0, 2.2, 400).tolist()
    large = _eval_result(old, [x - 0.05 for x in old], bound=5.18)
    assert large.interval_details["bernstein"]["half_width"] < large.interval_details["hoeffding"]["half_width"]
    assert "wider than Hoeffding" not in render_markdown(large)


def test_probe_plot_and_report_say_what_the_threshold_is(tmp_path, monkeypatch):
    from hf_depthgrow.probe import plots
    from hf_depthgrow.probe import probe
    from hf_depthgrow.testing import tiny_inputs, tiny_model

    model = tiny_model("llama")
    batches = [tiny_inputs(model, batch=2, seq=8, seed=s) for s in range(4)]
    figures = []
    real_save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: figures.append(fig) or real_save(fig, path, **kw))
    for threshold, rule in ((None, "calibrated on certified gains"), (2.0, "z_threshold of this probe")):
        result = probe(model, batches, positions=[1, 2], progress=False, **({} if threshold is None else {"z_threshold": threshold}))
        plots.plot_probe(result, tmp_path / "probe.png")
        legend = [t.get_text() for t in figures[-1].axes[1].get_legend().get_texts()]
        assert f'"improvable" verdict: z > {result.z_threshold:g} ({rule})' in legend
        verdict = next(line for line in result.summary().splitlines() if line.startswith("verdict: "))
        assert f'"improvable" where z > {result.z_threshold:g}' in verdict
    assert "calibrated against certified test gains" in probe(model, batches, positions=[1], progress=False).summary()
    for page, needle in (("probe.md", '"improvable" verdict:\nz > -1 (calibrated on certified gains)'),
                         ("evaluation.md", "Bernstein can be wider than Hoeffding at small m")):
        assert " ".join(needle.split()) in " ".join((ROOT / "docs" / page).read_text(encoding="utf-8").split()), page
