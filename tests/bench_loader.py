"""Load a script of benchmarks/ as a module (they are scripts, not a package), for the tests that keep them from rotting."""

import importlib.util
from pathlib import Path


def load_benchmark(path: Path):
    """The module of the benchmark script at `path`, executed once (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
