"""benchmarks/bench_budget_sweep.py runs on CPU with a tiny model, so the budget-sweep benchmark cannot rot.

Its plumbing is checked (both ways run every repeat and give identical per-budget results, the section is
written); timings are not asserted: speed is measured in benchmarks.
"""

from pathlib import Path

from bench_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_budget_sweep.py"
# Loaded at collection, with the other imports: the comparison code it loads is then long-lived for the
# collector (see conftest.py), instead of rescanned at every trial's collection.
bench = load_benchmark(BENCH)


def test_budget_sweep_benchmark_checks_identity_and_writes_its_section(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    m = bench.main(["--quick", "--repeats", "1", "--write-results", "--results", str(results_md)])
    assert [len(v) for v in m["times"].values()] == [1, 1] and all(t > 0 for v in m["times"].values() for t in v)
    text = results_md.read_text()
    assert bench.section_heading("tiny") in text and "**median**" in text and "identical both ways" in text
