"""benchmarks/bench_evidence_share.py runs on CPU with a tiny model, so the benchmark cannot rot (timings not asserted)."""

from pathlib import Path

import pytest
from bench_loader import load_benchmark
from tiny_lm import make_tiny_lm

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_evidence_share.py"
SMALL = ["block_size=32", "max_examples=96", "batch_size=8", "train_steps=4", "eval_steps=2", "stone_max_batches=2",
         "probe_max_batches=2", "learning_rate=3e-3", "loss_bound=10.0", "force=true"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark(BENCH)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_tiny_lm(tmp_path_factory.mktemp("evidence_share"))


def _argv(workdir, *extra):
    sets = [a for s in SMALL for a in ("--set", s)]
    return ["--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), *sets, *extra]


def test_evidence_share_bench_times_the_phases_and_the_floor(bench, workdir, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    result = bench.main(_argv(workdir, "--repeats", "2", "--write-results", "--results", str(results_md)))
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        assert all(run[k] >= 0 for k in (*bench.PHASES, "minimal_evaluation")) and run["train"] > 0
        assert run["intervals"] and all(lo <= hi for lo, hi in run["intervals"].values())
    # The floor is the probe and the cheapest evaluation: never above what the run spends on evidence.
    for run, floor in zip(result["runs"], result["floor"]):
        assert floor == pytest.approx((run["probe"] + run["minimal_evaluation"]) / run["train"])
    text = results_md.read_text()
    assert "## Other\n\nkept" in text and bench.SECTION in text and "Floor" in text
    section = text.split(bench.SECTION, 1)[1]
    described = [ln for ln in section.splitlines() if not ln.startswith("Command")]
    assert str(tmp_path) not in text and not any(str(workdir) in ln for ln in described)  # names, not local paths
    assert "sample.txt" in section


def test_evidence_share_bench_refuses_another_test_set(bench, workdir, monkeypatch):
    # The check is real: an evaluation that measured something else stops the benchmark.
    real = bench.minimal_evaluation

    def shifted(cfg, model):
        seconds, result = real(cfg, model)
        result.delta += 1.0
        return seconds, result

    monkeypatch.setattr(bench, "minimal_evaluation", shifted)
    with pytest.raises(RuntimeError, match="another test set"):
        bench.main(_argv(workdir, "--repeats", "1"))


def test_evidence_share_bench_rejects_bad_arguments(bench):
    for argv in (["--repeats", "0"], ["--set", "no_equals_sign"]):
        with pytest.raises(SystemExit) as err:
            bench.main(argv)
        assert err.value.code == 2
