"""Everything `run_pipeline` checks before its first expensive or destructive step (model load, output folder)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..data.sources import EMBEDDED_SOURCES
from ..data.text_files import check_data_path
from ..hub.loading import check_model_source, check_quantizable
from .output import MARKER, check_output_dir

# File endings of local data (`data.sources._read_local`): a name ending so is a missing file, not a Hub id.
_DATA_SUFFIXES = (".txt", ".csv", ".json", ".jsonl", ".parquet", ".tsv", ".md")


def check_data_source(source: str, what: str = "data") -> None:
    """Refuse a data source that is neither embedded, nor an existing file/folder, nor a possible Hub dataset id.

    `what` names the source in the message ("data", "retention data").

    Example:
        ```python
        >>> check_data_source("shakespeare")
        >>> check_data_source("nowhere/corpus.txt", "retention data")
        Traceback (most recent call last):
        FileNotFoundError: no such retention data file or folder: nowhere/corpus.txt
        ```
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if source in EMBEDDED_SOURCES:
        return
    if Path(source).expanduser().exists():
        check_data_path(Path(source).expanduser(), what)  # a FIFO or device: refused before the model loads
        return
    looks_local = source.startswith((".", "/", "~")) or source.count("/") > 1 or source.lower().endswith(_DATA_SUFFIXES)
    try:
        validate_repo_id(source)
    except HFValidationError:
        looks_local = True
    if looks_local:
        raise FileNotFoundError(f"no such {what} file or folder: {source}")


def check_evidence_cache(setting: str | None, output_dir: str) -> None:
    """A cache folder must be a folder (or not exist yet) and lie outside the output folder, which `overwrite` replaces.

    Example:
        ```python
        >>> check_evidence_cache("runs/x/cache", "runs/x")
        Traceback (most recent call last):
        ValueError: evidence_cache runs/x/cache lies inside output_dir runs/x, which an overwrite replaces: put it elsewhere
        ```
    """
    if setting is None or setting == "auto":
        return
    folder = Path(setting).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"evidence_cache {setting} is a file, not a folder")
    out = Path(output_dir).expanduser().resolve()
    if folder.resolve() == out or out in folder.resolve().parents:
        raise ValueError(f"evidence_cache {setting} lies inside output_dir {output_dir}, which an overwrite replaces: put it elsewhere")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)  # what huggingface_hub itself obeys (read from HF_HUB_OFFLINE at import)


def check_push(repo_id: str, endpoint: str | None) -> None:
    """Repo id form, HF_HUB_OFFLINE, a token, and one cheap `whoami` call: a push that must fail fails now."""
    from huggingface_hub import HfApi, get_token

    from ..hub.push import check_repo_id

    check_repo_id(repo_id)
    if "/" not in repo_id:  # also refused by check_repo_id; kept so a run never pushes to an implied owner
        raise ValueError(f"push_to_hub needs 'namespace/name' (an explicit owner), got {repo_id!r}")
    if _offline():
        raise ValueError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set")
    token = get_token()
    if not token:
        raise ValueError(f"cannot push to {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`)")
    try:
        HfApi(endpoint=endpoint).whoami(token=token)
    except Exception as err:  # any failure here means the push would fail after the whole run
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(f"cannot push to {repo_id}: the Hub did not accept the token or is unreachable ({reason})") from None


def check_run(cfg) -> None:
    """Inputs, output folder and push prerequisites of a run; raises one-line errors and touches nothing."""
    check_model_source(cfg.model)
    check_quantizable(cfg.model, cfg.quantize, trust_remote_code=cfg.trust_remote_code)
    check_data_source(cfg.data)
    inputs = {"model": cfg.model, "data": cfg.data}
    if cfg.retention_data is not None:
        check_data_source(cfg.retention_data, "retention data")
        inputs["retention data"] = cfg.retention_data
    again = not cfg.overwrite and same_run_again(cfg)
    if again:
        print(f"[hf-depthgrow run] {cfg.output_dir} holds this run's own earlier output (same settings): replacing it, "
              "reusing the evidence cache", file=sys.stderr)
    check_output_dir(cfg.output_dir, overwrite=cfg.overwrite or again, inputs=inputs)
    check_evidence_cache(cfg.evidence_cache, cfg.output_dir)
    if cfg.push_to_hub is not None:
        check_push(cfg.push_to_hub, cfg.hub_endpoint)


def same_run_again(cfg) -> bool:
    """Whether `cfg.output_dir` holds only the complete output of an earlier run with the same settings.

    The same command run again (`make run` twice) then replaces it without `--overwrite`, as the evidence cache
    makes that second run cheap; it recomputes what is there, so nothing is lost. Anything else in the folder
    keeps the refusal: another run's settings, an incomplete run (no marker), or a file newer than the marker,
    which the run writes last (so such a file was added afterwards, by someone else).
    """
    import yaml

    out = Path(cfg.output_dir)
    marker, saved = out / MARKER, out / "config.yaml"
    if not (out.is_dir() and marker.is_file() and saved.is_file()):
        return False
    try:
        previous = yaml.safe_load(saved.read_text())
        written = marker.stat().st_mtime_ns
        files = [p for p in out.rglob("*") if p.is_symlink() or not p.is_dir()]
        newer = any(p.lstat().st_mtime_ns > written for p in files)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    settings = {k: v for k, v in cfg.to_dict().items() if k != "overwrite"}
    return isinstance(previous, dict) and not newer and {k: v for k, v in previous.items() if k != "overwrite"} == settings
