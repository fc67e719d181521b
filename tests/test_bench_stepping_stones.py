"""benchmarks/bench_stepping_stones.py runs on CPU with a tiny model, so the benchmark cannot rot (timings not asserted)."""

from pathlib import Path

import pytest
from bench_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_stepping_stones.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


def test_stepping_stones_bench_times_both_arms_and_writes_its_section(bench, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    result = bench.main(["--model", "tiny", "--repeats", "2", "--batches", "2", "--batch", "2", "--seq", "16", "--position", "2",
                         "--write-results", "--results", str(results_md)])
    assert set(result["runs"]) == set(bench.ARMS)
    assert all(len(times) == 2 and min(times) > 0 for times in result["runs"].values())
    assert result["position"] == 2 and min(result["evaluations"].values()) >= 2
    text = results_md.read_text()
    assert "## Other\n\nkept" in text and bench.SECTION in text
    rows = [ln for ln in text.split(bench.SECTION, 1)[1].splitlines() if ln.startswith(("| two", "| stepping_stones"))]
    assert len(rows) == 2
    assert str(tmp_path) not in text  # no local path in the recorded command


def test_stepping_stones_bench_refuses_different_stones(bench, monkeypatch):
    # The check is real: stones that differ stop the benchmark instead of timing two different things.
    monkeypatch.setattr(bench, "same_stones", lambda a, b: False)
    with pytest.raises(RuntimeError, match="different stepping stones"):
        bench.main(["--model", "tiny", "--repeats", "1", "--batches", "1", "--batch", "2", "--seq", "16", "--position", "1"])


def test_stepping_stones_bench_rejects_bad_sizes(bench):
    with pytest.raises(SystemExit) as err:
        bench.main(["--model", "tiny", "--repeats", "0"])
    assert err.value.code == 2
