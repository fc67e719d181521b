"""benchmarks/bench_cost_growth.py runs on CPU with a tiny model, so the cost-growth benchmark cannot rot.

Only the benchmark's plumbing is checked here (every sweep and point measured and tabled, FLOP
counts that grow with the sweep variable, the results section replaced on a rerun); its timings
are not asserted: speed is measured in benchmarks, never in tests.
"""

import itertools
from pathlib import Path

import pytest
from bench_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cost_growth.py"
QUICK = ["--model", "tiny", "--quick", "--repeats", "1"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


def _table_rows(text: str, section: str) -> list[list[str]]:
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in body.splitlines() if ln.startswith("| (")]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in rows]


def test_cost_growth_measures_every_sweep_and_replaces_its_section(bench, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    # An older run's section sits between two others: it is replaced in place, the others are kept.
    results_md.write_text("# Benchmark results\n\n## Before\n\nkept before\n\n## Cost growth\n\nstale table\n\n## After\n\nkept after\n")
    results = bench.main([*QUICK, "--write-results", "--results", str(results_md)])

    quick = bench.DEFAULTS["quick"]
    expected = {("a", work, seq) for work in ("probe", "train step", "evaluation") for seq in quick["seqs"]}
    expected |= {("b", "probe", n) for n in (1, 2, 5)}  # the tiny Llama has 4 layers: 'all' = 5 positions
    expected |= {("c", "evaluation", n) for n in quick["test_sizes"]}
    assert {(r["sweep"], r["work"], r["x"]) for r in results} == expected
    for r in results:
        assert len(r["wall"]) == len(r["cpu"]) == 1 and r["wall"][0] > 0
        assert r["flops"] > 0 and 0 < r["attention_flops"] < r["flops"]  # the CPU attention kernel is counted too
    # Predicted cost grows with each sweep's variable, for every kind of work.
    ordered = sorted(results, key=lambda r: (r["sweep"], r["work"], r["x"]))
    for _, group in itertools.groupby(ordered, key=lambda r: (r["sweep"], r["work"])):
        flops = [r["flops"] for r in group]
        assert flops == sorted(flops) and len(set(flops)) == len(flops), flops

    text = results_md.read_text()
    assert text.count(bench.SECTION + "\n") == 1
    assert "## Before\n\nkept before" in text and "## After\n\nkept after" in text and "stale table" not in text
    assert text.index("## Before") < text.index(bench.SECTION) < text.index("## After")
    assert "--model tiny --quick --repeats 1" in text and "torch " in text and "CPU cores" in text
    rows = _table_rows(text, bench.SECTION)
    assert len(rows) == len(expected)
    labels = {(row[0], row[1], row[2]) for row in rows}
    assert ("(b) positions probed", "probe", "5 positions (all)") in labels
    assert {("(a) sequence length", "train step", f"T={s}") for s in quick["seqs"]} <= labels
    assert {("(c) test-set size", "evaluation", f"n={n}") for n in quick["test_sizes"]} <= labels
    # The smallest point of each sweep is its own baseline: ratio 1.
    assert sum(row[-1] == "**1.000**" and row[8] == "1.00x" for row in rows) >= 5

    # A rerun (one point per sweep, to keep the test short) replaces the section instead of adding a second one.
    bench.main([*QUICK, "--seqs", "16", "--positions", "1", "--test-sizes", "4", "--write-results", "--results", str(results_md)])
    text = results_md.read_text()
    assert text.count(bench.SECTION + "\n") == 1
    assert len(_table_rows(text, bench.SECTION)) == 3 + 1 + 1
    assert text.index("## Before") < text.index(bench.SECTION) < text.index("## After")
    assert "kept after" in text and "--seqs 16 --positions 1" in text


def test_cost_growth_appends_its_section_where_there_is_none(bench, tmp_path):
    # Through `publish`, as the benchmark writes it (the shared helper of benchmarks/results_file.py).
    import argparse

    from results_file import publish

    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    args = argparse.Namespace(write_results=True, results=results_md)
    publish(args, bench.SECTION, bench.SECTION + "\n\nnew table\n")
    assert results_md.read_text() == "# Benchmark results\n\n## Other\n\nkept\n\n## Cost growth\n\nnew table\n"
    publish(args, bench.SECTION, bench.SECTION + "\n\nnewer table\n")
    assert results_md.read_text() == "# Benchmark results\n\n## Other\n\nkept\n\n## Cost growth\n\nnewer table\n"


def test_cost_growth_rejects_bad_sizes_before_loading(bench):
    for bad in (["--repeats", "0"], ["--positions", "none"], ["--seqs", "0"]):
        with pytest.raises(SystemExit) as err:
            bench.main(["--model", "tiny", *bad])
        assert err.value.code == 2


def test_flop_count_leaves_out_one_time_work(bench):
    # Regression: the count was a point's first run, so one-time work (the chunked loss's self-check on a model's
    # first chunked batch) counted as per-call cost; T=256 showed 2.6-3.1x T=128's FLOPs for 2x the tokens.
    import argparse

    import torch

    a = torch.ones(8, 8)
    calls = []

    def run():  # its first call does 5 matmuls, every later call one
        calls.append(1)
        for _ in range(5 if len(calls) == 1 else 1):
            a @ a

    point = bench.Point("a", "probe", 1, "x", run)
    bench.measure([point], argparse.Namespace(warmup=0, repeats=1, seed=0), torch.device("cpu"))
    assert point.flops == 2 * 8 * 8 * 8  # one call's steady work
    assert len(point.wall) == 1
