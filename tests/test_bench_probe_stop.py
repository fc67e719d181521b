"""benchmarks/bench_probe_stop.py runs on CPU with a tiny model, so it cannot rot; its stop rule is the probe's.

The stop batch the benchmark derives from one traced probe must be where `probe(stop_patience=N)`
really stops, else its table would describe another rule.
"""

from pathlib import Path

import pytest
from bench_loader import load_benchmark
import torch

from hf_depthgrow.testing import tiny_inputs, tiny_model

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_probe_stop.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


def _rows(n=96, seq=12):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    batch = tiny_inputs(model, batch=n, seq=seq, seed=3)
    return model, [{k: v[i] for k, v in batch.items()} for i in range(n)]


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_the_benchmarks_stop_is_where_the_probe_stops(bench, patience):
    model, rows = _rows()
    result, trace, _ = bench.traced_probe(model, rows, batch_size=8, max_batches=12)
    assert [b for b, _, _ in trace] == list(range(3, 13))  # every batch from the first with a standard error
    stopped = bench.probe(model, rows, batch_size=8, max_batches=12, progress=False, stop_patience=patience)
    expected = bench.stop_batch(trace, patience)
    assert stopped.num_batches == expected
    if expected < 12:
        assert stopped.stopping is not None and f"after {expected} of at most 12 batches" in stopped.stopping
    else:
        assert stopped.stopping is None


def test_quick_run_writes_its_section(bench, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text(f"# Benchmark results\n\n{bench.SECTION}\n\nstale\n\n## After\n\nkept\n")
    assert bench.main(["--quick", "--write-results", "--results", str(results_md)]) == 0
    text = results_md.read_text()
    assert "stale" not in text and "kept" in text and text.count(bench.SECTION) == 1
    body = text.split(bench.SECTION, 1)[1].split("\n## ", 1)[0]
    assert body.count("| 2 |") + body.count("| 3 |") + body.count("| 4 |") + body.count("| 6 |") == 4
    assert "last changed at batch" in body
