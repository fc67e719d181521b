"""benchmarks/bench_quantized_base.py runs on CPU with a tiny model, so the benchmark cannot rot (memory not asserted)."""

import argparse
import warnings
from pathlib import Path

import pytest
from bench_loader import load_benchmark

pytest.importorskip("bitsandbytes", reason='pip install "hf_depthgrow[quantize]"')

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quantized_base.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


def test_each_variant_trains_and_the_section_has_a_row_per_variant(bench, tmp_path):
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes on casting inputs for 8-bit matmuls
        for name in bench.VARIANTS:  # in this process: the script runs each in a fresh one
            args = argparse.Namespace(variant=name, model="tiny", tmp=str(tmp_path), positions=[2], steps=1, batch=2, seq=8,
                                      examples=6, threads=1)
            rows.append(bench.variant(args))
    by_name = {r["variant"]: r for r in rows}
    # The quantised bases hold fewer bytes; the trained set is the same new block in each.
    assert by_name["4bit"]["base_bytes"] < by_name["8bit"]["base_bytes"] < by_name["float32"]["base_bytes"]
    assert all(r["peak_train_mib"] >= r["rss_loaded_mib"] > 0 for r in rows)
    assert len({r["trainable"] for r in rows}) == 1 and rows[0]["trainable"] > 0
    args = argparse.Namespace(model="tiny", positions=[2], steps=1, batch=2, seq=8, threads=1)
    text = bench.markdown(rows, args, "python benchmarks/bench_quantized_base.py --model tiny")
    assert text.startswith(bench.SECTION) and len([ln for ln in text.splitlines() if ln.startswith(("| float32", "| 4bit", "| 8bit"))]) == 3
