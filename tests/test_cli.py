"""`hf-depthgrow <command>`: kebab-case flags, input errors as one line with exit code 2, and the import boundary."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from hf_depthgrow.cli import COMMANDS, MODULES, main
from hf_depthgrow.testing import tiny_model

REPO = Path(__file__).resolve().parents[1]


def test_usage_and_unknown_command(capsys):
    assert main([]) == 0 and "commands:" in capsys.readouterr().out
    assert main(["grwo"]) == 2 and "unknown command 'grwo'" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_kebab_case_flags(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out
    flags = [w.strip("[],") for w in out.split() if w.startswith(("--", "[--"))]
    if "--config_file" in flags:  # accelerate's own flag, in the train command's example
        flags.remove("--config_file")
    assert flags and not [f for f in flags if "_" in f.split("=")[0]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--learning-rate", "fast"], "hf-depthgrow run: argument --learning-rate: expected a float, got 'fast'"),
        (["train", "--learning-rte", "0.1"], "hf-depthgrow train: unknown option --learning-rte; did you mean --learning-rate?"),
        (["probe", "--model", "./no/such/model", "--data", "x", "--output-dir", "o"], "hf-depthgrow probe: no such model folder: ./no/such/model"),
        (["eval", "--model", "m", "--output-dir", "o"], "hf-depthgrow eval: missing --data (or `data:` in --config)"),
        (["grow", "--model", "m", "--positions", "1"], "hf-depthgrow grow: missing --output-dir (or `output_dir:` in --config)"),
        (["demo", "--positions", "x"], "hf-depthgrow demo: argument --positions: expected an int, got 'x'"),
        (["run", "--config", "no-such.yaml"], "hf-depthgrow run: no such config file: no-such.yaml"),
    ],
)
def test_input_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message


def test_grow_command(tmp_path, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    config = tmp_path / "grow.yaml"
    config.write_text("positions: [1]\nblock: adapter\nseed: 3\n")
    out = tmp_path / "g"
    assert main(["grow", "--model", str(tmp_path / "m"), "--config", str(config), "--output-dir", str(out)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["native_indices"] == [] and len(record["adapters"]) == 1  # one adapter block, at k = 1
    assert (out / "config.json").is_file()
    assert main(["grow", "--model", str(tmp_path / "m"), "--positions", "1", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"hf-depthgrow grow: {out} exists and is not empty; pass --overwrite to replace it"


def _imports(path: Path):
    """`(module, names)` of every import in a file, relative imports resolved against its package."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, [a.name for a in node.names]


def test_library_never_imports_the_cli():
    offenders = []
    for path in (REPO / "hf_depthgrow").rglob("*.py"):
        if "cli" in path.relative_to(REPO / "hf_depthgrow").parts[:1]:
            continue
        for module, names in _imports(path):
            if module.startswith("hf_depthgrow.cli") or (module == "hf_depthgrow" and "cli" in names):
                offenders.append(f"{path.relative_to(REPO)}: {module}")
    assert not offenders


# The public API: the package, its subpackages' roots, and the few top-level modules.
PUBLIC_MODULES = {"hf_depthgrow", "hf_depthgrow.config", "hf_depthgrow.plots", "hf_depthgrow.losses", "hf_depthgrow.chunked_loss", "hf_depthgrow.utils", "hf_depthgrow.testing"}
SUBPACKAGES = {"growth", "data", "probe", "training", "evaluation", "hub", "pipeline", "scaling", "comparison"}


@pytest.mark.parametrize("folder", ["recipes", "benchmarks"])
def test_recipes_and_benchmarks_use_public_api_only(folder):
    offenders = []
    for path in (REPO / folder).glob("*.py"):
        for module, names in _imports(path):
            if not module.startswith("hf_depthgrow"):
                continue
            private = [p for p in module.split(".") + names if p.startswith("_")]
            public = module in PUBLIC_MODULES or module in {f"hf_depthgrow.{s}" for s in SUBPACKAGES}
            if not public or private:
                offenders.append(f"{path.name}: from {module} import {names}")
    assert not offenders


def test_python_m_entry_points_exist():
    for command in COMMANDS:
        assert hasattr(importlib.import_module(f"hf_depthgrow.cli.{MODULES.get(command, command)}"), "main")
