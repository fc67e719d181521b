"""benchmarks/bench_eval_head.py runs on CPU with a tiny model, so the benchmark cannot rot (timings not asserted)."""

from pathlib import Path

import pytest
from bench_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_eval_head.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


def test_eval_head_times_every_variant_and_writes_its_section(bench, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    result = bench.main(["--model", "tiny", "--repeats", "2", "--batches", "2", "--batch", "2", "--seq", "16",
                         "--write-results", "--results", str(results_md)])
    assert set(result["runs"]) == {(k, v) for k in ("whole pass", "head only") for v in bench.VARIANTS}
    assert all(len(times) == 2 and min(times) > 0 for times in result["runs"].values())
    text = results_md.read_text()
    assert "## Other\n\nkept" in text and bench.SECTION in text
    assert len([ln for ln in text.split(bench.SECTION, 1)[1].splitlines() if ln.startswith(("| whole pass", "| head only"))]) == 6
    assert str(tmp_path) not in text  # no local path in the recorded command


def test_eval_head_rejects_bad_sizes(bench):
    with pytest.raises(SystemExit) as err:
        bench.main(["--model", "tiny", "--repeats", "0"])
    assert err.value.code == 2
