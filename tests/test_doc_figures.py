"""Every figure the README and docs/decisions.md print comes from a committed result (docs/figures.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "docs" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules["doc_figures"] = figures
_spec.loader.exec_module(figures)


@pytest.mark.parametrize("doc", figures.DOCS, ids=lambda p: p.name)
def test_every_figure_in_the_docs_is_found_in_the_committed_results(doc):
    missing = [f"{doc.name}:{line}: {text}" for line, text, source in figures.check(doc, figures.results_pool(doc)) if source is None]
    assert not missing, "figures not found in the committed results (python docs/figures.py):\n" + "\n".join(missing)


def test_an_interval_must_match_one_stored_object(tmp_path, monkeypatch):
    results = tmp_path / "docs" / "decisions" / "run"
    results.mkdir(parents=True)
    (results / "compare.json").write_text('{"gain": {"mean": 0.817, "low": 0.788, "high": 0.844}, "other": [0.9, 0.95]}')
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    doc = tmp_path / "docs" / "decisions.md"
    doc.write_text(
        "## A run\n\nSee [it](decisions/run/compare.md).\n\n"
        "Gain 0.817 [0.788, 0.844].\n"  # one object: found
        "Gain 0.817 [0.788, 0.950].\n"  # every number stored, but not in one object: not found
        "Gain 0.818 [0.788, 0.844].\n"  # a misprinted point
        "Forgets 0.844 less; 43 of 48 (89.6%); 95% intervals.\n"  # a lone figure, its own arithmetic, a level
        "```\n0.123 inside code is not a figure\n```\n"
    )
    pool = figures.Pool(sorted((tmp_path / "docs").rglob("*.json")))
    found = {(line, text): source for line, text, source in figures.check(doc, pool)}
    assert found[(5, "0.817 [0.788, 0.844]")] is not None
    assert found[(6, "0.817 [0.788, 0.950]")] is None
    assert found[(7, "0.818 [0.788, 0.844]")] is None
    assert found[(8, "0.844")] is not None and found[(8, "89.6%")] == "(its own arithmetic)"
    assert found[(8, "95%")] == "(not a result)"
    assert not any(text == "0.123" for _, text in found)


def test_only_files_git_tracks_are_committed_results(tmp_path):
    # A local run's ignored checkpoints once supplied a figure that a clean clone does not have.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "compare.json").write_text('{"learning_rate": 0.0081}')
    (run / "checkpoints" / "entry.json").write_text('{"learning_rate": 8.1}')
    (tmp_path / ".gitignore").write_text("checkpoints/\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    assert figures._json_files(run) == [run / "compare.json"]


def test_a_figure_in_exponent_form_is_checked_at_its_printed_precision(tmp_path):
    (tmp_path / "compare.json").write_text('{"learning_rate": 0.0081}')
    pool_values = figures.Pool([tmp_path / "compare.json"])
    [(text, value, half, _)] = list(figures._figures("full at 8.1e-3 gains"))
    assert text == "8.1e-3" and pool_values.find(value, half) is not None
    [(_, value, half, _)] = list(figures._figures("full at 8.3e-3 gains"))
    assert pool_values.find(value, half) is None
    assert list(figures._figures("grids {1e-3, 3e-3}")) == []  # a grid, not a measured figure


_gen_spec = importlib.util.spec_from_file_location("doc_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(_gen_spec)
_gen_spec.loader.exec_module(generate)


def test_every_generated_table_is_what_the_committed_results_give():
    stale = []
    for doc in generate.DOCS:
        text = doc.read_text()
        assert text.count("<!-- generated: ") == text.count("<!-- end generated -->"), f"{doc.name}: an unclosed generated block"
        stale += [f"{doc.name}: {args}" for args in generate.regenerate(text)[1]]
    assert not stale, "generated tables out of date (python docs/generate.py rewrites them):\n" + "\n".join(stale)


def test_a_figure_edited_by_hand_inside_a_generated_table_is_caught():
    doc = (ROOT / "docs" / "decisions.md").read_text()
    start = doc.index("<!-- generated: largest_budget_table smollm2-budgets -->")
    block = doc[start:doc.index("<!-- end generated -->", start) + len("<!-- end generated -->")]
    assert generate.regenerate(block)[1] == []
    edited = block.replace("0.751 [0.613, 0.883]", "0.761 [0.613, 0.883]")
    assert edited != block and generate.regenerate(edited)[1] == ["largest_budget_table smollm2-budgets"]


def test_the_placement_table_in_the_doc_is_the_track_records():
    doc = (ROOT / "docs" / "decisions.md").read_text()
    start = doc.index("<!-- generated: placement_table placement -->\n")
    body = doc[start:doc.index("<!-- end generated -->", start)].split("\n", 1)[1]
    track = (ROOT / "docs" / "decisions" / "placement" / "track_record.md").read_text()
    assert body.startswith("| policy |") and track.endswith(body)  # the table track_record.py wrote, not a copy by hand
    record = json.loads((ROOT / "docs" / "decisions" / "placement" / "track_record.json").read_text())
    assert body.split("\n")[0].split(" | ")[1:1 + len(record["tasks"])] == record["tasks"]  # one column per task, in order
    assert f"| **{record['default']}** |" in body
