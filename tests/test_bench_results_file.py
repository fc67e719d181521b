"""benchmarks/results_file.py: the command every benchmark records and the one way each writes its section."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from results_file import command_line, publish, rerun_command  # noqa: E402


def test_recorded_command_drops_the_results_path_and_quotes_what_needs_it():
    argv = ["--results", "/home/me/RESULTS.md", "--set", "data=my corpus.txt", "--results=/tmp/x.md", "--repeats", "3"]
    assert rerun_command("bench_x.py", argv) == "python benchmarks/bench_x.py --set 'data=my corpus.txt' --repeats 3"


def test_command_line_reads_the_process_arguments_when_given_none(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--write-results", "--results", "/abs/R.md"])
    assert command_line("bench_x.py", None) == "python benchmarks/bench_x.py --write-results"
    assert command_line("bench_x.py", ["--quick"]) == "python benchmarks/bench_x.py --quick"


def test_publish_writes_only_when_asked(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    publish(argparse.Namespace(write_results=False, results=results), "## S", "## S\n\nrow\n")
    assert not results.exists() and "row" in capsys.readouterr().out
    publish(argparse.Namespace(write_results=True, results=results), "## S", "## S\n\nrow\n")
    assert results.read_text() == "# Benchmark results\n\n## S\n\nrow\n"
