"""benchmarks/bench_compare.py runs on CPU with a tiny model, so the compare benchmark cannot rot.

Only its plumbing is checked (both ways run every repeat, the rates they chose are compared, the
results section is replaced in place); timings are not asserted: speed is measured in benchmarks.
"""

from pathlib import Path

from bench_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compare.py"
# Loaded at collection, with the other imports: the comparison code it loads is then long-lived for the
# collector (see conftest.py), instead of rescanned at every trial's collection.
bench = load_benchmark(BENCH)


def test_compare_benchmark_times_both_ways_and_replaces_its_section(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    heading = bench.section_heading("tiny")
    results_md.write_text(f"# Benchmark results\n\n## Before\n\nkept\n\n{heading}\n\nstale\n\n## After\n\nkept too\n")
    m = bench.main(["--quick", "--repeats", "2", "--write-results", "--results", str(results_md)])
    assert [len(v) for v in m["times"].values()] == [2, 2] and all(t > 0 for v in m["times"].values() for t in v)
    assert len(m["agree"]) == 2 and all(0 <= a <= 1 for a in m["agree"])
    text = results_md.read_text()
    assert "stale" not in text and text.count(heading) == 1
    assert text.index("## Before") < text.index(heading) < text.index("## After") and "kept too" in text
    body = text.split(heading, 1)[1].split("\n## ", 1)[0]
    assert body.count("| repeat ") == 2 and "**median**" in body and "--quick --repeats 2" in body


def test_results_writer_appends_a_new_section_and_leaves_no_temporary_file(tmp_path):
    import sys

    sys.path.insert(0, str(BENCH.parent))
    from results_file import write_section

    path = tmp_path / "RESULTS.md"
    write_section(path, "## One", "## One\n\nfirst\n")
    write_section(path, "## Two", "## Two\n\nsecond\n")
    write_section(path, "## One", "## One\n\nfirst again\n")
    assert path.read_text() == "# Benchmark results\n\n## One\n\nfirst again\n\n## Two\n\nsecond\n"
    assert [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"]
